"""Reads bounded by what a blob file declares (issue 26 item 2): the size is checked against the header
before the rest is read, so a sparse or lying file costs a few KiB, measured with tracemalloc."""

from __future__ import annotations

import os
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcodec.errors import CorruptEncodedKVError, Reason
from kvcodec.format import crc32, parse
from kvcodec.format.header import (
    CRC_FIELD,
    FIXED_HEADER,
    HASH_PAIR_COUNT,
    MAX_HASH_PAIRS,
    PAYLOAD_LENS,
    SCALE_DIM,
)
from kvcodec.store import DirectoryStore
from tests.raises import raises_reason
from tests.store.test_store import make_blob

GIB = 1 << 30
BOUND = 16 << 20
"""What a refused read may allocate at most (it needs a few KiB)."""


def peak_bytes(call: Callable[[], Any]) -> int:
    """Peak traced allocation while ``call`` runs (its exception, if any, is swallowed)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        try:
            call()
        except (CorruptEncodedKVError, KeyError):
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _hash_count_offset(blob: bytes) -> int:
    n_scale = FIXED_HEADER.unpack_from(blob)[-1]
    return FIXED_HEADER.size + n_scale * SCALE_DIM.size + PAYLOAD_LENS.size


def huge_header_blob(value_len: int = 16_000) -> bytes:
    """A legal v2 blob whose header holds the most hash pairs allowed, extra ones of ``value_len``
    bytes each (about 4 MiB of header by default), CRC recomputed."""
    base = make_blob(2048, 3, version=2)
    p = parse(base)
    at = _hash_count_offset(base)
    (count,) = HASH_PAIR_COUNT.unpack_from(base, at)
    pairs = bytearray(base[at + HASH_PAIR_COUNT.size : p.header_len - CRC_FIELD.size])
    for i in range(MAX_HASH_PAIRS - count):
        key, val = f"extra{i:03d}".encode(), b"v" * value_len
        pairs += struct.pack("<H", len(key)) + key + struct.pack("<H", len(val)) + val
    prefix = base[:at] + HASH_PAIR_COUNT.pack(MAX_HASH_PAIRS) + bytes(pairs)
    payload = base[p.header_len :]
    crc = crc32(payload, crc32(prefix))
    return prefix + CRC_FIELD.pack(crc) + payload


def sparse_copy(path: Path, blob: bytes, apparent: int) -> None:
    """``blob`` followed by a hole up to ``apparent`` bytes (a few KiB on disk)."""
    path.write_bytes(blob)
    os.truncate(path, apparent)


@pytest.fixture
def store(tmp_path: Path) -> DirectoryStore:
    return DirectoryStore(tmp_path / "s", fsync=False)


@pytest.mark.parametrize("read", ["get_parsed", "get_parsed_many", "get"])
def test_a_sparse_gib_file_is_refused_before_it_is_read(store: DirectoryStore, read: str) -> None:
    path = Path(store.root) / "k"
    sparse_copy(path, make_blob(2048, 1, version=2), GIB)
    assert os.stat(path).st_blocks * 512 < (1 << 20)  # really sparse: the test measures a read, not a disk
    calls = {
        "get_parsed": lambda: store.get_parsed("k"),
        "get_parsed_many": lambda: store.get_parsed_many(["k"]),
        "get": lambda: store.get("k"),
    }
    assert peak_bytes(calls[read]) < BOUND
    assert not path.exists() and os.listdir(store.quarantine_dir)  # quarantined like any damaged blob
    sparse_copy(path, make_blob(2048, 1, version=2), GIB)
    with raises_reason(CorruptEncodedKVError, Reason.SIZE_MISMATCH):
        calls[read]()


def test_a_header_declaring_more_than_the_file_is_truncated_not_allocated(store: DirectoryStore) -> None:
    blob = bytearray(make_blob(2048, 2, version=2))
    k_len_at = _hash_count_offset(blob) - PAYLOAD_LENS.size
    struct.pack_into("<q", blob, k_len_at, GIB)  # the header now declares a 1 GiB K payload
    (Path(store.root) / "k").write_bytes(blob)
    assert peak_bytes(lambda: store.get_parsed("k")) < BOUND
    (Path(store.root) / "k").write_bytes(blob)
    with raises_reason(CorruptEncodedKVError, Reason.TRUNCATED_PAYLOAD):
        store.get_parsed("k")


def test_a_huge_legal_header_costs_what_the_file_declares(store: DirectoryStore) -> None:
    blob = huge_header_blob()
    assert len(blob) > (3 << 20)
    store.put("big", blob)
    got: list[Any] = []
    peak = peak_bytes(lambda: got.append(store.get_parsed("big")))
    assert got and bytes(got[0].blob) == blob and len(got[0].unknown_hashes) > 200
    assert peak < 4 * len(blob)  # the buffer, the decoded strings, the parser's own copies: O(file)


def test_a_huge_header_over_a_sparse_tail_is_refused_in_kib(store: DirectoryStore) -> None:
    """The header walk reads only the length fields of a long header, never the file's tail."""
    path = Path(store.root) / "big"
    sparse_copy(path, huge_header_blob(), GIB)
    assert peak_bytes(lambda: store.get_parsed("big")) < BOUND
    sparse_copy(path, huge_header_blob(), GIB)
    with raises_reason(CorruptEncodedKVError, Reason.SIZE_MISMATCH):
        store.get_parsed("big")


@pytest.mark.parametrize(
    ("cut", "reason"),
    [
        (0, Reason.TRUNCATED_HEADER),
        (10, Reason.TRUNCATED_HEADER),
        (FIXED_HEADER.size + 5, Reason.TRUNCATED_HEADER),
        (-1, Reason.TRUNCATED_PAYLOAD),
    ],
)
def test_short_files_keep_the_truncation_reason(store: DirectoryStore, cut: int, reason: Reason) -> None:
    blob = make_blob(2048, 4, version=2)
    (Path(store.root) / "k").write_bytes(blob[:cut])
    for read in (store.get, store.get_parsed):
        (Path(store.root) / "k").write_bytes(blob[:cut])
        with raises_reason(CorruptEncodedKVError, reason):
            read("k")
        assert not (Path(store.root) / "k").exists()


def test_bad_magic_in_a_large_file_is_refused_from_its_prefix(store: DirectoryStore) -> None:
    path = Path(store.root) / "k"
    path.write_bytes(b"NOTLMCKV" + bytes(100))
    os.truncate(path, GIB)
    assert peak_bytes(lambda: store.get_parsed("k")) < BOUND
    path.write_bytes(b"NOTLMCKV" + bytes(100))
    with raises_reason(CorruptEncodedKVError, Reason.BAD_MAGIC):
        store.get_parsed("k")


def test_a_remembered_header_never_vouches_for_another(store: DirectoryStore) -> None:
    """After a good blob's header is remembered, files that differ from it in a declared length, or
    in their own size, are still refused."""
    good = make_blob(2048, 6, version=2)
    store.put("good", good)
    store.get_parsed("good")
    longer = bytearray(good)
    k_len_at = _hash_count_offset(longer) - PAYLOAD_LENS.size
    struct.pack_into("<q", longer, k_len_at, struct.unpack_from("<q", longer, k_len_at)[0] + 8)
    cases = [(bytes(longer), Reason.TRUNCATED_PAYLOAD), (good + b"\0", Reason.SIZE_MISMATCH)]
    for data, reason in cases:
        for into in (None, bytearray(len(good) + 64)):  # prefix first; one read into a reused buffer
            (Path(store.root) / "k").write_bytes(data)
            with raises_reason(CorruptEncodedKVError, reason):
                store.get_parsed("k", into=into)
    assert bytes(store.get_parsed("good").blob) == good
