"""Write tests/vectors/: LMCKV blobs made by the real LMCache 0.5.6, their inputs, and a manifest.

``make vectors`` runs it (``make lmcache`` installs LMCache first). Every blob is
written by ``lmcache.v1.kv_codec``; kvcodec is not imported, so the vectors are
an outside reference. The inputs are seeded, so a rerun with the same LMCache
and torch writes the same bytes (``--check`` compares instead of writing).

Kinds in ``manifest.json`` (the schema of ``../shared/vectors``, plus ``external``):

- ``codec``: ``NAME.k`` / ``NAME.v`` hold K and V as raw little-endian
  ``input_dtype`` of ``input_shape`` (token-major ``[tokens, heads, dim]``);
  encoding them with the listed fields (scope, dtypes, page_size, hashes,
  ids, chunk_size) gives exactly ``NAME.blob``;
- ``external``: the same with V given pre-quantized, ``NAME.q`` (FP8 codes,
  token-major) and ``NAME.s`` (its fp32 scales, one per head);
- ``header``: a blob to parse and re-serialize byte for byte;
- ``corrupt``: a blob edited from another (``from``) that readers must refuse
  with ``expect_error`` for ``expect_reason``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "vectors"
LMCACHE_VERSION = "0.5.6"
FIXED = struct.Struct("<8sHHHHHHqqqqqqq")  # written out here too: the script reads no kvcodec code


@dataclass(frozen=True)
class Case:
    """One codec vector: inputs and every encode option given to LMCache."""

    name: str
    scope: str
    dtype: torch.dtype
    tokens: int
    heads: int
    dim: int
    page_size: int
    seed: int
    scale_dtype: torch.dtype = torch.float32
    fp8_dtype: torch.dtype = torch.float8_e4m3fn  # LMCache 0.5.6 writes e4m3fn only
    chunk_size: int | None = None
    """Tokens of a full chunk (None: the tokens given; more for the last chunk of a sequence)."""
    layer_id: int = 0
    chunk_id: int = 0
    hashes: dict[str, str] = field(default_factory=dict)
    zero: Callable[[torch.Tensor], None] | None = None
    """Zeroes a group of V (token-major), so an all-zero group's unit scale is covered."""


CASES = [
    Case("pt_fp16", "PER_TENSOR", torch.float16, 24, 2, 16, 8, 1, hashes={"model_id": "meta/tiny"}),
    Case("pt_bf16_one_element", "PER_TENSOR", torch.bfloat16, 1, 1, 1, 1, 2),
    Case(
        "plh_bf16_zero_head",
        "PER_LAYER_HEAD",
        torch.bfloat16,
        16,
        4,
        16,
        16,
        3,
        layer_id=5,
        chunk_id=2,
        zero=lambda v: v[:, 1].zero_(),
    ),
    Case("plh_fp16_scale_fp16", "PER_LAYER_HEAD", torch.float16, 8, 3, 40, 8, 4, scale_dtype=torch.float16),
    Case("plh_fp16_partial_chunk", "PER_LAYER_HEAD", torch.float16, 12, 2, 16, 4, 5, chunk_size=256),
    Case(
        "pph_fp16_zero_page",
        "PER_PAGE_HEAD",
        torch.float16,
        32,
        2,
        16,
        8,
        6,
        layer_id=31,
        chunk_id=9,
        hashes={
            "model_id": "org/Model-8B",
            "model_revision_hash": "r3v",
            "tokenizer_hash": "tök",
            "rope_config_hash": "rope",
            "attention_backend": "FLASH_ATTN",
            "kv_layout": "NHD",
        },
        zero=lambda v: v[8:16, 0].zero_(),
    ),
    Case("pph_bf16_odd", "PER_PAGE_HEAD", torch.bfloat16, 15, 3, 24, 5, 7, hashes={"kv_layout": "HND"}),
    Case("pph_bf16_scale_fp16", "PER_PAGE_HEAD", torch.bfloat16, 16, 1, 8, 4, 8, scale_dtype=torch.float16),
]


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case.seed)
    shape = (case.tokens, case.heads, case.dim)
    k = torch.randn(shape, generator=g).to(case.dtype)
    spread = torch.rand(1, case.heads, 1, generator=g) * 40 + 0.01  # heads of different ranges
    v = (torch.randn(shape, generator=g) * spread).to(case.dtype)
    if case.zero is not None:
        case.zero(v)
    return k, v


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _entry(lm, blob: bytes, name: str, kind: str) -> dict:
    """The manifest entry of ``blob``: every header field as LMCache reads it."""
    enc = lm.AsymK16V8Codec().from_bytes(blob)
    header_len = len(blob) - len(enc.payload)
    fields = {
        "k_dtype": _dtype_name(enc.k_dtype),
        "v_dtype": _dtype_name(enc.v_dtype),
        "scale_dtype": _dtype_name(enc.scale_dtype),
        "scale_scope": lm.ScaleScope(enc.scale_scope).name,
        "layer_id": enc.layer_id,
        "chunk_id": enc.chunk_id,
        "chunk_size": enc.chunk_size,
        "page_size": enc.page_size,
        "kv_head_count": enc.kv_head_count,
        "head_dim": enc.head_dim,
        "scale_shape": list(enc.scale_shape),
        "k_payload_len": enc.k_payload_len,
        "v_payload_len": enc.v_payload_len,
        "scale_payload_len": enc.scale_payload_len,
        "hashes": {k: getattr(enc.hashes, k) or "" for k in HASH_KEYS},
        "payload_crc32": zlib.crc32(blob[header_len:]),
    }
    return {"name": name, "kind": kind, **fields, "header_len": header_len}


HASH_KEYS = (
    "model_id",
    "model_revision_hash",
    "tokenizer_hash",
    "rope_config_hash",
    "attention_backend",
    "kv_layout",
)


def _codec_blob(lm, case: Case, k: torch.Tensor, v: torch.Tensor) -> bytes:
    codec = lm.AsymK16V8Codec(
        scale_scope=lm.ScaleScope[case.scope], scale_dtype=case.scale_dtype, fp8_dtype=case.fp8_dtype
    )
    paged = case.scope == "PER_PAGE_HEAD"
    pages = case.tokens // case.page_size
    view = (lambda t: t.view(pages, case.page_size, case.heads, case.dim)) if paged else (lambda t: t)
    enc = codec.encode(
        view(k),
        view(v),
        hashes=lm.CodecHashes(**case.hashes),
        layer_id=case.layer_id,
        chunk_id=case.chunk_id,
        chunk_size=case.chunk_size or case.tokens,
        page_size=case.page_size,
        kv_head_count=case.heads,
        head_dim=case.dim,
        page_axis=0 if paged else None,
    )
    return codec.to_bytes(enc)


def codec_vectors(lm) -> dict[str, tuple[dict, dict[str, bytes]]]:
    """name -> (manifest entry, files) for every :data:`CASES` entry."""
    out = {}
    for case in CASES:
        assert case.scope != "PER_PAGE_HEAD" or case.tokens % case.page_size == 0  # LMCache takes whole pages
        k, v = _inputs(case)
        blob = _codec_blob(lm, case, k, v)
        entry = _entry(lm, blob, case.name, "codec")
        entry.update(input_shape=[case.tokens, case.heads, case.dim], input_dtype=_dtype_name(case.dtype))
        out[case.name] = (entry, {".blob": blob, ".k": _raw(k), ".v": _raw(v)})
    return out


def external_vectors(lm) -> dict[str, tuple[dict, dict[str, bytes]]]:
    """Scope EXTERNAL: V quantized by the caller, its scales attached; and a header-only one without them."""
    k, v = _inputs(Case("ext", "EXTERNAL", torch.float16, 16, 2, 16, 8, 11))
    scales = torch.tensor([0.05, 0.125], dtype=torch.float32)
    q = (v.float() / scales.view(1, 2, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    codec = lm.AsymK16V8Codec(scale_scope=lm.ScaleScope.EXTERNAL)
    fields = dict(layer_id=1, chunk_id=0, chunk_size=16, page_size=8, kv_head_count=2, head_dim=16)
    blob = codec.to_bytes(codec.encode(k, v, precomputed_v_quant=q, precomputed_v_scales=scales, **fields))
    entry = _entry(lm, blob, "ext_fp16_attached_scales", "external")
    entry.update(input_shape=[16, 2, 16], input_dtype="float16")
    out = {entry["name"]: (entry, {".blob": blob, ".k": _raw(k), ".q": _raw(q), ".s": _raw(scales)})}
    # Scales kept out of band: an EncodedKV with no scale payload, serialized by LMCache.
    enc = lm.EncodedKV(
        k_dtype=torch.float16,
        v_dtype=torch.float8_e4m3fn,
        scale_dtype=torch.float32,
        scale_scope=lm.ScaleScope.EXTERNAL,
        hashes=lm.CodecHashes(model_id="ext"),
        scale_shape=(),
        k_payload_len=len(_raw(k)),
        v_payload_len=len(_raw(q)),
        scale_payload_len=0,
        payload=_raw(k) + _raw(q),
        **fields,
    )
    blob = codec.to_bytes(enc)
    entry = _entry(lm, blob, "ext_fp16_scales_out_of_band", "header")
    out[entry["name"]] = (entry, {".blob": blob})
    return out


def _reseal_v1(blob: bytearray, header_len: int) -> bytes:
    struct.pack_into("<I", blob, header_len - 4, zlib.crc32(blob[header_len:]))
    return bytes(blob)


def _edit(src: bytes, header_len: int, scale_at: int, how: str) -> bytes:
    """``src`` with one defect; CRC-valid unless the defect is the CRC's business."""
    b = bytearray(src)
    edits = {
        "bad_magic": lambda: b.__setitem__(slice(0, 5), b"LMCKX"),
        "flip_payload_bit": lambda: b.__setitem__(header_len + 3, b[header_len + 3] ^ 0x10),
        "truncated_payload": lambda: b.__delitem__(slice(len(b) - 5, None)),
        "bad_crc": lambda: struct.pack_into("<I", b, header_len - 4, zlib.crc32(b[header_len:]) ^ 1),
        "unknown_dtype": lambda: struct.pack_into("<H", b, 12, 9),
        "negative_payload_len": lambda: struct.pack_into(
            "<q", b, header_len - 4 - 2 - _hash_len(b, header_len) - 24, -8
        ),
        "reserved_nonzero": lambda: struct.pack_into("<H", b, 18, 1),
        "unknown_scope": lambda: struct.pack_into("<H", b, 10, 4),
        "too_many_scale_dims": lambda: struct.pack_into("<q", b, 68, 9),
        "nan_scale": lambda: struct.pack_into("<f", b, scale_at, float("nan")),
        "inf_scale": lambda: struct.pack_into("<f", b, scale_at, float("inf")),
        "zero_scale": lambda: struct.pack_into("<f", b, scale_at, 0.0),
        "negative_scale": lambda: struct.pack_into("<f", b, scale_at, -0.5),
    }
    edits[how]()
    if how.endswith("_scale"):
        return _reseal_v1(b, header_len)
    return bytes(b)


def _hash_len(b: bytearray, header_len: int) -> int:
    """Bytes of the hash pairs (after the count), read forward from the fixed part."""
    n_dims = FIXED.unpack_from(b, 0)[-1]
    off = FIXED.size + 8 * n_dims + 24
    (count,) = struct.unpack_from("<H", b, off)
    off += 2
    start = off
    for _ in range(2 * count):
        (length,) = struct.unpack_from("<H", b, off)
        off += 2 + length
    assert off == header_len - 4
    return off - start


# defect -> (error class, reason) readers must raise
CORRUPT = {
    "bad_magic": ("CorruptEncodedKVError", "bad_magic"),
    "flip_payload_bit": ("CorruptEncodedKVError", "crc_mismatch"),
    "truncated_payload": ("CorruptEncodedKVError", "truncated_payload"),
    "bad_crc": ("CorruptEncodedKVError", "crc_mismatch"),
    "unknown_dtype": ("CorruptEncodedKVError", "unknown_dtype_id"),
    "negative_payload_len": ("CorruptEncodedKVError", "negative_payload_len"),
    "reserved_nonzero": ("CorruptEncodedKVError", "reserved_nonzero"),
    "unknown_scope": ("CorruptEncodedKVError", "unknown_scope_id"),
    "too_many_scale_dims": ("CorruptEncodedKVError", "scale_rank_out_of_range"),
    "nan_scale": ("CorruptEncodedKVError", "bad_scale"),
    "inf_scale": ("CorruptEncodedKVError", "bad_scale"),
    "zero_scale": ("CorruptEncodedKVError", "bad_scale"),
    "negative_scale": ("CorruptEncodedKVError", "bad_scale"),
}


def corrupt_vectors(
    codec: dict[str, tuple[dict, dict[str, bytes]]],
) -> dict[str, tuple[dict, dict[str, bytes]]]:
    """Each defect of :data:`CORRUPT` applied to the per_page_head vector (its last scale for scale defects)."""
    src_entry, src_files = codec["pph_fp16_zero_page"]
    src, hl = src_files[".blob"], src_entry["header_len"]
    scale_at = len(src) - 4
    out = {}
    for how, (error, reason) in CORRUPT.items():
        name = f"corrupt_{how}"
        entry = {"name": name, "kind": "corrupt", "from": src_entry["name"], "expect_error": error}
        entry["expect_reason"] = reason
        out[name] = (entry, {".blob": _edit(src, hl, scale_at, how)})
    return out


def build() -> dict[str, tuple[dict, dict[str, bytes]]]:
    import lmcache
    import lmcache.v1.kv_codec as lm

    version = getattr(lmcache, "__version__", None)
    if version is not None and version != LMCACHE_VERSION:
        sys.exit(f"LMCache {version} installed; the vectors are made with {LMCACHE_VERSION} (make lmcache)")
    codec = codec_vectors(lm)
    return {**codec, **external_vectors(lm), **corrupt_vectors(codec)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true", help="compare with the files in --out, write nothing")
    args = parser.parse_args(argv)
    vectors = build()
    files: dict[str, bytes] = {}
    entries = []
    for name, (entry, blobs) in vectors.items():
        entry["blob_sha256"] = hashlib.sha256(blobs[".blob"]).hexdigest()
        entries.append(entry)
        files.update({name + suffix: data for suffix, data in blobs.items()})
    manifest = {
        "format": "LMCKV v1",
        "made_by": f"LMCache {LMCACHE_VERSION}",
        "script": "dev/make_vectors.py",
    }
    manifest["vectors"] = entries
    files["manifest.json"] = (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode()
    if args.check:
        stale = [
            n
            for n, data in files.items()
            if not (args.out / n).is_file() or (args.out / n).read_bytes() != data
        ]
        print("\n".join(f"differs: {n}" for n in stale) or f"{len(files)} files as written")
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (args.out / name).write_bytes(data)
    print(f"wrote {len(files)} files, {sum(map(len, files.values()))} bytes, to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
