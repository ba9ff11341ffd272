"""DirectoryStore eviction: whole chunk groups, prefix-aware order, and exact removal under races."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvcodec.store.evictor as evictor_mod
from kvcodec.errors import UnsupportedConfigError
from kvcodec.integrations.vllm.chunk_keys import group_of
from kvcodec.store import DirectoryStore, StoreFullError
from tests.paths import IMPORT_TESTS, REPO_ROOT
from tests.store.test_store import digest, make_blob

LAYERS = 2
BLOB = 4 << 10


def _hash(prefix: str, chunk: int) -> str:
    return f"{prefix}{chunk:02d}".ljust(8, "0")


def _keys(prefix: str, chunk: int) -> list[str]:
    """The connector's key shapes: one blob per layer and a chunk marker, bound to the predecessor."""
    tail = f"-C{chunk}-H{_hash(prefix, chunk)}" + (f"-P{_hash(prefix, chunk - 1)}" if chunk else "")
    return [f"m-L{layer}{tail}" for layer in range(LAYERS)] + [f"m-M{tail}"]


def _put_chunk(st: DirectoryStore, prefix: str, chunk: int) -> None:
    for i, key in enumerate(_keys(prefix, chunk)):
        st.put(key, make_blob(BLOB, 100 * chunk + i))


def _chunks(st: DirectoryStore) -> set[str]:
    """Chunk groups whose every file is present."""
    keys = set(st.keys())
    return {f"{p}{c}" for p in "abcz" for c in range(8) if all(k in keys for k in _keys(p, c))} | {
        g for g in keys if "-C" not in g
    }


def _group_bytes() -> int:
    return sum(len(make_blob(BLOB, i)) for i in range(LAYERS + 1))


def test_group_of_parses_the_connector_keys() -> None:
    assert group_of("m-L3-C2-Habc-Pdef") == ("C2-Habc", 2, "C1-Hdef")
    assert group_of("m-M-C0-Habc") == ("C0-Habc", 0, None)
    assert group_of("plain") == ("plain", 0, None)


def test_capped_store_keeps_a_prompts_leading_chunks(tmp_path: Path) -> None:
    st = DirectoryStore(tmp_path, max_bytes=2 * _group_bytes() + 100, group_of=group_of)
    _put_chunk(st, "a", 0)
    _put_chunk(st, "a", 1)
    with pytest.raises(StoreFullError, match="leading chunks") as e:
        _put_chunk(st, "a", 2)  # room only by evicting its own predecessors: refused
    assert isinstance(e.value, UnsupportedConfigError)
    assert _chunks(st) == {"a0", "a1"}
    assert not any(k.endswith(f"-C2-H{_hash('a', 2)}-P{_hash('a', 1)}") for k in st.keys())


def test_a_chunk_after_a_gap_never_displaces_a_servable_one(tmp_path: Path) -> None:
    st = DirectoryStore(tmp_path, max_bytes=2 * _group_bytes() + 100, group_of=group_of)
    _put_chunk(st, "a", 0)
    _put_chunk(st, "a", 1)
    with pytest.raises(StoreFullError):
        _put_chunk(st, "a", 3)  # a2 was never stored: a3 can never be hit
    assert _chunks(st) == {"a0", "a1"}


def test_deepest_chunk_of_the_least_recent_prefix_goes_first(tmp_path: Path) -> None:
    st = DirectoryStore(tmp_path, max_bytes=5 * _group_bytes() + 100, group_of=group_of)
    for c in range(3):
        _put_chunk(st, "a", c)
    for c in range(2):
        _put_chunk(st, "b", c)
    _put_chunk(st, "z", 0)  # needs one group: a's deepest (a2), a being older than b
    assert _chunks(st) == {"a0", "a1", "b0", "b1", "z0"}
    for key in _keys("a", 0) + _keys("a", 1):  # a hit on a's prefix makes it the recent one
        st.get(key)
    _put_chunk(st, "z", 1)  # now b is the least recent prefix: its deepest chunk goes
    assert _chunks(st) == {"a0", "a1", "b0", "z0", "z1"}


def test_chunks_after_a_missing_predecessor_go_first(tmp_path: Path) -> None:
    st = DirectoryStore(tmp_path, max_bytes=5 * _group_bytes() + 100, rescan_interval_s=0, group_of=group_of)
    for c in range(3):
        _put_chunk(st, "a", c)
    _put_chunk(st, "b", 0)
    st.get(_keys("a", 2)[0])  # recent, but its prefix is about to break
    for key in _keys("a", 0):
        os.unlink(tmp_path / key)  # chunk 0 gone (another process, a user)
    _put_chunk(st, "z", 0)
    _put_chunk(st, "z", 1)
    _put_chunk(st, "z", 2)  # a1 and a2 can never be hit again: the deeper one goes first
    assert _chunks(st) == {"a1", "b0", "z0", "z1", "z2"}
    _put_chunk(st, "z", 3)  # then a1, though b0 is older
    assert _chunks(st) == {"b0", "z0", "z1", "z2", "z3"}


def test_plain_keys_keep_lru_order(tmp_path: Path) -> None:
    size = len(make_blob(BLOB, 0))
    st = DirectoryStore(tmp_path, max_bytes=2 * size)
    st.put("x", make_blob(BLOB, 1))
    st.put("y", make_blob(BLOB, 2))
    st.get("x")
    st.put("w", make_blob(BLOB, 3))
    assert st.keys() == ["w", "x"]


# --------------------------------------------------------------------------- the eviction race

_PUT = """
import sys
from kvcodec.store import DirectoryStore
DirectoryStore(sys.argv[1], fsync=False).put(sys.argv[2], open(sys.argv[3], "rb").read())
"""


def _put_in_another_process(root: Path, key: str, blob_file: Path) -> None:
    subprocess.run(
        [sys.executable, "-c", _PUT, str(root), key, str(blob_file)], check=True, cwd=REPO_ROOT, timeout=120
    )


def test_eviction_never_deletes_a_blob_put_after_it_was_examined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process puts the victim's key between the evictor's look at the file and its removal:
    the new blob must survive (the old code unlinked the path it had looked at, whatever was there)."""
    root = tmp_path / "store"
    size = len(make_blob(BLOB, 0))
    st = DirectoryStore(root, max_bytes=2 * size, rescan_interval_s=3600, fsync=False)
    st.put("old", make_blob(BLOB, 1))
    st.put("mid", make_blob(BLOB, 2))
    fresh = make_blob(BLOB, 3)
    fresh_file = tmp_path / "fresh.blob"
    fresh_file.write_bytes(fresh)
    real_lstat = evictor_mod.lstat
    raced = []

    def lstat_then_race(path: str) -> os.stat_result | None:
        st_ = real_lstat(path)
        if os.path.basename(path) == "old" and not raced:
            raced.append(path)
            _put_in_another_process(root, "old", fresh_file)  # lands right after the evictor looked
        return st_

    monkeypatch.setattr(evictor_mod, "lstat", lstat_then_race)
    st.put("new", make_blob(BLOB, 4))
    assert raced, "the eviction did not examine the victim"
    assert (root / "old").exists(), "the other process's fresh blob was deleted by the eviction"
    assert digest((root / "old").read_bytes()) == digest(fresh)
    assert not [n for n in os.listdir(root) if n.startswith(".tmp.")]


_RACER = """
import sys
from kvcodec.store import DirectoryStore
from tests.store.test_store import make_blob
root, role, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
size = len(make_blob(4096, 0))
st = DirectoryStore(root, max_bytes=3 * size, rescan_interval_s=0, fsync=False)
for i in range(n):
    if role == "writer":
        blob = make_blob(4096, 1000 + i)
        st.put("hot", blob)
        try:  # evicted meanwhile (a miss) or this very blob, never another
            got = bytes(st.get("hot"))
        except KeyError:
            got = None
        if got is not None and got != bytes(blob):
            print("MIXED", i)
            sys.exit(2)
    else:
        st.put(f"cold-{role}-{i % 5}", make_blob(4096, i))
print("ok")
"""


def test_processes_racing_on_one_store_leave_whole_blobs(tmp_path: Path) -> None:
    """A writer and two evicting processes on one small store: every read returns a blob as written,
    nothing but CodecErrors or misses, and no temp file is left."""
    root = tmp_path / "store"
    root.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", IMPORT_TESTS + _RACER, str(root), role, "80"],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role in ("writer", "e1", "e2")
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, out + err
    st = DirectoryStore(root)
    for key in st.keys():
        st.get(key)  # verifies the CRC
    assert not [n for n in os.listdir(root) if n.startswith(".tmp.")]
