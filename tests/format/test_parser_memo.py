"""parse's memo of headers seen before: same results as a full parse, every per-blob check still run.

A connector parses many blobs whose headers differ only in layer_id, chunk_id and the CRC; a header
seen before is not parsed again. What differs per blob (ids, trailing bytes, CRC, stored scales) and a
header never found consistent must still be checked each time.
"""

from __future__ import annotations

import struct

import pytest
import torch

from kvcodec import encode
from kvcodec.errors import CorruptEncodedKVError, Reason
from kvcodec.format import assemble, parse
from kvcodec.format.header import IDS, IDS_OFFSET


def _blob(layer_id: int, chunk_id: int, model: str = "memo-model", seed: int = 0) -> bytearray:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(32, 2, 16, generator=g).to(torch.bfloat16)
    v = torch.randn(32, 2, 16, generator=g).to(torch.bfloat16)
    return encode(
        k,
        v,
        scope="per_page_head",
        page_size=8,
        hashes={"model_id": model},
        layer_id=layer_id,
        chunk_id=chunk_id,
    )


def _reseal(blob: bytearray, **header_changes) -> bytearray:
    p = parse(blob)
    return assemble(p.header.replace(**header_changes), p.k, p.v, p.scales)


def test_ids_and_everything_else_as_a_full_parse():
    first = parse(_blob(0, 0))
    for layer_id, chunk_id, seed in ((3, 7, 1), (0, 0, 2), (11, 2, 3)):
        blob = _blob(layer_id, chunk_id, seed=seed)
        p = parse(blob)
        assert (p.header.layer_id, p.header.chunk_id) == (layer_id, chunk_id)
        assert p.header == first.header.replace(layer_id=layer_id, chunk_id=chunk_id)
        assert (
            p.header_len == first.header_len and p.crc == struct.unpack_from("<I", blob, p.header_len - 4)[0]
        )


def test_crc_still_checked_on_a_known_header():
    parse(_blob(1, 1))
    bad = _blob(1, 2, seed=5)
    bad[-9] ^= 0x01
    with pytest.raises(CorruptEncodedKVError) as ei:
        parse(bad)
    assert ei.value.reason == Reason.CRC_MISMATCH
    parse(bad, verify_crc=False)  # and skipped only when asked


def test_trailing_bytes_and_truncation_still_checked():
    blob = _blob(2, 2)
    parse(blob)
    with pytest.raises(CorruptEncodedKVError) as ei:
        parse(blob + b"\x00")
    assert ei.value.reason == Reason.TRAILING_BYTES
    with pytest.raises(CorruptEncodedKVError) as ei:
        parse(blob[:-1])
    assert ei.value.reason in (Reason.TRUNCATED_PAYLOAD, Reason.TRAILING_BYTES)


def test_bad_stored_scale_still_refused_on_a_known_header():
    blob = _blob(4, 4)
    parse(blob)
    p = parse(blob)
    scales = bytearray(p.scales)
    scales[0:4] = struct.pack("<f", float("nan"))
    bad = assemble(p.header, p.k, p.v, scales)
    with pytest.raises(CorruptEncodedKVError) as ei:
        parse(bad)
    assert ei.value.reason == Reason.BAD_SCALE


def test_out_of_range_ids_on_a_known_header_are_refused():
    blob = _blob(5, 5)
    parse(blob)
    bad = bytearray(blob)
    IDS.pack_into(bad, IDS_OFFSET, -2, 5)
    with pytest.raises(CorruptEncodedKVError) as ei:
        parse(bad, verify_crc=False)
    assert ei.value.reason == Reason.FIELD_OUT_OF_RANGE


def test_a_header_parsed_without_consistency_is_still_checked_with_it():
    """chunk_size below the payload's tokens: consistency=False accepts it, a later full parse refuses."""
    bad = _reseal(_blob(6, 6, model="inconsistent"), chunk_size=4)
    p = parse(bad, consistency=False)
    assert p.header.chunk_size == 4
    for _ in range(2):
        with pytest.raises(CorruptEncodedKVError) as ei:
            parse(bad)
        assert ei.value.reason == Reason.INCONSISTENT_PAYLOAD


def test_changed_hash_bytes_are_a_different_header():
    a = parse(_blob(7, 7, model="model-a"))
    b = parse(_blob(7, 7, model="model-b"))
    assert a.header.hashes.model_id == "model-a" and b.header.hashes.model_id == "model-b"
