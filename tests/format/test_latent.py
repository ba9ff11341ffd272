"""MLA latent blobs (scale scheme LATENT, docs/FORMAT.md): golden vectors re-created byte for byte,
their rules, and every path that must not read one as K and V refusing it by reason."""

from __future__ import annotations

import json
import struct

import pytest

from kvcodec.errors import CodecError, CorruptEncodedKVError, Reason, UnsupportedConfigError
from kvcodec.format import Hashes, Header, ScaleScheme, ScaleScope, assemble, parse
from tests.paths import VECTORS

MLA = VECTORS / "mla"
LATENT_DIM = 512 + 64
"""DeepSeek-V2/V3: kv_lora_rank 512 latent, then the 64-element rope part."""


def _entry(tokens: int, seed: int, itemsize: int = 2) -> bytes:
    """Deterministic latent bytes (any bit pattern: a latent is copied, never interpreted)."""
    fmt = {2: "H", 4: "I"}[itemsize]
    mask = (1 << (8 * itemsize)) - 1
    vals = [((i + 1) * 2654435761 + seed * 40503) & mask for i in range(tokens * LATENT_DIM)]
    return struct.pack(f"<{len(vals)}{fmt}", *vals)


def _header(dtype: str, tokens: int, **over: object) -> Header:
    fields: dict = {
        "k_dtype": dtype,
        "v_dtype": dtype,
        "scale_scope": ScaleScope.NONE,
        "scale_scheme": ScaleScheme.LATENT,
        "version": 2,
        "layer_id": 3,
        "chunk_id": 1,
        "chunk_size": 256,
        "kv_head_count": 1,
        "head_dim": LATENT_DIM,
        "hashes": Hashes(model_id="golden-mla", kv_layout="vllm-token-major;mla=512+64"),
    }
    return Header(**{**fields, **over})


def golden() -> dict[str, bytes]:
    """The LATENT vectors: name -> blob bytes."""
    return {
        "latent_bf16_5tok.blob": bytes(assemble(_header("bfloat16", 5), b"", _entry(5, 1))),
        "latent_fp16_16tok.blob": bytes(assemble(_header("float16", 16), b"", _entry(16, 2))),
        "latent_fp32_1tok.blob": bytes(assemble(_header("float32", 1), b"", _entry(1, 3, 4))),
    }


def _write() -> None:  # pragma: no cover - run once by hand: python -c "...; _write()"
    MLA.mkdir(exist_ok=True)
    for name, blob in golden().items():
        (MLA / name).write_bytes(blob)
    (MLA / "manifest.json").write_text(json.dumps(sorted(golden()), indent=1) + "\n")


@pytest.mark.parametrize("name", sorted(golden()))
def test_golden_latent_vectors_are_recreated_byte_for_byte(name: str) -> None:
    assert json.loads((MLA / "manifest.json").read_text()) == sorted(golden())
    assert (MLA / name).read_bytes() == golden()[name]


@pytest.mark.parametrize("name", sorted(golden()))
def test_a_latent_blob_holds_the_entry_bit_for_bit(name: str) -> None:
    p = parse((MLA / name).read_bytes(), strict=True)
    h = p.header
    assert (h.scale_scheme, h.scale_scope, h.version) == (ScaleScheme.LATENT, ScaleScope.NONE, 2)
    assert h.k_payload_len == h.scale_payload_len == 0 and (h.kv_head_count, h.head_dim) == (1, LATENT_DIM)
    tokens = h.v_payload_len // (LATENT_DIM * h.v_dtype.itemsize)
    seed = {"bfloat16": 1, "float16": 2, "float32": 3}[h.v_dtype.name]
    assert bytes(p.payload) == _entry(tokens, seed, h.v_dtype.itemsize)


@pytest.mark.parametrize(
    "over",
    [
        {"v_dtype": "float8_e4m3fn"},
        {"scale_scope": ScaleScope.PER_TENSOR},
        {"version": 1},
    ],
)
def test_the_writer_refuses_a_latent_blob_breaking_its_rules(over: dict) -> None:
    with pytest.raises(UnsupportedConfigError) as e:
        assemble(_header("bfloat16", 2, **over), b"", _entry(2, 1))
    assert e.value.reason == Reason.BAD_VALUE
    with pytest.raises(UnsupportedConfigError):  # K bytes beside the entry
        assemble(_header("bfloat16", 1), _entry(1, 1), _entry(1, 1))


@pytest.mark.parametrize(
    ("offset", "value", "reason"), [(10, 0, Reason.INCONSISTENT_PAYLOAD), (18, 9, Reason.UNKNOWN_SCHEME)]
)
def test_the_reader_refuses_a_latent_blob_breaking_its_rules(offset: int, value: int, reason: Reason) -> None:
    """Scope PER_TENSOR under scheme LATENT; an unknown scheme id (CRC left aside: not what is tested)."""
    blob = bytearray((MLA / "latent_bf16_5tok.blob").read_bytes())
    struct.pack_into("<H", blob, offset, value)
    with pytest.raises(CorruptEncodedKVError) as e:
        parse(bytes(blob), verify_crc=False)
    assert e.value.reason == reason


def test_decode_and_lmcaches_paths_never_read_a_latent_blob_as_k_and_v() -> None:
    pytest.importorskip("torch")
    import kvcodec
    from kvcodec.integrations.lmcache import compat

    blob = (MLA / "latent_bf16_5tok.blob").read_bytes()
    with pytest.raises(CodecError) as e:
        kvcodec.decode(blob)
    assert e.value.reason == Reason.UNSUPPORTED_DTYPE
    with pytest.raises(CorruptEncodedKVError) as e2:
        compat.deserialize_header(blob)
    assert e2.value.reason == Reason.UNKNOWN_SCHEME
    assert "unknown scale_scheme" in str(e2.value)  # LMCache's own phrase
