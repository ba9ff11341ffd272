"""DirectoryStore recency: a read persists it to the file's mtime only when that is RECENCY_PERSIST_S
old; this instance's eviction order stays exact, and the evictor still sees another process's use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kvcodec.store.directory as store_mod
from kvcodec.store import DirectoryStore
from kvcodec.store.index import RECENCY_PERSIST_S
from tests.store.test_store import make_blob

BLOB = 4 << 10
OLD_NS = 1_000_000_000  # 1970: far older than the limit


def _mtime(path: Path) -> int:
    return os.stat(path).st_mtime_ns


def test_limit_is_named_and_positive() -> None:
    assert RECENCY_PERSIST_S > 0 and store_mod.RECENCY_PERSIST_S == RECENCY_PERSIST_S


@pytest.mark.parametrize("parsed", [False, True])
def test_read_within_limit_keeps_mtime_but_is_most_recent(tmp_path: Path, parsed: bool) -> None:
    """A read soon after the put leaves the file alone, yet the blob is the most recent in memory."""
    size = len(make_blob(BLOB, 0))
    st = DirectoryStore(tmp_path, max_bytes=3 * size + size // 2, rescan_interval_s=3600, fsync=False)
    for i, k in enumerate("abc"):
        st.put(k, make_blob(BLOB, i + 1))
    before = _mtime(tmp_path / "a")
    if parsed:
        st.get_parsed("a", verify_crc=False)
    else:
        st.get("a")
    assert _mtime(tmp_path / "a") == before  # no utime: the file's stamp is fresh
    assert list(st._index.entries) == ["b", "c", "a"]
    st.put("d", make_blob(BLOB, 4))  # evicts b, the least recent in memory, not a
    assert st.keys() == ["a", "c", "d"]


def test_rescan_keeps_unpersisted_recency(tmp_path: Path) -> None:
    """A rescan (``rescan_interval_s=0``) rebuilds from mtimes but keeps the stamp of a file unchanged
    since this instance saw it, so an unpersisted read still protects it."""
    size = len(make_blob(BLOB, 0))
    st = DirectoryStore(tmp_path, max_bytes=3 * size + size // 2, rescan_interval_s=0, fsync=False)
    for i, k in enumerate("abc"):
        st.put(k, make_blob(BLOB, i + 1))
    st.get("a")
    st.refresh()
    st.put("d", make_blob(BLOB, 4))
    assert st.keys() == ["a", "c", "d"]


def test_read_after_limit_persists(tmp_path: Path) -> None:
    """A file whose mtime is older than the limit gets the read's stamp (another process sees it)."""
    st = DirectoryStore(tmp_path, fsync=False)
    st.put("a", make_blob(BLOB, 1))
    os.utime(tmp_path / "a", ns=(OLD_NS, OLD_NS))
    st.get_parsed("a")
    now = _mtime(tmp_path / "a")
    assert now > OLD_NS and now == st._index.get("a").disk == st._index.get("a").stamp
    st.get("a")  # fresh again: within the limit, left alone
    assert _mtime(tmp_path / "a") == now


def test_zero_limit_persists_every_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_mod, "RECENCY_PERSIST_S", 0.0)
    st = DirectoryStore(tmp_path, fsync=False)
    st.put("a", make_blob(BLOB, 1))
    before = _mtime(tmp_path / "a")
    st.get("a")
    assert _mtime(tmp_path / "a") > before


def test_evictor_keeps_a_group_another_process_touched(tmp_path: Path) -> None:
    """The evictor compares a file's mtime with what this instance last saw on disk (earlier than its
    in-memory recency after an unpersisted read): a file another process used since is kept."""
    size = len(make_blob(BLOB, 0))
    one = DirectoryStore(tmp_path, max_bytes=3 * size, rescan_interval_s=3600, fsync=False)
    for i, k in enumerate("abc"):
        one.put(k, make_blob(BLOB, i + 1))
    for k in "abc":  # unpersisted reads: in memory each is later than its file's mtime
        one.get(k)
    a = one._index.get("a")
    assert list(one._index.entries) == ["a", "b", "c"] and a.disk == _mtime(tmp_path / "a") < a.stamp
    touched = one._index.get("c").stamp + 1  # another process persisted its use of a, after our reads
    os.utime(tmp_path / "a", ns=(touched, touched))
    one.put("d", make_blob(BLOB, 4))  # a is the LRU in memory, but its file moved: kept, b goes
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["a", "c", "d"]
    assert list(one._index.entries) == ["c", "a", "d"]  # a re-stamped as of that use
    assert one._index.get("a").disk == one._index.get("a").stamp == touched
    assert DirectoryStore(tmp_path, fsync=False).keys() == ["a", "c", "d"]


def test_evictor_removes_a_file_used_only_before_this_instances_read(tmp_path: Path) -> None:
    """A use by another process between the mtime this instance saw and its own later read: the file
    is re-examined (its ``disk`` updated) but stays as recent as that read, so LRU still removes it."""
    size = len(make_blob(BLOB, 0))
    one = DirectoryStore(tmp_path, max_bytes=3 * size, rescan_interval_s=3600, fsync=False)
    for i, k in enumerate("abc"):
        one.put(k, make_blob(BLOB, i + 1))
    for k in "abc":
        one.get(k)
    a = one._index.get("a")
    touched = a.disk + 1
    assert touched < a.stamp
    os.utime(tmp_path / "a", ns=(touched, touched))
    one.put("d", make_blob(BLOB, 4))
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["b", "c", "d"]
