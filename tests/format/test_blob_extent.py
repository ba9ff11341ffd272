"""``blob_extent``: a reader learns a blob's declared size from its header alone, a few bytes at a time."""

from __future__ import annotations

import struct

import pytest

from kvcodec.errors import CorruptEncodedKVError, Reason
from kvcodec.format import FIXED_HEADER_LEN, parse
from kvcodec.format.parser import Extent, blob_extent
from tests.format.test_parser_memo import _blob, _huge_header_blob


@pytest.mark.parametrize(
    "make", [lambda: _blob(1, 2), lambda: _huge_header_blob(3, pairs=4)], ids=["small", "big"]
)
def test_reading_what_it_asks_for_ends_at_the_parsers_extent(make) -> None:
    blob = bytes(make())
    p = parse(blob)
    have, asks = FIXED_HEADER_LEN, []
    while isinstance(got := blob_extent(blob[:have]), int):
        assert have < got <= p.header_len  # it never asks past the header
        asks.append(got)
        have = got
    assert got == Extent(p.header_len, p.header.payload_len, p.header.version)
    assert got.size == len(blob) and asks == sorted(asks)


def test_a_short_prefix_asks_for_the_fixed_part() -> None:
    assert blob_extent(b"") == FIXED_HEADER_LEN
    assert blob_extent(bytes(_blob(0, 0))[:10]) == FIXED_HEADER_LEN


def test_fixed_fields_and_lengths_are_checked_as_parse_checks_them() -> None:
    with pytest.raises(CorruptEncodedKVError) as ei:
        blob_extent(b"NOTLMCKV" + bytes(200))
    assert ei.value.reason is Reason.BAD_MAGIC
    blob = _blob(0, 0)
    n_scale = len(parse(blob).header.scale_shape)
    struct.pack_into("<q", blob, FIXED_HEADER_LEN + 8 * n_scale, -5)
    with pytest.raises(CorruptEncodedKVError) as ei:
        blob_extent(blob)
    assert ei.value.reason is Reason.NEGATIVE_PAYLOAD_LEN
