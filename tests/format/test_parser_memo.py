"""parse's memo of headers seen before: same results as a full parse, every per-blob check still run.

A connector parses many blobs whose headers differ only in layer_id, chunk_id and the CRC; a header
seen before is not parsed again. What differs per blob (ids, trailing bytes, CRC, stored scales) and a
header never found consistent must still be checked each time.
"""

from __future__ import annotations

import gc
import struct
import tracemalloc

import pytest
import torch

from kvcodec import encode
from kvcodec.errors import CorruptEncodedKVError, Reason
from kvcodec.format import FIXED_HEADER_LEN, assemble, parse, payload_crc
from kvcodec.format.header import IDS, IDS_OFFSET, MAX_HASH_STR
from kvcodec.format.parser import (
    MEMO_MAX_BYTES,
    MEMO_MAX_HEADER_BYTES,
    clear_header_memo,
    header_memo_info,
)


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


# -- the memo is bounded in bytes and holds only headers of blobs that passed (issue 26) --


def _hash_table_at(blob: bytearray) -> int:
    """Offset of the hash pair count in ``blob``'s header."""
    p = parse(blob)
    return FIXED_HEADER_LEN + 8 * len(p.header.scale_shape) + 24


def _huge_header_blob(tag: int, pairs: int = 64) -> bytearray:
    """A legal v2 blob whose header carries ``pairs`` unknown hash pairs of 64 KiB each (~4 MiB for 64)."""
    small = _blob(0, 0, model=f"huge-{tag}")
    p = parse(small)
    at = _hash_table_at(small)
    (count,) = struct.unpack_from("<H", small, at)
    value = (f"{tag:08d}" * 8192)[:MAX_HASH_STR].encode()
    extra = b"".join(
        struct.pack("<H", len(k)) + k + struct.pack("<H", len(value)) + value
        for k in (f"x{j:03d}".encode() for j in range(pairs))
    )
    prefix = (
        bytes(small[:at]) + struct.pack("<H", count + pairs) + bytes(small[at + 2 : p.header_len - 4]) + extra
    )
    crc = payload_crc(p.header, prefix, (p.payload,))
    return bytearray(prefix + struct.pack("<I", crc) + bytes(p.payload))


def test_huge_legal_headers_leave_memory_bounded():
    """32 blobs with 4 MiB headers, parsed and dropped: what stays allocated is far below one header."""
    clear_header_memo()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for tag in range(32):
            blob = _huge_header_blob(tag)
            p = parse(blob)
            assert p.header_len > 4 << 20 and len(p.unknown_hashes) == 64
            del p, blob
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 2 * MEMO_MAX_BYTES, f"{kept} bytes still allocated after 32 parses of 4 MiB headers"
    info = header_memo_info()  # only the small blobs each huge one was built from
    assert info.bytes <= info.entries * MEMO_MAX_HEADER_BYTES


def test_headers_over_the_limit_are_not_remembered():
    blob = _reseal(_blob(0, 0), hashes={"model_id": "m" * (MEMO_MAX_HEADER_BYTES + 1)})
    clear_header_memo()
    assert parse(blob).header_len > MEMO_MAX_HEADER_BYTES
    assert header_memo_info().entries == 0


def test_the_memo_stays_under_its_byte_cap():
    clear_header_memo()
    base = parse(_blob(0, 0))
    for i in range(2 * MEMO_MAX_BYTES // 3800):
        name = f"{i:06d}" + "m" * 3700
        parse(assemble(base.header.replace(hashes={"model_id": name}), base.k, base.v, base.scales))
        assert header_memo_info().bytes <= MEMO_MAX_BYTES
    assert header_memo_info().entries > 0


def test_repeated_small_headers_are_served_from_the_memo():
    clear_header_memo()
    for layer_id in range(8):
        assert parse(_blob(layer_id, 3, seed=layer_id)).header.layer_id == layer_id
    info = header_memo_info()
    assert info.entries == 1 and 0 < info.bytes <= MEMO_MAX_HEADER_BYTES


def _bad_scale_blob(model: str) -> bytearray:
    p = parse(_blob(9, 9, model=model))
    scales = bytearray(p.scales)
    scales[0:4] = struct.pack("<f", float("nan"))
    return assemble(p.header, p.k, p.v, scales)


def _bad_crc_blob(model: str) -> bytearray:
    bad = _blob(9, 9, model=model)
    bad[-9] ^= 0x01
    return bad


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_bad_scale_blob, Reason.BAD_SCALE),
        (_bad_crc_blob, Reason.CRC_MISMATCH),
        (lambda model: _reseal(_blob(6, 6, model=model), chunk_size=4), Reason.INCONSISTENT_PAYLOAD),
    ],
    ids=["stored-scale", "crc", "consistency"],
)
def test_a_refused_blobs_header_is_not_remembered(make, reason):
    blob = make("refused-model")
    clear_header_memo()
    with pytest.raises(CorruptEncodedKVError) as ei:
        parse(blob)
    assert ei.value.reason == reason
    assert header_memo_info().entries == 0


def test_a_caller_refusing_a_blob_for_identity_can_drop_its_header():
    from kvcodec import CodecMismatchError, check_hashes
    from kvcodec.format.parser import forget_header

    blob = _blob(1, 1, model="someone-else")
    clear_header_memo()
    p = parse(blob)
    with pytest.raises(CodecMismatchError):
        check_hashes(p.header.hashes, {"model_id": "ours"})
    assert header_memo_info().entries == 1 and forget_header(p)
    assert header_memo_info() == header_memo_info().__class__(entries=0, bytes=0)
    assert not forget_header(p)
    assert parse(blob).header.hashes.model_id == "someone-else"  # and it still parses


# -- the last entry found or kept: a chunk's blobs are two byte comparisons, never a stale header --


def _full_parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts parse's full header reads (a memo miss) from now on."""
    from kvcodec.format import parser

    calls: list[int] = []
    read_fixed = parser._read_fixed

    def counting(r: object) -> object:
        calls.append(1)
        return read_fixed(r)

    monkeypatch.setattr(parser, "_read_fixed", counting)
    return calls


def test_alternating_headers_are_each_served_with_their_own_fields(monkeypatch):
    clear_header_memo()
    a, b = parse(_blob(0, 0, model="alt-a")), parse(_blob(0, 0, model="alt-b"))
    full = _full_parses(monkeypatch)
    for i in range(1, 5):
        for model, first in (("alt-a", a), ("alt-b", b)):
            p = parse(_blob(i, 2 * i, model=model, seed=i))
            assert p.header == first.header.replace(layer_id=i, chunk_id=2 * i)
    assert not full and header_memo_info().entries == 2


@pytest.mark.parametrize("drop", ["forget", "clear"])
def test_a_dropped_header_is_parsed_in_full_again(monkeypatch, drop):
    from kvcodec.format.parser import forget_header

    clear_header_memo()
    p = parse(_blob(1, 1, model="dropped"))
    full = _full_parses(monkeypatch)
    parse(_blob(2, 1, model="dropped"))
    assert not full
    forget_header(p) if drop == "forget" else clear_header_memo()
    q = parse(_blob(3, 1, model="dropped"), remember=False)
    assert len(full) == 1 and q.header.layer_id == 3 and header_memo_info().entries == 0
    bad = _blob(4, 1, model="dropped")
    IDS.pack_into(bad, IDS_OFFSET, -2, 1)
    with pytest.raises(CorruptEncodedKVError) as ei:
        parse(bad, verify_crc=False)
    assert ei.value.reason == Reason.FIELD_OUT_OF_RANGE


def test_a_header_kept_out_is_remembered_once_its_caller_checked_the_crc():
    from kvcodec.format.parser import remember_header

    clear_header_memo()
    p = parse(_blob(1, 4, model="deferred"), verify_crc=False, remember=False)
    assert header_memo_info().entries == 0
    remember_header(p)
    remember_header(parse(_blob(2, 4, model="deferred"), verify_crc=False, remember=False))
    assert header_memo_info().entries == 1


def _lossless(layer_id: int, seed: int) -> bytearray:
    g = torch.Generator().manual_seed(seed)
    k, v = ((torch.randn(32, 2, 16, generator=g) * (1 + seed)).to(torch.bfloat16) for _ in range(2))
    return encode(k, v, scope="per_page_head", page_size=8, layer_id=layer_id, compression="lossless")


def test_lossless_blobs_of_one_layout_share_one_entry():
    """A lossless blob's coded section lengths are its own: left out of the memo key like the ids, read
    and checked anew, so a stream of them takes one entry and each gets its own lengths."""
    clear_header_memo()
    blobs = [_lossless(i, seed=i) for i in range(6)]
    assert len({parse(b).header.k_payload_len for b in blobs}) > 1  # the coded sizes differ
    for b in blobs:
        p = parse(b)
        clear_header_memo()
        full = parse(b)
        parse(blobs[0])  # known again: the next blob's header comes from the memo
        assert p.header == full.header and p.header_len == full.header_len
    clear_header_memo()
    for b in blobs:
        parse(b)
    assert header_memo_info().entries == 1


@pytest.mark.parametrize("field", [0, 1], ids=["k_payload_len", "v_payload_len"])
@pytest.mark.parametrize("value", [-1, 1 << 62])
def test_a_known_lossless_headers_coded_lengths_are_range_checked(field, value):
    blob = _lossless(0, seed=1)
    p = parse(blob)
    at = FIXED_HEADER_LEN + 8 * len(p.header.scale_shape) + 8 * field
    bad = bytearray(blob)
    struct.pack_into("<q", bad, at, value)
    clear_header_memo()
    with pytest.raises(CorruptEncodedKVError) as fresh:
        parse(bad, verify_crc=False)
    parse(blob)  # now known
    with pytest.raises(CorruptEncodedKVError) as known:
        parse(bad, verify_crc=False)
    assert known.value.reason == fresh.value.reason and str(known.value) == str(fresh.value)


def test_a_known_lossless_header_with_lengths_that_miss_the_payload_is_refused():
    """Lengths in range that do not fit the blob: the per-blob checks (sections, tables) refuse it as a
    full parse does."""
    blob = _lossless(0, seed=2)
    p = parse(blob)
    at = FIXED_HEADER_LEN + 8 * len(p.header.scale_shape)
    bad = bytearray(blob)
    struct.pack_into("<qq", bad, at, p.header.k_payload_len + 3, p.header.v_payload_len - 3)
    clear_header_memo()
    with pytest.raises(CorruptEncodedKVError) as fresh:
        parse(bad, verify_crc=False)
    parse(blob)
    with pytest.raises(CorruptEncodedKVError) as known:
        parse(bad, verify_crc=False)
    assert known.value.reason == fresh.value.reason and str(known.value) == str(fresh.value)
