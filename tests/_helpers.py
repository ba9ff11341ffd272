"""Test helpers shared by several test files: raw LMCKV blobs with any header field, test vectors."""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcodec.format import MAGIC

__all__ = ["DEFAULT_PAIRS", "K", "S", "V", "pairs_blob", "raw_blob", "read_vector", "vector_manifest"]


def vector_manifest(folder: Path) -> list[dict[str, Any]]:
    """The entries of ``folder/manifest.json`` (tests/vectors, or ../shared/vectors)."""
    return json.loads((folder / "manifest.json").read_text())["vectors"]


def read_vector(folder: Path, name: str) -> bytes:
    """The bytes of ``name`` in ``folder``: a full file name, or a vector name (``.blob`` added)."""
    path = folder / name
    return (path if path.suffix else path.with_suffix(".blob")).read_bytes()


_FIXED = struct.Struct("<8sHHHHHHqqqqqqq")
_KEYS = (
    "model_id",
    "model_revision_hash",
    "tokenizer_hash",
    "rope_config_hash",
    "attention_backend",
    "kv_layout",
)
_VALUES = ("meta/tiny", "", "tok123", "", "", "NHD")
DEFAULT_PAIRS = tuple((k.encode(), v.encode()) for k, v in zip(_KEYS, _VALUES))

# 4 tokens x 2 heads x 4 dims, page_size 2: K fp16 64 B, V fp8 32 B, per_page_head scales (2, 2) fp32 16 B.
K = bytes(range(64))
V = bytes(range(100, 132))
S = struct.pack("<4f", 0.5, 1.0, 2.0, 0.25)


def pairs_blob(pairs: Sequence[tuple[bytes, bytes]], count: int | None = None) -> bytes:
    out = struct.pack("<H", len(pairs) if count is None else count)
    for k, v in pairs:
        out += struct.pack("<H", len(k)) + k + struct.pack("<H", len(v)) + v
    return out


def raw_blob(
    *,
    magic: bytes = MAGIC,
    version: int = 1,
    scope: int = 2,
    k_id: int = 2,
    v_id: int = 7,
    s_id: int = 4,
    reserved: int = 0,
    layer_id: int = 3,
    chunk_id: int = 7,
    chunk_size: int = 4,
    page_size: int = 2,
    kv_head_count: int = 2,
    head_dim: int = 4,
    scale_shape: Sequence[int] = (2, 2),
    scale_shape_n: int | None = None,
    k: bytes = K,
    v: bytes = V,
    s: bytes = S,
    k_len: int | None = None,
    v_len: int | None = None,
    s_len: int | None = None,
    pairs: Sequence[tuple[bytes, bytes]] = DEFAULT_PAIRS,
    hash_section: bytes | None = None,
    crc: int | None = None,
    trailing: bytes = b"",
) -> bytes:
    """A blob with these exact header fields. The CRC is right (v1: payload; v2: header
    prefix + payload) unless ``crc`` is given, so each test hits the rule it names."""
    prefix = _FIXED.pack(
        magic,
        version,
        scope,
        k_id,
        v_id,
        s_id,
        reserved,
        layer_id,
        chunk_id,
        chunk_size,
        page_size,
        kv_head_count,
        head_dim,
        len(scale_shape) if scale_shape_n is None else scale_shape_n,
    )
    prefix += struct.pack(f"<{len(scale_shape)}q", *scale_shape)
    prefix += struct.pack(
        "<qqq",
        len(k) if k_len is None else k_len,
        len(v) if v_len is None else v_len,
        len(s) if s_len is None else s_len,
    )
    prefix += pairs_blob(pairs) if hash_section is None else hash_section
    payload = k + v + s
    if crc is None:
        crc = zlib.crc32(prefix + payload) if version >= 2 else zlib.crc32(payload)
    return prefix + struct.pack("<I", crc) + payload + trailing
