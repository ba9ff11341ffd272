"""The CRC-32 the C loops fold into the encode and decode passes: zlib's, bit for bit.

``kvcodec._cpu.crc32`` runs the same loops (carry-less multiply folding, byte
tail) that ``encode_v`` and ``dequantize`` carry over the payload; the folding
constants in kvcodec/csrc/ (crc_fold.h, crc_clmul.c, crc_vclmul.c, avx512_fold.c) are derived here from the
polynomial.
Blobs written with the CRC folded in equal blobs whose CRC kvcodec.format
computes afterwards, and a decode with the folded check refuses a damaged blob.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvcodec.backends.cpu import AVAILABLE
from kvcodec.codec import decode, encode
from kvcodec.errors import CodecError, CorruptEncodedKVError, Reason
from kvcodec.format import parse, payload_crc
from tests.backends.conftest import cpu_level

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="kvcodec._cpu is not built")

CSRC = Path(__file__).resolve().parents[2] / "kvcodec" / "csrc"
POLY = 0x104C11DB7
"""CRC-32's generator polynomial (IEEE 802.3), x^32 included."""


@pytest.fixture(params=[0, 1, 2], ids=["bytewise", "folded128", "folded512"])
def fast(request: pytest.FixtureRequest) -> Any:
    """Each test byte by byte, then folded on 128-bit lanes (PCLMULQDQ), then on 512-bit registers
    (VPCLMULQDQ), each where the CPU has it (else the best level below runs again): the backend bound
    to that ``kvcodec._cpu.Level``, which the test calls directly too."""
    with cpu_level(crc=request.param) as bound:
        yield bound


def _xpow_mod(n: int) -> int:
    r = 1
    for _ in range(n):
        r <<= 1
        if r >> 32:
            r ^= POLY
    return r


def _reflect(x: int, bits: int) -> int:
    return int(f"{x:0{bits}b}"[::-1], 2)


def _fold_constant(n: int) -> int:
    """x^n mod P, bit-reflected over 32 bits and shifted left once (the folding loops' convention)."""
    return _reflect(_xpow_mod(n), 32) << 1


def _floor_div(n: int) -> int:
    num, q = 1 << n, 0
    while num.bit_length() >= POLY.bit_length():
        sh = num.bit_length() - POLY.bit_length()
        q |= 1 << sh
        num ^= POLY << sh
    return q


def test_folding_constants_are_derived_from_the_polynomial() -> None:
    text = "".join(p.read_text() for p in sorted(CSRC.glob("*.[ch]")))
    folds = (2048, 1024, 512, 128)  # the 512-bit loop's distance and merge, the 128-bit loop's, the lanes'
    wanted = [_fold_constant(n + d) for n in folds for d in (-32, 32)] + [_fold_constant(64)]
    wanted += [_reflect(_floor_div(64), 33), _reflect(POLY, 33)]  # Barrett: mu and P, reflected
    present = {int(h, 16) for h in re.findall(r"0x([0-9a-fA-F]+)LL", text)}
    assert set(wanted) <= present


@pytest.mark.parametrize("seed", [0, 1, 0xFFFFFFFF, 0x12345678])
def test_crc32_equals_zlib_at_every_length_and_alignment(fast: Any, seed: int) -> None:
    data = np.random.default_rng(seed & 0xFF).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    for n in [*range(300), *range(300, 1100, 16), 1023, 1024, 1040, 4095, 4096, 4999 - 3]:
        for off in (0, 1, 3):
            part = data[off : off + n]
            assert fast.crc32(part, seed) == zlib.crc32(part, seed), (n, off)


def test_crc32_refuses_a_bad_seed(fast: Any) -> None:
    with pytest.raises(Exception, match="crc32"):
        fast.crc32(b"abc", -1)


def _layer(seed: int, shape: tuple[int, int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), (torch.randn(shape, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(48, 2, 64), (33, 3, 17), (1, 1, 1), (2048, 1, 8)])
@pytest.mark.parametrize("version", [1, 2])
def test_encode_with_the_crc_folded_in_writes_the_same_bytes(
    fast: Any, encode_pass: int, dtype: torch.dtype, shape: tuple[int, int, int], version: int
) -> None:
    k, v = _layer(sum(shape), shape, dtype)
    kw = {"scope": "per_page_head", "page_size": 16, "version": version}
    out = bytearray(len(encode(k, v, **kw)))
    got = encode(k, v, out=out, **kw)
    with cpu_level(crc=0):
        want = encode(k, v, **kw)  # the CRC computed afterwards by kvcodec.format
    assert bytes(got) == bytes(want)


@pytest.mark.parametrize("magnitude", [1.0, 1.0e-37, 1.0e37], ids=["normal", "tiny_scale", "large_scale"])
def test_encode_folding_the_codes_crc_into_the_quantize_writes_the_same_bytes(
    fast: Any, encode_pass: int, magnitude: float
) -> None:
    """Rows of whole 64-byte lines carry the codes' CRC in the quantize's stores (512-bit level), a
    row whose scale has no usable reciprocal (fp32 V near the range's ends) folds its bytes after the
    division: the same blob as the CRC computed afterwards."""
    g = torch.Generator().manual_seed(9)
    k = torch.randn(40, 3, 64, generator=g)
    v = torch.randn(40, 3, 64, generator=g) * magnitude
    v[:8] = torch.randn(8, 3, 64, generator=g)  # page 0 of ordinary scale, the others of V's
    kw = {"scope": "per_page_head", "page_size": 8}
    got = encode(k, v, out=bytearray(len(encode(k, v, **kw))), **kw)
    with cpu_level(crc=0):
        want = encode(k, v, **kw)
    assert bytes(got) == bytes(want)


def test_encode_v_returns_the_crc_over_k_then_the_codes(fast: Any, encode_pass: int) -> None:
    k, v = _layer(5, (64, 4, 32), torch.float16)
    q = np.empty((64, 4, 32), np.uint8)
    s = np.empty((4, 4), np.float32)
    k_src = k.numpy().reshape(-1).view(np.uint8)
    k_dst = np.empty_like(k_src)
    got = fast.encode_v(v.numpy(), 0, 2, 16, 2, q, s, k_src, k_dst, 99)
    if fast.crc:
        assert got == zlib.crc32(q, zlib.crc32(k_dst, 99))
    else:
        assert got is None  # no folding: the caller computes it
    assert bytes(k_dst) == bytes(k_src)


@pytest.mark.parametrize("dim", [32, 64])
def test_encode_v_crc_of_one_token_with_a_long_token_stride(fast: Any, encode_pass: int, dim: int) -> None:
    """One token's codes are dense whatever q's token stride says: the CRC covers exactly H x D bytes
    (in the unfolded rows and the folded stores alike), never bytes past q."""
    _testbuffer = pytest.importorskip("_testbuffer")  # numpy exports a length-1 axis's canonical stride

    _, v = _layer(16, (1, 2, dim), torch.float16)
    q = _testbuffer.ndarray(
        [0] * (2 * dim),
        shape=[1, 2, dim],
        strides=[1 << 16, dim, 1],
        format="B",
        flags=_testbuffer.ND_WRITABLE,
    )
    s = np.empty((1, 2), np.float32)
    got = fast.encode_v(v.numpy(), 0, 2, 16, 2, q, s, None, None, 0)
    if fast.crc:
        assert got == zlib.crc32(bytes(memoryview(q)))
    else:
        assert got is None


def test_encode_v_with_a_strided_output_leaves_the_crc_to_the_caller(fast: Any) -> None:
    _, v = _layer(6, (32, 2, 16), torch.float16)
    q = np.empty((32, 2, 32), np.uint8)[:, :, :16]
    s = np.empty((2, 2), np.float32)
    assert fast.encode_v(v.numpy(), 0, 2, 16, 2, q, s, None, None, 7) is None


def _decode_pair(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(k), torch.empty_like(v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scope", ["per_page_head", "per_layer_head", "per_tensor"])
def test_decode_with_the_crc_folded_in_equals_the_checked_path(
    fast: Any, dtype: torch.dtype, scope: str
) -> None:
    k, v = _layer(11, (40, 3, 48), dtype)
    blob = encode(k, v, scope=scope, page_size=16)
    out_k, out_v = _decode_pair(k, v)
    got = decode(blob, out_k=out_k, out_v=out_v)
    want = decode(parse(blob), out_v_dtype=dtype)  # CRC checked by the parser, V dequantized apart
    assert got.k is out_k and got.v is out_v and torch.equal(out_k, k)
    assert torch.equal(out_v.view(torch.uint8), want.v.contiguous().view(torch.uint8))
    assert torch.equal(got.scales, want.scales) and got.header == want.header


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,magnitude",
    [((40, 3, 128), 1.0), ((20, 18, 64), 1.0), ((33, 2, 192), 1.0e-37), ((1, 1, 64), 1.0)],
    ids=["tables", "heads_past_the_tables", "tiny_scales", "one_row"],
)
def test_decode_folding_the_codes_crc_into_the_rows_equals_the_checked_path(
    fast: Any, dtype: torch.dtype, shape: tuple[int, int, int], magnitude: float
) -> None:
    """Rows of whole 64-byte lines carry the codes' CRC in the dequantizing loop (512-bit level): by
    table, by computed rows past the tables' heads, and for scales too small for a table."""
    k, v = _layer(14, shape, torch.float32)
    v = v * magnitude
    blob = encode(k.to(dtype), v.to(dtype) if magnitude == 1.0 else v, page_size=16)
    want = decode(parse(blob), out_v_dtype=dtype)
    got = decode(blob, out_k=torch.empty_like(want.k), out_v=torch.empty(want.v.shape, dtype=dtype))
    assert torch.equal(got.k.view(torch.uint8), want.k.contiguous().view(torch.uint8))
    assert torch.equal(got.v.view(torch.uint8), want.v.contiguous().view(torch.uint8))


def _with_nan_code(blob: bytes, at_code: int) -> bytearray:
    """The blob with one V code made a NaN (0x7F) and its CRC recomputed: valid bytes, a NaN inside."""
    p = parse(blob)
    h, at = p.header, p.header_len
    out = bytearray(blob)
    out[at + h.k_payload_len + at_code] = 0x7F
    crc = payload_crc(h, p.crc_prefix, (memoryview(out)[at : at + h.payload_len],))
    out[at - 4 : at] = crc.to_bytes(4, "little")
    return out


@pytest.mark.parametrize("where", [0, 128 * 2 * 17 + 5, 128 * 2 * 40 - 1], ids=["first", "middle", "last"])
def test_decode_meeting_a_nan_code_mid_fold_equals_the_checked_path(fast: Any, where: int) -> None:
    """A NaN code stops the folded rows; the checked path then decodes the whole blob (NaN kept)."""
    k, v = _layer(15, (40, 2, 128), torch.float16)
    blob = _with_nan_code(encode(k, v, page_size=16), where)
    want = decode(parse(blob), out_v_dtype=torch.float16)
    got = decode(blob, out_k=torch.empty_like(k), out_v=torch.empty_like(v))
    assert torch.isnan(got.v).sum() == 1
    assert torch.equal(got.v.view(torch.int16), want.v.contiguous().view(torch.int16))


def test_decode_with_the_crc_folded_in_refuses_a_damaged_payload(fast: Any) -> None:
    k, v = _layer(12, (64, 2, 64), torch.float16)  # rows of 64 bytes: the folding rows at level 2
    blob = encode(k, v, page_size=16)
    at = parse(blob).header_len
    codes = k.numel() * 2
    for off in (0, codes - 1, codes + 5, codes + 64 * 70 + 3, codes + v.numel() - 1, len(blob) - at - 1):
        bad = bytearray(blob)
        bad[at + off] ^= 0x10
        with pytest.raises(CorruptEncodedKVError) as e:
            decode(bad, out_k=torch.empty_like(k), out_v=torch.empty_like(v))
        assert e.value.reason == Reason.CRC_MISMATCH, off


def _reason(call: Any, *args: Any, **kw: Any) -> Any:
    try:
        call(*args, **kw)
    except CodecError as e:
        return e.reason
    return None


def test_decode_names_a_damaged_header_as_the_parser_does(fast: Any) -> None:
    """Errors met before the folded check go to the checked path, which names a damaged blob by its CRC."""
    k, v = _layer(13, (32, 2, 16), torch.float16)
    blob = encode(k, v, page_size=16)
    for i in range(parse(blob).header_len):
        bad = bytearray(blob)
        bad[i] ^= 0x41
        got = _reason(decode, bad, out_k=torch.empty_like(k), out_v=torch.empty_like(v))
        assert got == _reason(parse, bytes(bad)), i


def _blob_rows(blob: Any) -> tuple[Any, Any]:
    from kvcodec.backends import Groups
    from kvcodec.backends.cpu import BlobRows

    p = parse(blob)
    h, at, buf = p.header, p.header_len, p.buffer
    t, heads, d = h.v_payload_len // (h.kv_head_count * h.head_dim), h.kv_head_count, h.head_dim
    k = np.frombuffer(buf, np.uint8, h.k_payload_len, at).reshape(t, heads, -1)
    codes = np.frombuffer(buf, np.uint8, h.v_payload_len, at + h.k_payload_len).reshape(t, heads, d)
    scales = np.frombuffer(buf, np.float32, h.scale_payload_len // 4, at + h.k_payload_len + h.v_payload_len)
    groups = Groups(h.scale_scope, h.page_size, torch.float8_e4m3fn)
    return p, BlobRows(k, codes, scales.copy().reshape(h.scale_shape), groups)


@pytest.mark.parametrize("order", ["in_order", "shuffled", "skip_first_block", "skip_middle"])
@pytest.mark.parametrize("heads,dim", [(2, 32), (4, 32), (4, 64), (8, 128)], ids=lambda x: str(x))
def test_scatter_blob_rows_carries_the_blobs_crc(fast: Any, order: str, heads: int, dim: int) -> None:
    """Runs in token order with a token's K in whole 256-byte blocks fold K's CRC into its copy (the
    512-bit level); others fold it per run or in a pass of its own. Either way the CRC is the blob's
    and the cache holds what the scatter without a CRC writes."""
    from kvcodec.backends.cpu import scatter_blob_rows
    from kvcodec.format import payload_crc

    k, v = _layer(14, (64, heads, dim), torch.float16)
    blob = encode(k, v, page_size=16)
    p, rows = _blob_rows(blob)
    runs = np.array([[b, 0, b * 16, 16] for b in range(4)], np.int64)
    runs = {"shuffled": runs[[2, 0, 3, 1]], "skip_first_block": runs[1:], "skip_middle": runs[[0, 1, 3]]}.get(
        order, runs
    )
    cache = torch.zeros(6, heads, 16, 2 * dim, dtype=torch.float16)
    plain = cache.clone()
    assert scatter_blob_rows(rows, plain, dim, runs).crc is None
    got = scatter_blob_rows(rows, cache, dim, runs, crc=payload_crc(p.header, p.crc_prefix, ())).crc
    assert torch.equal(cache.view(torch.int16), plain.view(torch.int16))
    if not fast.crc:
        assert got is None
        return
    end = p.header_len + p.header.k_payload_len + p.header.v_payload_len
    assert zlib.crc32(p.buffer[end : end + p.header.scale_payload_len], got) == p.crc
    for b, _, t, n in runs.tolist():
        assert torch.equal(cache[b, :, :n, :dim].transpose(0, 1), k[t : t + n])
