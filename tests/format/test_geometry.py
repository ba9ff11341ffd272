"""A parsed blob's geometry, the plain-blob predicate and the CRC carried through a payload pass."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from kvcodec import CorruptEncodedKVError, Reason, encode
from kvcodec.format import BlobCrc, ScaleScheme, geometry, is_plain, parse
from kvcodec.format.geometry import sections_from
from kvcodec.format.parser import clear_header_memo, header_memo_info


def _blob(tokens: int = 40, heads: int = 3, dim: int = 64, **kw) -> bytes:
    g = torch.Generator().manual_seed(tokens)
    k = torch.randn(tokens, heads, dim, generator=g).to(kw.pop("dtype", torch.float16))
    v = torch.randn(tokens, heads, dim, generator=g).to(k.dtype)
    return encode(k, v, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_geometry_is_the_payloads(dtype: torch.dtype) -> None:
    p = parse(_blob(dtype=dtype, scope="per_page_head", page_size=16))
    g = geometry(p.header)
    assert g is not None and (g.tokens, g.heads, g.head_dim) == (40, 3, 64) == g.v_shape
    assert g.k_row == 64 * dtype.itemsize and g.k_shape == (40, 3, 64 * dtype.itemsize)
    assert bytes(p.payload[g.v_at : g.scales_at]) == bytes(p.v) and bytes(
        p.payload[g.scales_at : g.end]
    ) == bytes(p.scales)
    assert g.end == len(p.payload) and g.tokens == p.header.num_tokens


def test_plain_blobs() -> None:
    for scope, page in (("per_page_head", 16), ("per_layer_head", None), ("per_tensor", None)):
        assert is_plain(parse(_blob(scope=scope, page_size=page, scale_dtype=torch.float32)).header)
    assert not is_plain(parse(_blob(scope="per_page_head", page_size=16, scale_dtype=torch.float16)).header)
    assert not is_plain(parse(_blob(scope="raw")).header)  # unit scales: no scale payload


def test_a_v_only_blob_is_not_plain() -> None:
    v = torch.randn(8, 2, 32).to(torch.float16)
    h = parse(encode(None, v, scope="per_layer_head", scale_dtype=torch.float32)).header
    assert not is_plain(h) and geometry(h) is not None


def test_a_lossless_payload_has_no_row_geometry_whatever_its_lengths() -> None:
    """Schemes 3 and 4 hold coded streams: even with section lengths a plain blob of that shape
    would have, no geometry (so no consumer reads rows out of a coded payload)."""
    plain = parse(_blob(scope="per_page_head", page_size=16, scale_dtype=torch.float32)).header
    assert geometry(plain) is not None and is_plain(plain)
    for scheme in (ScaleScheme.LOSSLESS, ScaleScheme.LOSSLESS_UNIT):
        coded = dataclasses.replace(plain, scale_scheme=scheme)
        assert geometry(coded) is None and not is_plain(coded)
    lossless = parse(encode(*_kv_pair(), scope="per_page_head", page_size=16, compression="lossless")).header
    assert geometry(lossless) is None and not is_plain(lossless)


def _kv_pair() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(32, 2, 16, generator=g).bfloat16(), torch.randn(32, 2, 16, generator=g).bfloat16()


@pytest.mark.parametrize("through", [None, 0, "codes", "all"])
def test_blob_crc_finishes_from_any_point(through: object) -> None:
    p = parse(_blob(scope="per_page_head", page_size=16), verify_crc=False)
    c = BlobCrc(p)
    payload = bytes(p.payload)
    at = {None: 0, 0: 0, "codes": c.codes_end, "all": len(payload)}[through]
    got = None if through is None else zlib.crc32(payload[:at], c.seed)
    c.finish(got, at)  # the stored CRC: passes


def test_blob_crc_refuses_damage_and_remembers_only_after_passing() -> None:
    blob = bytearray(_blob(scope="per_layer_head"))
    clear_header_memo()
    p = parse(blob, verify_crc=False, remember=False)
    c = BlobCrc(p)
    blob[-1] ^= 1  # a scale byte, after the codes
    with pytest.raises(CorruptEncodedKVError) as e:
        c.finish(zlib.crc32(bytes(p.payload[: c.codes_end]), c.seed), c.codes_end, remember=True)
    assert e.value.reason == Reason.CRC_MISMATCH and header_memo_info().entries == 0
    blob[-1] ^= 1
    c.finish(None, remember=True)
    assert header_memo_info().entries == 1


@pytest.mark.parametrize("skip", [0, 16, 32])
def test_sections_from_a_page_are_the_blob_of_those_tokens(skip: int) -> None:
    """per_page_head scales are per page: the tail from a page boundary is the blob of those tokens."""
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(40, 3, 64, generator=g).half(), torch.randn(40, 3, 64, generator=g).half()
    kw = {"scope": "per_page_head", "page_size": 16, "scale_dtype": torch.float32}
    whole = parse(encode(k, v, **kw))
    got = b"".join(bytes(x) for x in sections_from(whole, skip))
    want = bytes(parse(encode(k[skip:], v[skip:], **kw)).payload)
    assert got == want


def test_sections_from_keep_whole_scales_and_refuse_a_split_page() -> None:
    p = parse(_blob(scope="per_layer_head", scale_dtype=torch.float32))
    k, codes, scales = sections_from(p, 8)
    assert bytes(k) == bytes(p.k)[8 * 3 * 64 * 2 :] and bytes(codes) == bytes(p.v)[8 * 3 * 64 :]
    assert bytes(scales) == bytes(p.scales)
    with pytest.raises(ValueError, match="splits a scale page"):
        sections_from(parse(_blob(scope="per_page_head", page_size=16)), 8)
    with pytest.raises(ValueError, match="not a token"):
        sections_from(p, 41)
