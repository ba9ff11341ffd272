"""open_store: a path or file:// URL opens a DirectoryStore configured by StoreOptions; bad specs are
refused with a reason; parser reasons survive the store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcodec.errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from kvcodec.integrations.vllm.chunk_keys import group_of
from kvcodec.store import DirectoryStore, GroupLRU, StoreFullError, StoreOptions, open_store
from tests.raises import raises_reason
from tests.store.contract import chunk_blob_keys, crc_damaged
from tests.store.test_store import make_blob


@pytest.mark.parametrize("spec", ["path", "pathlike", "file_url"])
def test_a_path_opens_a_directory_store(tmp_path: Path, spec: str) -> None:
    root = tmp_path / "s"
    given = {"path": str(root), "pathlike": root, "file_url": f"file://{root}"}[spec]
    with open_store(given) as st:
        assert isinstance(st, DirectoryStore)
        assert st.location == st.root == str(root)
        assert st.max_bytes is None


def test_options_configure_the_directory_store(tmp_path: Path) -> None:
    opts = StoreOptions(max_bytes=1 << 20, fsync=True, group_of=group_of, verify_blobs=False)
    st = open_store(tmp_path, opts)
    assert isinstance(st, DirectoryStore) and st.max_bytes == 1 << 20
    assert isinstance(st.eviction, GroupLRU) and st.eviction.group_of is group_of
    assert st.eviction.first is None
    assert "verify=False" in repr(st) and "fsync=True" in repr(st)
    bad = crc_damaged(make_blob(1024, 1, version=2))
    (tmp_path / "k").write_bytes(bad)
    assert bytes(st.get("k")) == bad  # verify_blobs=False: get skips the CRC ...
    with raises_reason(CorruptEncodedKVError, Reason.CRC_MISMATCH):
        st.get_parsed("k")  # ... get_parsed never does


@pytest.mark.parametrize(
    ("spec", "reason"),
    [("", Reason.BAD_VALUE), ("ftp://host/x", Reason.BAD_VALUE), ("file://elsewhere/x", Reason.BAD_VALUE)],
)
def test_bad_specs_are_refused(spec: str, reason: Reason) -> None:
    with raises_reason(UnsupportedConfigError, reason):
        open_store(spec)


def test_options_must_be_store_options(tmp_path: Path) -> None:
    with raises_reason(UnsupportedConfigError, Reason.BAD_TYPE):
        open_store(tmp_path, {"max_bytes": 10})  # type: ignore[arg-type]


def test_opening_a_directory_imports_no_redis_client() -> None:
    code = (
        "import sys, tempfile; from kvcodec.store import open_store; "
        "open_store(tempfile.mkdtemp()).close(); "
        "print('redis' in sys.modules, 'kvcodec.store.redis' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["False", "False"]


def test_a_crc_failure_stays_crc_mismatch_through_the_store(tmp_path: Path) -> None:
    st = open_store(tmp_path)
    bad = crc_damaged(make_blob(2048, 2, version=2))
    with raises_reason(CorruptEncodedKVError, Reason.CRC_MISMATCH):
        st.put("k", bad)
    for read in (st.get, st.get_parsed):
        (tmp_path / "k").write_bytes(bad)
        with raises_reason(CorruptEncodedKVError, Reason.CRC_MISMATCH) as info:
            read("k")
        assert "'k'" in str(info.value) and "moved to" in str(info.value)


def test_store_full_carries_its_reason(tmp_path: Path) -> None:
    blob = make_blob(2048, 3, version=2)
    with raises_reason(StoreFullError, Reason.STORE_FULL):
        open_store(tmp_path, StoreOptions(max_bytes=len(blob) // 2)).put("k", blob)


def test_construction_errors_carry_reasons(tmp_path: Path) -> None:
    with raises_reason(UnsupportedConfigError, Reason.BAD_TYPE):
        DirectoryStore(tmp_path, max_bytes=1.5)  # type: ignore[arg-type]
    with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE):
        DirectoryStore(tmp_path, max_bytes=0)
    with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE):
        DirectoryStore(tmp_path, group_of=group_of, eviction=GroupLRU())
    with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE):
        DirectoryStore(tmp_path, verify=False).put("k", b"")
    with raises_reason(CorruptEncodedKVError, Reason.TRUNCATED_HEADER):
        DirectoryStore(tmp_path).put("k", b"")


def test_evict_first_removes_a_groups_manifest_before_its_blobs(tmp_path: Path) -> None:
    """With the connector's manifests first, a group's manifest is unlinked before any of its blobs."""
    keys = chunk_blob_keys(layers=3, chunk=0)
    manifest = keys[-1]
    blob = make_blob(2048, 5, version=2)
    opts = StoreOptions(
        max_bytes=len(blob) * len(keys), group_of=group_of, evict_first=lambda k: k == manifest
    )
    st = open_store(tmp_path, opts)
    st.put_many([(k, blob) for k in keys])
    renames: list[str] = []
    real_rename = os.rename

    def watch_rename(src: str, dst: str) -> None:
        renames.append(os.path.basename(src))
        real_rename(src, dst)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "rename", watch_rename)
        st.put("other", blob)  # makes room by evicting chunk 0, renamed aside member by member
    assert [r for r in renames if r in keys] == [manifest, *sorted(keys[:-1])]
    assert st.keys() == ["other"]


@pytest.mark.parametrize(
    "spec", ["redis-cluster://u:Tr0ub4dor@h:1", "http://Tr0ub4dor@h/x", "file://u:Tr0ub4dor@remote/x"]
)
def test_a_refused_url_never_shows_its_password(spec: str) -> None:
    with pytest.raises(UnsupportedConfigError) as info:
        open_store(spec)
    assert "Tr0ub4dor" not in str(info.value)
