"""py_lossless.c's lossless_expand: a split lossless payload (schemes 7/8) expanded in one C call writes
what the stages write one call each (CRC, V's streams and merge, K's streams and merge), checks the coded
CRC before any stream is decoded, names a refused stream as the stages name it, and refuses arguments
that would read or write outside its buffers."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec import backends
from kvcodec.backends import cpu
from kvcodec.codec.lossless import expand_blob
from kvcodec.errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from kvcodec.format import parse, restamp_header

pytestmark = pytest.mark.skipif(not cpu.AVAILABLE, reason=cpu.REASON)

SHAPES = [(1, 1, 1), (5, 3, 7), (33, 2, 16), (64, 4, 128), (16, 8, 64)]


def _coded(
    shape: tuple[int, int, int], dtype=torch.bfloat16, *, with_k: bool = True, seed: int = 0
) -> bytearray:
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(*shape, generator=g) * 3).to(dtype)
    v = torch.randn(*shape, generator=g).to(dtype)
    return kvcodec.encode(
        k if with_k else None, v, scope="per_page_head", page_size=4, compression="lossless"
    )


def _stages(monkeypatch) -> None:
    """The stage by stage path, as where the C loops have no one-call expansion."""
    monkeypatch.setattr(backends, "lossless_expand", lambda *a, **kw: False)


def _call(p, *, check: bool = False, **over):
    """lossless_expand's arguments for parsed blob p (fresh outputs), with any of them replaced."""
    c = p.coding
    n = c.tokens * c.heads * c.head_dim
    args = {
        "payload": p.payload,
        "k_len": len(p.k),
        "v_len": len(p.v),
        "k_spans": () if c.k is None else c.k.streams,
        "k_raw_at": 0 if c.k is None else c.k.raw_at,
        "v_spans": c.v.streams,
        "v_raw_at": c.v.raw_at,
        "T": c.tokens,
        "H": c.heads,
        "D": c.head_dim,
        "k_out": None if c.k is None else np.full(2 * n, 0xA5, np.uint8),
        "v_out": np.full(n, 0xA5, np.uint8),
        "plane": np.full(n, 0xA5, np.uint8),
        "crc": (p.crc_prefix, p.crc) if check else None,
    }
    args.update(over)
    return args, kvcodec._cpu.lossless_expand(*args.values())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_k", [True, False], ids=["kv", "v-only"])
def test_one_call_writes_what_the_stages_write(monkeypatch, shape, dtype, with_k) -> None:
    coded = _coded(shape, dtype, with_k=with_k)
    one = bytes(expand_blob(parse(coded)))
    out = [torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)]
    got = kvcodec.decode(coded, out_k=out[0] if with_k else None, out_v=out[1])
    _stages(monkeypatch)
    assert one == bytes(expand_blob(parse(coded)))
    want = kvcodec.decode(coded, out_v_dtype=dtype)
    assert torch.equal(got.v.view(torch.int16), want.v.view(torch.int16))
    if with_k:
        assert torch.equal(got.k.view(torch.int16), want.k.view(torch.int16))


def test_the_call_reports_success_and_writes_the_codes() -> None:
    p = parse(_coded((9, 3, 8)))
    args, got = _call(p, check=True)
    assert got is None
    plain = parse(expand_blob(p))
    assert args["v_out"].tobytes() == bytes(plain.v) and args["k_out"].tobytes() == bytes(plain.k)


def test_damage_is_a_crc_mismatch_before_any_stream_is_decoded() -> None:
    coded = _coded((24, 2, 16))
    p = parse(coded)
    coded[p.header_len + len(p.k) + len(p.v) // 2] ^= 0x40  # a byte of V's streams
    p = parse(coded, verify_crc=False)
    args, got = _call(p, check=True)
    want = zlib.crc32(bytes(p.payload), zlib.crc32(bytes(p.crc_prefix)))
    assert got == ("crc", want) and want != p.crc
    assert all((args[name] == 0xA5).all() for name in ("k_out", "v_out", "plane"))  # nothing decoded
    out = [torch.empty(24, 2, 16, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(CorruptEncodedKVError) as e:
        kvcodec.decode(coded, out_k=out[0], out_v=out[1])
    assert e.value.reason == Reason.CRC_MISMATCH


@pytest.mark.parametrize("section", ["K", "V"])
@pytest.mark.parametrize("stream", [0, 1])
def test_a_refused_stream_is_named_as_the_stages_name_it(monkeypatch, section, stream) -> None:
    """A stream whose table gives 15-bit lengths, the blob's CRC made right: BAD_STREAM, the same message
    from one call and from the stages."""
    coded = _coded((20, 3, 8))
    p = parse(coded)
    sec, base = (p.coding.k, p.header_len) if section == "K" else (p.coding.v, p.header_len + len(p.k))
    coded[base + sec.streams[stream][0]] = 0xFF
    h = p.header
    restamp_header(memoryview(coded), h, p.header_len, scale_scheme=h.scale_scheme,
                   k_payload_len=h.k_payload_len, v_payload_len=h.v_payload_len)  # fmt: skip
    _, got = _call(parse(coded), check=True)
    assert got == (section, stream, 2)  # HUFF_BAD_LENGTH
    out = [torch.empty(20, 3, 8, dtype=torch.bfloat16) for _ in range(2)]
    messages = []
    for staged in (False, True):
        if staged:
            _stages(monkeypatch)
        for decode in (
            lambda: kvcodec.decode(coded, out_k=out[0], out_v=out[1]),
            lambda: kvcodec.decode(coded),
        ):
            with pytest.raises(CorruptEncodedKVError) as e:
                decode()
            assert e.value.reason == Reason.BAD_STREAM
            messages.append(str(e.value))
    assert len(set(messages)) == 1 and f"{section} stream {stream} " in messages[0]


_PAGE = 4
"""The page size of :func:`_coded`'s blobs (per_page_head)."""


def _deq(p, dtype: torch.dtype, out: torch.Tensor | None = None, scales: torch.Tensor | None = None) -> tuple:
    """lossless_expand's ``deq`` for parsed blob p: its scales (or ``scales``) and a fresh ``out`` of ``dtype``."""
    c = p.coding
    shape = (c.tokens, c.heads, c.head_dim)
    if scales is None:
        scales = kvcodec.decode(bytes(p.buffer)).scales.float()
    out = torch.empty(shape, dtype=dtype) if out is None else out
    return scales.numpy(), 2, _PAGE, cpu._buf(out), cpu._DTYPE[dtype]


def _codes_view(p) -> np.ndarray:
    c = p.coding
    return np.full((c.tokens, c.heads, c.head_dim), 0xA5, np.uint8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 1), (13, 3, 8), (64, 4, 128)])
def test_the_call_dequantizes_the_codes_it_writes(dtype, shape) -> None:
    """With ``deq`` the codes the call writes come back dequantized in it, as dequantize gives them."""
    coded = _coded(shape)
    p = parse(coded)
    out = torch.empty(shape, dtype=dtype)
    args, got = _call(p, check=True, v_out=_codes_view(p), deq=_deq(p, dtype, out))
    assert got is None
    want = kvcodec.decode(coded, out_v_dtype=dtype)
    assert torch.equal(out.view(torch.uint8), want.v.view(torch.uint8))
    assert args["v_out"].tobytes() == bytes(parse(expand_blob(p)).v)


def test_a_dequantization_the_loops_do_not_take_is_declined_after_the_expansion() -> None:
    """An output or scales sharing memory with what the call reads or writes, a layout the loops do not
    take, or NaN codes: a reason, with K and the codes written all the same (the caller dequantizes)."""
    shape = (12, 2, 8)
    coded = _coded(shape)
    p = parse(coded)
    plain = parse(expand_blob(p))
    n = math.prod(shape)
    room = np.empty(8 * n, np.uint8)
    scales = kvcodec.decode(coded).scales.float()
    cases = {
        "out over the plane": {
            "plane": room[:n],
            "deq": _deq(p, torch.float16, out=_f16(room[: 2 * n], shape)),
        },
        "scales in v_out": {
            "v_out": room[:n].reshape(shape),
            "deq": (room[: scales.numel() * 4].view(np.float32), *_deq(p, torch.float16)[1:]),
        },
        "out's head_dim strided": {"deq": _deq(p, torch.float32, out=torch.empty(12, 2, 16)[..., ::2])},
    }
    for name, over in cases.items():
        over.setdefault("v_out", _codes_view(p))
        args, got = _call(p, check=True, **over)
        assert isinstance(got, str), name
        assert args["k_out"].tobytes() == bytes(plain.k) and args["v_out"].tobytes() == bytes(plain.v), name


def _f16(buf: np.ndarray, shape: tuple[int, int, int]) -> torch.Tensor:
    return torch.from_numpy(buf.view(np.float16).reshape(shape))


def test_nan_codes_decline_the_dequantization_not_the_expansion() -> None:
    from kvcodec.codec.lossless import compress_blob
    from kvcodec.format import assemble

    plain = parse(kvcodec.encode(*(torch.randn(8, 2, 16).to(torch.bfloat16) for _ in range(2)),
                                 scope="per_page_head", page_size=_PAGE))  # fmt: skip
    codes = bytearray(plain.v)
    codes[17] = 0xFF  # an e4m3fn NaN code
    p = parse(compress_blob(assemble(plain.header, plain.k, codes, plain.scales)))
    args, got = _call(p, v_out=_codes_view(p), deq=_deq(p, torch.bfloat16))
    assert got == "q holds NaN codes"
    assert args["v_out"].tobytes() == bytes(codes) and args["k_out"].tobytes() == bytes(plain.k)


def _refusals(p) -> dict[str, dict]:
    c = p.coding
    n = c.tokens * c.heads * c.head_dim
    k0, k1 = c.k.streams[0], c.k.streams[1]
    return {
        "a K span past its section": {"k_spans": ((k0[0], len(p.k)), k1)},
        "a V span past its section": {"v_spans": ((0, len(p.v) + 1), *c.v.streams[1:])},
        "a negative offset": {"v_spans": ((-1, 4), *c.v.streams[1:])},
        "one span too few": {"v_spans": c.v.streams[1:]},
        "not (offset, length)": {"k_spans": ([0, 4], k1)},
        "sections past the payload": {"v_len": len(p.payload)},
        "K's low plane past its section": {"k_raw_at": len(p.k) - n + 1},
        "V's nibbles past its section": {"v_raw_at": len(p.v)},
        "k_out one byte short": {"k_out": np.empty(2 * n - 1, np.uint8)},
        "plane one byte long": {"plane": np.empty(n + 1, np.uint8)},
        "v_out read-only": {"v_out": np.frombuffer(bytes(n), np.uint8)},
        "K streams without k_out": {"k_out": None},
        "a CRC of more than 32 bits": {"crc": (b"", 1 << 32)},
        "a crc that is not (prefix, crc)": {"crc": (b"",)},
        "a head count of zero": {"H": 0},
        "a deq that is not (scales, scope, page, out, dtype)": {"deq": (np.ones(1, np.float32), 0)},
        "a deq with an unknown dtype code": {"deq": (*_deq(p, torch.float32)[:4], 7)},
        "a deq with an unknown scope code": {
            "deq": (np.ones(1, np.float32), 5, 1, *_deq(p, torch.float32)[3:])
        },
    }


@pytest.mark.parametrize("name", list(_refusals(parse(_coded((12, 2, 8))))))
def test_arguments_outside_their_buffers_are_refused(name) -> None:
    p = parse(_coded((12, 2, 8)))
    with pytest.raises(UnsupportedConfigError) as e:
        _call(p, **_refusals(p)[name])
    assert e.value.reason == Reason.BAD_BUFFER


def test_outputs_that_share_memory_are_refused() -> None:
    coded = _coded((12, 2, 8))
    p = parse(coded)
    n = 12 * 2 * 8
    room = np.empty(4 * n, np.uint8)
    for over in (
        {"plane": room[:n], "v_out": room[n // 2 : n // 2 + n]},  # plane and v_out
        {"k_out": room[: 2 * n], "plane": room[n : 2 * n]},  # k_out and plane
        {"v_out": np.frombuffer(memoryview(coded), np.uint8, n, p.header_len)},  # into the payload itself
    ):
        with pytest.raises(UnsupportedConfigError, match="memory"):
            _call(p, **over)


@pytest.mark.parametrize("crc_level", [0, 1, 2])
def test_every_crc_level_expands_and_checks_alike(crc_level) -> None:
    """The call bound to each CRC tier (kvcodec._cpu.Level): the same codes, the same CRC refusal."""
    level = kvcodec._cpu.Level(simd=9, crc=crc_level)
    coded = _coded((40, 2, 24), seed=3)
    p = parse(coded)
    args, got = _call(p, check=True)
    again = {**args, "k_out": np.empty_like(args["k_out"]), "v_out": np.empty_like(args["v_out"])}
    assert got is None and level.lossless_expand(*again.values()) is None
    assert np.array_equal(again["k_out"], args["k_out"]) and np.array_equal(again["v_out"], args["v_out"])
    coded[-1] ^= 1  # the last scale byte: the CRC alone sees it
    p = parse(coded, verify_crc=False)
    args, _ = _call(p, check=True)
    want = zlib.crc32(bytes(p.payload), zlib.crc32(bytes(p.crc_prefix)))
    assert level.lossless_expand(*args.values()) == ("crc", want)


_FUZZ_BLOB = _coded((10, 3, 8), seed=5)
_FUZZ_SCALES = kvcodec.decode(bytes(_FUZZ_BLOB)).scales.float()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6),
    spans=st.lists(st.tuples(st.integers(-2, 600), st.integers(-2, 600)), min_size=6, max_size=6),
    raw_at=st.tuples(st.integers(-2, 2000), st.integers(-2, 2000)),
    lens=st.tuples(st.integers(-2, 3000), st.integers(-2, 3000)),
    deq=st.sampled_from([None, torch.float16, torch.bfloat16, torch.float32]),
)
def test_hostile_arguments_are_refused_or_decoded(flips, spans, raw_at, lens, deq) -> None:
    """Any payload bytes, spans, planes' offsets and section lengths: a result or UnsupportedConfigError
    (BAD_BUFFER), nothing read or written outside the buffers (make test-asan runs this too)."""
    p = parse(_FUZZ_BLOB)  # the tables as parsed; the bytes the call reads changed below
    payload = bytearray(p.payload)
    for at, b in flips:
        payload[at % len(payload)] = b
    over = {"payload": payload}
    if spans[0][0] % 2:  # else the blob's own layout: the damaged bytes reach the decoder
        over.update(
            k_spans=tuple(spans[:3]), v_spans=tuple(spans[3:]), k_raw_at=raw_at[0], v_raw_at=raw_at[1]
        )
    over.update({"k_len": lens[0], "v_len": lens[1]} if lens[0] % 5 == 0 else {})
    if deq is not None:  # the codes dequantized in the call too: any flips may make NaN codes
        over.update(v_out=_codes_view(p), deq=_deq(p, deq, scales=_FUZZ_SCALES))
    try:
        _, got = _call(p, check=bool(lens[1] % 2), **over)
    except UnsupportedConfigError as e:
        assert e.reason == Reason.BAD_BUFFER
    else:
        assert got is None or got == "q holds NaN codes" or got[0] in ("crc", "K", "V")
