"""A parsed blob's geometry, the plain-blob predicate and the CRC carried through a payload pass."""

from __future__ import annotations

import zlib

import pytest
import torch

from kvcodec import CorruptEncodedKVError, Reason, encode
from kvcodec.format import BlobCrc, geometry, is_plain, parse
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
