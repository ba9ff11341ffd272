"""The lossless stage (issue 38): a lossless blob (Huffman streams of V's exponents, schemes 7/8; of whole
V codes, schemes 5/6, and raw deflate, schemes 3/4, still read) decodes to its plain blob's bits by construction, and hostile coded payloads
are refused by reason with bounded memory. The Huffman coder itself (C against its Python oracle, each
refusal): tests/backends/test_cpu_huff.py."""

from __future__ import annotations

import json
import struct
import threading
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec.codec.lossless import DEFLATE_CODER, compress_blob, expand_blob
from kvcodec.errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from kvcodec.format import Header, ScaleScheme, assemble, parse, read_coding
from kvcodec.format.coding import STREAM_COUNT, TOKENS, max_stream_len, pack_table
from tests.paths import VECTORS

LOSSLESS = VECTORS / "lossless"
SCOPES = {
    "per_tensor": {},
    "per_layer_head": {},
    "per_page_head": {"page_size": 4},
    "raw": {},
}
SHAPES = [(1, 1, 1), (5, 3, 7), (33, 2, 16), (64, 4, 128)]


def _kv(shape: tuple[int, int, int], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(*shape, generator=g) * 3).to(dtype)
    v = torch.randn(*shape, generator=g).to(dtype)
    return k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scope", list(SCOPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_decodes_to_the_plain_blobs_bits(dtype, scope, shape) -> None:
    k, v = _kv(shape, dtype)
    plain = kvcodec.encode(k, v, scope=scope, **SCOPES[scope])
    coded = kvcodec.encode(k, v, scope=scope, compression="lossless", **SCOPES[scope])
    assert parse(coded).header.scale_scheme in (ScaleScheme.LOSSLESS_SPLIT, ScaleScheme.LOSSLESS_SPLIT_UNIT)
    assert bytes(expand_blob(parse(coded))) == bytes(plain)
    deflated = compress_blob(plain, coder="deflate")  # schemes 3/4: still read
    assert parse(deflated).header.scale_scheme in (ScaleScheme.LOSSLESS, ScaleScheme.LOSSLESS_UNIT)
    assert bytes(expand_blob(parse(deflated))) == bytes(plain)
    whole = compress_blob(plain, coder="huffman")  # schemes 5/6: still read
    assert parse(whole).header.scale_scheme in (ScaleScheme.LOSSLESS_HUFF, ScaleScheme.LOSSLESS_HUFF_UNIT)
    assert bytes(expand_blob(parse(whole))) == bytes(plain)
    for other in (deflated, whole):
        b = kvcodec.decode(other, out_v_dtype=torch.float32)
        assert torch.equal(b.v, kvcodec.decode(plain, out_v_dtype=torch.float32).v)
    nocrc, hl = bytes(expand_blob(parse(coded), crc=False)), parse(plain).header_len
    assert nocrc[: hl - 4] == bytes(plain)[: hl - 4] and nocrc[hl:] == bytes(plain)[hl:]  # all but the CRC
    for out in (None, torch.float32, dtype):
        a, b = kvcodec.decode(plain, out_v_dtype=out), kvcodec.decode(coded, out_v_dtype=out)
        assert torch.equal(a.k.view(torch.int16), b.k.view(torch.int16))
        assert torch.equal(a.v.contiguous().view(torch.uint8), b.v.contiguous().view(torch.uint8))


def test_v_only_blob_and_encode_layers() -> None:
    k, v = _kv((9, 2, 8), torch.bfloat16)
    plain = kvcodec.encode(None, v, scope="per_tensor")
    coded = kvcodec.encode(None, v, scope="per_tensor", compression="lossless")
    assert parse(coded).header.k_payload_len == 0
    assert bytes(expand_blob(parse(coded))) == bytes(plain)
    layers = kvcodec.encode_layers([k, k], [v, v], compression="lossless", page_size=4)
    assert [bytes(expand_blob(parse(b))) for b in layers] == [
        bytes(b) for b in kvcodec.encode_layers([k, k], [v, v], page_size=4)
    ]


def test_a_real_like_cache_gets_smaller() -> None:
    """Smooth channels (a shared exponent per channel, as real K has) code well below the plain size."""
    t = torch.arange(256, dtype=torch.float32)[:, None, None]
    ch = torch.linspace(0.5, 8, 64)[None, None, :]
    k = (ch * (1 + 0.1 * torch.sin(t / 7 + torch.arange(3)[None, :, None]))).to(torch.bfloat16)
    plain = kvcodec.encode(k, k, scope="per_tensor")
    assert len(kvcodec.encode(k, k, scope="per_tensor", compression="lossless")) < 0.8 * len(plain)


@pytest.mark.parametrize(
    "kw",
    [{"compression": "zstd"}, {"compression": "lossless", "version": 1}],
)
def test_refused_options(kw) -> None:
    k, v = _kv((4, 1, 4), torch.float16)
    with pytest.raises(UnsupportedConfigError) as e:
        kvcodec.encode(k, v, **kw)
    assert e.value.reason == Reason.BAD_VALUE


def test_refused_with_out_and_for_32_bit_k() -> None:
    k, v = _kv((4, 1, 4), torch.float16)
    with pytest.raises(UnsupportedConfigError):
        kvcodec.encode(k, v, scope="per_tensor", compression="lossless", out=bytearray(1 << 12))
    with pytest.raises(UnsupportedConfigError) as e:
        kvcodec.encode(k.float(), v, scope="per_tensor", compression="lossless")
    assert e.value.reason == Reason.BAD_VALUE


def _coded(shape=(8, 2, 4), seed=1, coder="deflate") -> tuple[bytearray, Header]:
    """A lossless blob (raw deflate by default: the hostile-stream tests below are deflate's; the Huffman
    streams' are in tests/backends/test_cpu_huff.py and at the end of this file)."""
    k, v = _kv(shape, torch.float16, seed)
    b = compress_blob(kvcodec.encode(k, v, scope="per_tensor"), coder=coder)
    return b, parse(b).header


def _rebuild(h: Header, k: bytes, v: bytes, scales: bytes) -> bytearray:
    """A blob with these sections and a valid CRC: what a hostile writer sends."""
    return assemble(h, k, v, scales)


def _sections(b: bytearray) -> tuple[Header, bytes, bytes, bytes]:
    p = parse(b)
    return p.header, bytes(p.k), bytes(p.v), bytes(p.scales)


def _v_with_streams(tokens: int, streams: list[bytes]) -> bytes:
    return pack_table([len(s) for s in streams], tokens) + b"".join(streams)


def test_a_decompression_bomb_is_refused_without_expanding() -> None:
    b, h = _coded((256, 2, 64))
    h, k, _, s = _sections(b)
    bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
    stream = bomb.compress(bytes(8 << 20)) + bomb.flush()  # 8 MiB of zeros in ~8 KiB
    assert len(stream) <= max_stream_len(256 * 64)  # passes the table's bound: refused when decoded
    hostile = _rebuild(h, k, _v_with_streams(256, [stream, stream]), s)
    p = parse(hostile)  # the table is within bounds; the decode refuses it
    with pytest.raises(CorruptEncodedKVError) as e:
        kvcodec.decode(p)
    assert e.value.reason == Reason.BAD_STREAM
    assert f"more than {256 * 64}" in str(e.value)


@pytest.mark.parametrize("cut", [1, 3])
def test_a_truncated_stream_is_refused(cut) -> None:
    b, _ = _coded()
    h, k, v, s = _sections(b)
    c = read_coding(h, memoryview(k), memoryview(v))
    at, n = c.v.streams[0]
    streams = [v[at : at + n - cut], *(v[a : a + m] for a, m in c.v.streams[1:])]
    with pytest.raises(CorruptEncodedKVError) as e:
        kvcodec.decode(_rebuild(h, k, _v_with_streams(8, streams), s))
    assert e.value.reason == Reason.BAD_STREAM


def test_garbage_and_trailing_bytes_in_a_stream_are_refused() -> None:
    b, _ = _coded()
    h, k, v, s = _sections(b)
    c = read_coding(h, memoryview(k), memoryview(v))
    good = [v[a : a + m] for a, m in c.v.streams]
    for bad in (b"\xff" * 12, good[0] + b"\x00\x01"):
        with pytest.raises(CorruptEncodedKVError) as e:
            kvcodec.decode(_rebuild(h, k, _v_with_streams(8, [bad, good[1]]), s))
        assert e.value.reason == Reason.BAD_STREAM


@pytest.mark.parametrize(
    "lie",
    [
        "tokens_zero",
        "tokens_huge",
        "more_tokens",
        "count",
        "length_past_end",
        "length_over_bound",
        "extra_bytes",
    ],
)
@pytest.mark.parametrize("coder", ["deflate", "huffman", "split"])
def test_lying_tables_are_refused_at_parse(lie, coder) -> None:
    b, _ = _coded(coder=coder)
    h, k, v, s = _sections(b)
    c = read_coding(h, memoryview(k), memoryview(v))
    assert c.v_split == (coder == "split")
    streams = [v[a : a + m] for a, m in c.v.streams]
    lengths = [len(x) for x in streams]
    tokens, body = 8, b"".join(streams) + v[c.v.raw_at :]  # the split's sign and mantissa plane too
    if lie == "tokens_zero":
        tokens = 0
    elif lie == "tokens_huge":
        tokens = 1 << 62
    elif lie == "more_tokens":
        tokens = 9  # K's low plane then disagrees
    elif lie == "count":
        lengths = lengths[:1]
        body = streams[0] + v[c.v.raw_at :]
    elif lie == "length_past_end":
        lengths[1] += 5
    elif lie == "length_over_bound":
        lengths = [max_stream_len(32, huffman=coder != "deflate") + 1, 1]
        body = bytes(sum(lengths))
    elif lie == "extra_bytes":
        body += b"\x00"
    hostile = _rebuild(h, k, pack_table(lengths, tokens) + body, s)
    with pytest.raises(CorruptEncodedKVError) as e:
        parse(hostile)
    assert e.value.reason == Reason.INCONSISTENT_PAYLOAD


def test_damage_is_a_crc_mismatch_first() -> None:
    b, h = _coded()
    for at in range(h.header_len, len(b)):
        bad = bytearray(b)
        bad[at] ^= 0x10
        with pytest.raises(CorruptEncodedKVError) as e:
            kvcodec.decode(bad)
        assert e.value.reason == Reason.CRC_MISMATCH


def test_older_schemes_do_not_claim_the_new_ids() -> None:
    b, _ = _coded()
    bad = bytearray(b)
    bad[18:20] = struct.pack("<H", max(ScaleScheme) + 1)  # the next unused id
    with pytest.raises(CorruptEncodedKVError) as e:
        parse(bad, verify_crc=False)
    assert e.value.reason == Reason.UNKNOWN_SCHEME
    assert TOKENS.size + STREAM_COUNT.size == 12


def test_compress_refuses_what_it_cannot_code() -> None:
    k, v = _kv((4, 1, 4), torch.float16)
    with pytest.raises(UnsupportedConfigError):
        compress_blob(kvcodec.encode(k, v, scope="per_tensor", version=1))
    coded = kvcodec.encode(k, v, scope="per_tensor", compression="lossless")
    with pytest.raises(UnsupportedConfigError):
        compress_blob(coded)  # already coded
    with pytest.raises(UnsupportedConfigError):
        compress_blob(kvcodec.encode(k, v, scope="per_tensor"), coder="zstd")


# ----------------------------------------------------------------------------
# Golden vectors: the decoder reads them forever; the coder re-creates them while it is the same
# ----------------------------------------------------------------------------


def _golden_kv(
    shape: tuple[int, int, int], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic finite K and V from integer arithmetic (no RNG whose stream may change)."""
    n = shape[0] * shape[1] * shape[2]
    i = torch.arange(n, dtype=torch.int64)
    k = ((i * 2654435761 + seed * 40503) % 2001 - 1000).to(torch.float32) / 97
    v = ((i * 40503 + seed * 2654435761) % 1999 - 999).to(torch.float32) / 313
    return k.reshape(shape).to(dtype), v.reshape(shape).to(dtype)


GOLDEN = {
    # raw deflate (schemes 3/4, written before the Huffman coder): read forever
    "lossless_bf16_pph.blob": (
        (37, 3, 16),
        torch.bfloat16,
        {"scope": "per_page_head", "page_size": 16},
        "deflate",
    ),
    "lossless_fp16_plh.blob": ((16, 2, 8), torch.float16, {"scope": "per_layer_head"}, "deflate"),
    "lossless_bf16_raw.blob": ((5, 1, 4), torch.bfloat16, {"scope": "raw"}, "deflate"),
    # Huffman streams of whole V codes (schemes 5/6, written before the split): read forever
    "lossless_huff_bf16_pph.blob": (
        (37, 3, 16),
        torch.bfloat16,
        {"scope": "per_page_head", "page_size": 16},
        "huffman",
    ),
    "lossless_huff_fp16_plh.blob": ((16, 2, 8), torch.float16, {"scope": "per_layer_head"}, "huffman"),
    "lossless_huff_bf16_raw.blob": ((5, 1, 4), torch.bfloat16, {"scope": "raw"}, "huffman"),
    "lossless_huff_bf16_long.blob": (
        (300, 2, 64),
        torch.bfloat16,
        {"scope": "per_page_head", "page_size": 16},
        "huffman",
    ),
    # Huffman streams of V's exponents, its signs and mantissas raw (schemes 7/8): what
    # compression="lossless" writes; head_dim 16, 8, 4, 3 and 64 take every path of nibbles.c
    "lossless_split_bf16_pph.blob": (
        (37, 3, 16),
        torch.bfloat16,
        {"scope": "per_page_head", "page_size": 16},
        "split",
    ),
    "lossless_split_fp16_plh.blob": ((16, 2, 8), torch.float16, {"scope": "per_layer_head"}, "split"),
    "lossless_split_bf16_raw.blob": ((5, 1, 4), torch.bfloat16, {"scope": "raw"}, "split"),
    "lossless_split_bf16_odd.blob": ((5, 1, 3), torch.bfloat16, {"scope": "per_tensor"}, "split"),
    "lossless_split_bf16_long.blob": (
        (300, 2, 64),
        torch.bfloat16,
        {"scope": "per_page_head", "page_size": 16},
        "split",
    ),
}
# the split blobs of several heads again since a section's streams share code lengths where that costs
# little (one table for a decoder to build): the long one's K two symbols a lookup
GOLDEN.update(
    {
        name.replace("_split_", "_shared_"): GOLDEN[name]
        for name in (
            "lossless_split_bf16_pph.blob",
            "lossless_split_fp16_plh.blob",
            "lossless_split_bf16_long.blob",
        )
    }
)
OWN_LENGTHS = {
    "lossless_huff_bf16_pph.blob",
    "lossless_huff_bf16_long.blob",
    "lossless_split_bf16_pph.blob",
    "lossless_split_fp16_plh.blob",
    "lossless_split_bf16_long.blob",
}
"""Vectors of several streams a section written before they shared lengths (each its own): read forever,
no longer what the encoder writes."""
SCHEMES_OF_CODER = {
    "deflate": (ScaleScheme.LOSSLESS, ScaleScheme.LOSSLESS_UNIT),
    "huffman": (ScaleScheme.LOSSLESS_HUFF, ScaleScheme.LOSSLESS_HUFF_UNIT),
    "split": (ScaleScheme.LOSSLESS_SPLIT, ScaleScheme.LOSSLESS_SPLIT_UNIT),
}


def _golden_plain(name: str) -> bytearray:
    shape, dtype, kw, _ = GOLDEN[name]
    base = name.replace("_huff", "").replace("_split", "").replace("_shared", "")
    k, v = _golden_kv(shape, dtype, len(base))
    return kvcodec.encode(k, v, layer_id=2, chunk_id=7, hashes={"model_id": "golden-lossless"}, **kw)


def _write() -> None:  # pragma: no cover - run once by hand when the format changes
    LOSSLESS.mkdir(exist_ok=True)
    for name, (*_, coder) in GOLDEN.items():
        if name not in OWN_LENGTHS:
            (LOSSLESS / name).write_bytes(bytes(compress_blob(_golden_plain(name), coder=coder)))
    (LOSSLESS / "manifest.json").write_text(json.dumps(sorted(GOLDEN), indent=1) + "\n")


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_vectors(name) -> None:
    stored = (LOSSLESS / name).read_bytes()
    plain = _golden_plain(name)
    coder = GOLDEN[name][3]
    assert parse(stored).header.scale_scheme in SCHEMES_OF_CODER[coder]
    assert bytes(expand_blob(parse(stored))) == bytes(plain)
    if name in OWN_LENGTHS:  # today's encoder gives the section one table: other bytes, the same plain blob
        assert bytes(expand_blob(parse(compress_blob(plain, coder=coder)))) == bytes(plain)
    elif coder != "deflate" or DEFLATE_CODER == "isal":  # zlib's deflate codes the same bytes differently
        assert bytes(compress_blob(plain, coder=coder)) == stored


def test_manifest_lists_the_vectors() -> None:
    assert json.loads((LOSSLESS / "manifest.json").read_text()) == sorted(GOLDEN)


@pytest.mark.parametrize("shape", [(19, 3, 8), (7, 1, 5)])
@pytest.mark.parametrize("without", ["k_planes", "v_nibbles", "huff", "both"])
def test_numpy_planes_and_the_python_coder_give_the_same_bytes(monkeypatch, without, shape) -> None:
    """Without the C loops the planes are split and merged by numpy and the streams coded by
    kvcodec.codec.huffman: the same blobs both ways."""
    k, v = _kv(shape, torch.bfloat16)
    coded = kvcodec.encode(k, v, scope="per_tensor", compression="lossless")
    plain = kvcodec.encode(k, v, scope="per_tensor")
    if without in ("k_planes", "both"):
        monkeypatch.setattr(kvcodec.backends, "k_planes", lambda *a, **kw: False)
    if without in ("v_nibbles", "both"):
        monkeypatch.setattr(kvcodec.backends, "v_nibbles", lambda *a, **kw: False)
        monkeypatch.setattr(kvcodec.backends, "v_nibbles_pairs", lambda *a, **kw: False)
    if without in ("huff", "both"):
        monkeypatch.setattr(kvcodec.backends, "huff_encode_many", lambda *a, **kw: None)
        monkeypatch.setattr(kvcodec.backends, "huff_decode_many", lambda *a, **kw: None)
    assert bytes(kvcodec.encode(k, v, scope="per_tensor", compression="lossless")) == bytes(coded)
    assert bytes(expand_blob(parse(coded))) == bytes(plain)


def test_a_bomb_is_decoded_in_bounded_memory() -> None:
    """The bomb of 8 MiB is refused after at most one stream's bytes (+1) were produced."""
    import tracemalloc

    b, _ = _coded((256, 2, 64))
    h, k, _, s = _sections(b)
    bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
    stream = bomb.compress(bytes(8 << 20)) + bomb.flush()
    hostile = _rebuild(h, k, _v_with_streams(256, [stream, stream]), s)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptEncodedKVError):
            kvcodec.decode(hostile)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # the blob's plain size is ~130 KiB; the bomb would be 8 MiB


def test_kvcodec_verify_checks_the_codes_a_lossless_blob_holds() -> None:
    """``kvcodec verify`` reads a lossless blob's codes through its plain blob (not the coded bytes)."""
    from kvcodec.tools.cmd_verify import verify_blob

    k, v = _kv((33, 2, 16), torch.float16)
    verify_blob(kvcodec.encode(k, v, scope="per_tensor", compression="lossless"))
    plain = kvcodec.parse(kvcodec.encode(k, v, scope="per_tensor"))
    codes = bytearray(plain.v)
    codes[5] = 0x7F  # an e4m3fn NaN code, sealed into a lossless blob with a valid CRC
    bad = compress_blob(assemble(plain.header, plain.k, codes, plain.scales))
    with pytest.raises(CorruptEncodedKVError) as e:
        verify_blob(bad)
    assert e.value.reason == Reason.BAD_CODE


def test_the_header_memo_does_not_skip_a_blobs_tables() -> None:
    """A second blob with the same header bytes (so the parse memo knows it) still has its tables checked."""
    b, _ = _coded()
    parse(b)  # remembered
    h, k, v, s = _sections(b)
    c = read_coding(h, memoryview(k), memoryview(v))
    lengths = [n for _, n in c.v.streams]
    lying = pack_table([lengths[0] + 1, lengths[1] - 1], 8) + v[c.v.streams[0][0] :]  # same section length
    hostile = _rebuild(h, k, lying, s)
    assert bytes(hostile[: h.header_len - 4]) == bytes(b[: h.header_len - 4])
    try:
        kvcodec.decode(hostile)
    except CorruptEncodedKVError as e:
        assert e.reason in (Reason.BAD_STREAM, Reason.INCONSISTENT_PAYLOAD)
    else:
        raise AssertionError("a blob whose streams were cut elsewhere decoded")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    streams=st.lists(
        st.binary(min_size=1, max_size=120) | st.binary(min_size=140, max_size=200), min_size=2, max_size=2
    ),
    flip=st.integers(0, 1),
)
@pytest.mark.parametrize("coder", ["deflate", "huffman", "split"])
def test_random_streams_decode_or_are_refused_by_reason(streams, flip, coder) -> None:
    """Any bytes in the streams (tables and CRC valid): decoded to exactly the geometry, or BAD_STREAM
    (INCONSISTENT_PAYLOAD: a split V stream's table with codes for symbols over 15)."""
    b, _ = _coded(coder=coder)
    h, k, v, s = _sections(b)
    c = read_coding(h, memoryview(k), memoryview(v))
    if flip:  # keep one real stream, so the other is the only hostile one
        streams[0] = v[c.v.streams[0][0] : c.v.streams[0][0] + c.v.streams[0][1]]
    hostile = _rebuild(h, k, _v_with_streams(8, streams) + v[c.v.raw_at :], s)
    try:
        got = kvcodec.decode(hostile)
    except CorruptEncodedKVError as e:
        assert e.reason in (Reason.BAD_STREAM, Reason.BAD_CODE, Reason.INCONSISTENT_PAYLOAD)
    else:
        assert got.v.shape == (8, 2, 4)


@pytest.mark.parametrize("cap", [None, 0])
def test_decoding_into_outputs_reuses_the_threads_payload_buffer(monkeypatch, cap) -> None:
    """A decode into ``out_k`` and ``out_v`` expands the streams into this thread's reused plain payload
    (or a buffer of its own past SCRATCH_MAX_BYTES): blobs of other sizes one after another, each the
    plain blob's bits, and damage still refused as a CRC mismatch before a stream is decoded."""
    from kvcodec.codec import lossless

    if cap is not None:
        monkeypatch.setattr(lossless, "SCRATCH_MAX_BYTES", cap)
    for shape, dtype in [
        ((64, 4, 32), torch.bfloat16),
        ((5, 3, 7), torch.float16),
        ((64, 4, 32), torch.float16),
    ]:
        k, v = _kv(shape, dtype, seed=shape[0])
        opts = {"scope": "per_page_head", "page_size": 4}
        plain, coded = kvcodec.encode(k, v, **opts), kvcodec.encode(k, v, compression="lossless", **opts)
        want = kvcodec.decode(plain, out_v_dtype=torch.float32)
        out_k, out_v = torch.empty_like(k), torch.empty(shape, dtype=torch.float32)
        got = kvcodec.decode(coded, out_k=out_k, out_v=out_v)
        assert got.k is out_k and got.v is out_v
        assert torch.equal(out_k.view(torch.int16), want.k.view(torch.int16)) and torch.equal(out_v, want.v)
        raw_v = torch.empty(shape, dtype=torch.float8_e4m3fn)  # raw codes: not the host lane
        kvcodec.decode(coded, out_k=out_k, out_v=raw_v)
        assert torch.equal(raw_v.view(torch.uint8), kvcodec.decode(plain).v.view(torch.uint8))
        bad = bytearray(coded)
        bad[-1] ^= 1
        with pytest.raises(CorruptEncodedKVError) as e:
            kvcodec.decode(bad, out_k=out_k, out_v=out_v)
        assert e.value.reason == Reason.CRC_MISMATCH


@pytest.mark.parametrize("cap", [None, 0])
def test_lossless_encodes_reuse_the_threads_buffers(monkeypatch, cap) -> None:
    """A lossless encode writes its plain blob and K's planes into this thread's reused buffers (or
    buffers of their own past SCRATCH_MAX_BYTES), between decodes that use them too: blobs of other
    sizes one after another, each what compress_blob makes of the plain blob."""
    from kvcodec.codec import lossless

    monkeypatch.setattr(lossless, "_scratch", threading.local())  # none kept from an earlier test
    if cap is not None:
        monkeypatch.setattr(lossless, "SCRATCH_MAX_BYTES", cap)
    opts = {"scope": "per_page_head", "page_size": 4}
    shapes = [((64, 4, 32), torch.bfloat16), ((5, 3, 7), torch.float16), ((64, 4, 32), torch.float16)]
    for shape, dtype in shapes * 2:
        k, v = _kv(shape, dtype, seed=shape[0] + shape[2])
        plain = kvcodec.encode(k, v, **opts)
        coded = kvcodec.encode(k, v, compression="lossless", **opts)
        assert coded == compress_blob(bytes(plain))
        out_k, out_v = torch.empty_like(k), torch.empty(shape, dtype=torch.float32)
        kvcodec.decode(coded, out_k=out_k, out_v=out_v)
        assert torch.equal(out_k.view(torch.int16), k.view(torch.int16))
    planes = getattr(lossless._scratch, "plane", None)
    assert (planes is not None and planes.size >= 2 * 64 * 4 * 32) == (cap is None)


def test_threads_encode_into_their_own_buffers() -> None:
    """Two threads' lossless encodes at once each write into their own reused buffers."""
    from concurrent.futures import ThreadPoolExecutor

    opts = {"scope": "per_page_head", "page_size": 4}
    jobs = []
    for seed, shape in [(1, (64, 4, 32)), (2, (32, 2, 64))]:
        k, v = _kv(shape, torch.bfloat16, seed=seed)
        jobs.append((k, v, bytes(compress_blob(kvcodec.encode(k, v, **opts)))))

    def run(job) -> bool:
        k, v, want = job
        return all(kvcodec.encode(k, v, compression="lossless", **opts) == want for _ in range(20))

    with ThreadPoolExecutor(2) as pool:
        assert all(pool.map(run, jobs * 2))


def test_threads_decode_into_their_own_payload_buffers() -> None:
    """Two threads decoding different lossless blobs at once each expand into their own reused buffer."""
    from concurrent.futures import ThreadPoolExecutor

    opts = {"scope": "per_page_head", "page_size": 4}
    jobs = []
    for seed, shape in [(1, (64, 4, 32)), (2, (32, 2, 64))]:
        k, v = _kv(shape, torch.bfloat16, seed=seed)
        coded = kvcodec.encode(k, v, compression="lossless", **opts)
        want = kvcodec.decode(kvcodec.encode(k, v, **opts), out_v_dtype=torch.float32)
        jobs.append((coded, want, shape))

    def run(job) -> bool:
        coded, want, shape = job
        out_k, out_v = torch.empty_like(want.k), torch.empty(shape, dtype=torch.float32)
        for _ in range(20):
            kvcodec.decode(coded, out_k=out_k, out_v=out_v)
            if not (
                torch.equal(out_k.view(torch.int16), want.k.view(torch.int16)) and torch.equal(out_v, want.v)
            ):
                return False
        return True

    with ThreadPoolExecutor(2) as pool:
        assert all(pool.map(run, jobs * 2))


def test_decode_merges_k_straight_into_out_k(monkeypatch) -> None:
    """A decode into a contiguous CPU ``out_k`` merges K's planes there (the payload's K never written,
    nor copied out); a strided ``out_k`` takes K through the payload; NaN codes (the host lane stops,
    the general path rewrites both outputs from the payload) give the plain blob's result all the same."""
    from kvcodec.codec import lossless

    seen = []
    fill = lossless.Expansion.fill
    monkeypatch.setattr(lossless.Expansion, "fill", lambda self, **kw: seen.append(kw) or fill(self, **kw))
    opts = {"scope": "per_page_head", "page_size": 4}
    k, v = _kv((32, 3, 16), torch.bfloat16, seed=3)
    plain = kvcodec.parse(kvcodec.encode(k, v, **opts))
    codes = bytearray(plain.v)
    codes[40] = 0x7F  # an e4m3fn NaN code in token 0, head 2
    nan_plain = assemble(plain.header, plain.k, codes, plain.scales)
    for blob in (bytes(assemble(plain.header, plain.k, plain.v, plain.scales)), nan_plain):
        coded = compress_blob(blob)
        want = kvcodec.decode(blob, out_v_dtype=torch.float32)
        for out_k in (torch.empty_like(k), torch.empty(3, 32, 16, dtype=k.dtype).transpose(0, 1)):
            seen.clear()
            out_k.fill_(0)
            lossless._scratch_view(1 << 16)[:] = b"\xaa" * (1 << 16)  # no K left there by a decode before
            out_v = torch.empty(k.shape, dtype=torch.float32)
            kvcodec.decode(coded, out_k=out_k, out_v=out_v)
            assert (seen[0]["k_into"] is not None) == out_k.is_contiguous()
            assert torch.equal(out_k.view(torch.int16), want.k.view(torch.int16))
            assert torch.equal(out_v.isnan(), want.v.isnan()) and torch.equal(
                out_v.nan_to_num(), want.v.nan_to_num()
            )
    assert want.v.isnan().any()


@pytest.mark.skipif(not kvcodec.backends.cache_lanes_available(), reason="the C loops are not built")
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_dequantizes_v_in_the_call_that_expands_it(monkeypatch, out_dtype) -> None:
    """A decode into ``out_k`` and a dequantized ``out_v`` has V's codes dequantized by the C call that
    expands them (the cpu backend's ``expand_dequant`` lane: no ``decode_host`` call); NaN codes decline
    it there (counted as that lane's fallback) and the general path gives the plain blob's result."""
    from kvcodec.backends import cpu

    host_calls = []
    decode_host = cpu.CpuBackend.decode_host
    monkeypatch.setattr(
        cpu.CpuBackend, "decode_host", lambda *a, **kw: host_calls.append(1) or decode_host(*a, **kw)
    )
    k, v = _kv((32, 3, 16), torch.bfloat16, seed=5)
    plain = kvcodec.parse(kvcodec.encode(k, v, scope="per_layer_head"))
    codes = bytearray(plain.v)
    codes[7] = 0xFF  # an e4m3fn NaN code
    for nan in (False, True):
        blob = bytes(assemble(plain.header, plain.k, codes if nan else plain.v, plain.scales))
        want = kvcodec.decode(blob, out_v_dtype=out_dtype)
        before = _declines("expand_dequant")
        out_k, out_v = torch.empty_like(k), torch.empty(k.shape, dtype=out_dtype)
        kvcodec.decode(compress_blob(blob), out_k=out_k, out_v=out_v)
        assert torch.equal(out_k.view(torch.int16), want.k.view(torch.int16))
        assert torch.equal(out_v.isnan(), want.v.isnan()) and torch.equal(
            out_v.nan_to_num(), want.v.nan_to_num()
        )
        assert _declines("expand_dequant") - before == int(nan)
    assert host_calls == []


def _declines(op: str) -> int:
    info = kvcodec.backends.backend_info("cpu")
    return sum(f["count"] for f in info["fallbacks"] if f["op"] == op)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_encode_splits_a_cpu_k_from_its_own_bytes(monkeypatch, dtype) -> None:
    """An encode of a contiguous CPU K splits K's planes from K itself (K never copied into the plain
    blob); any other K (strided here) through the plain blob: the same blob either way."""
    import importlib

    enc = importlib.import_module("kvcodec.codec.encode")
    calls = []
    split = enc.split_host
    monkeypatch.setattr(enc, "split_host", lambda k, dt: calls.append(split(k, dt)) or calls[-1])
    k, v = _kv((48, 4, 16), dtype, seed=4)
    opts = {"scope": "per_page_head", "page_size": 16}
    want = bytes(compress_blob(kvcodec.encode(k, v, **opts)))
    assert bytes(kvcodec.encode(k, v, compression="lossless", **opts)) == want
    strided = k.transpose(0, 1).contiguous().transpose(0, 1)
    assert bytes(kvcodec.encode(strided, v, compression="lossless", **opts)) == want
    assert [c is not None for c in calls] == [True, False]
