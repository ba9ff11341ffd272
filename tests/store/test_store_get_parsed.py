"""DirectoryStore.get_parsed: one read, one parse, the CRC always verified, damage quarantined."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcodec.errors import CorruptEncodedKVError, Reason
from kvcodec.format import ParsedBlob, check_crc, parse, payload_crc
from kvcodec.format.parser import clear_header_memo, header_memo_info
from kvcodec.store import DirectoryStore
from tests.store.test_store import make_blob


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip_payload":
        data[-5] ^= 0x10
    elif how == "flip_header_hash":  # inside the model_id string: v2's CRC covers it
        data[data.index(b"model-x") + 6] ^= 0x01
    elif how == "truncate":
        data = data[:-1]
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


DAMAGES = ["flip_payload", "flip_header_hash", "truncate", "empty"]


@pytest.mark.parametrize("verify", [True, False])
def test_same_blob_as_get_in_private_writable_memory(tmp_path: Path, verify: bool) -> None:
    st = DirectoryStore(tmp_path, verify=verify, fsync=False)
    blob = make_blob(50_000, 3, version=2)
    st.put("k", blob)
    p = st.get_parsed("k")
    assert isinstance(p, ParsedBlob)
    assert bytes(p.blob) == blob == bytes(st.get("k"))
    assert p.header == parse(blob).header and p.crc == parse(blob).crc
    assert not p.buffer.readonly
    p.buffer[-1] ^= 0xFF  # private memory: the file is untouched
    assert bytes(st.get_parsed("k").blob) == blob


@pytest.mark.parametrize("how", DAMAGES)
def test_damage_is_refused_and_quarantined_even_without_verify(tmp_path: Path, how: str) -> None:
    """``verify=False`` skips the CRC in ``get`` only: ``get_parsed`` always checks it."""
    st = DirectoryStore(tmp_path, verify=False, fsync=False)
    st.put(how, make_blob(20_000, 1, version=2, model="model-x"))
    damage(tmp_path / how, how)
    with pytest.raises(CorruptEncodedKVError) as ei:
        st.get_parsed(how)
    assert repr(how) in str(ei.value) and "moved to" in str(ei.value)
    assert not (tmp_path / how).exists()
    assert len(os.listdir(st.quarantine_dir)) == 1
    with pytest.raises(KeyError):
        st.get_parsed(how)


def test_misses_and_special_files(tmp_path: Path) -> None:
    st = DirectoryStore(tmp_path, fsync=False)
    with pytest.raises(KeyError):
        st.get_parsed("absent")
    st.put("real", make_blob(1000, 2))
    os.symlink(tmp_path / "real", tmp_path / "alias")
    with pytest.raises(KeyError):
        st.get_parsed("alias")
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(KeyError):
        st.get_parsed("pipe")


def test_reads_count_as_use_for_eviction(tmp_path: Path) -> None:
    """Like ``get``, ``get_parsed`` makes a blob the most recently used (it is evicted last)."""
    b = make_blob(10_000, 4)
    st = DirectoryStore(tmp_path, fsync=False, max_bytes=3 * len(b) + 10, rescan_interval_s=1e9)
    for k in ("a", "b", "c"):
        st.put(k, make_blob(10_000, ord(k)))
    st.get_parsed("a")
    st.put("d", make_blob(10_000, 9))
    assert st.keys() == ["a", "c", "d"]


@pytest.mark.parametrize("spare", [0, 10, 1, 5000])
def test_into_a_buffer_large_enough_or_else_a_new_one(tmp_path: Path, spare: int) -> None:
    """``into`` is read into when it holds the whole file (spare bytes after it are left alone); a
    smaller one is not touched and the blob gets its own memory."""
    st = DirectoryStore(tmp_path, fsync=False)
    blob = make_blob(30_000, 2, version=2)
    st.put("k", blob)
    fits = spare >= 1
    buf = bytearray(b"\xaa" * (len(blob) + spare if fits else len(blob) - 1))
    p = st.get_parsed("k", into=buf)
    assert bytes(p.blob) == blob and p.header == parse(blob).header
    assert (p.buffer.obj is buf) == fits
    if fits:
        assert bytes(buf[: len(blob)]) == blob and bytes(buf[len(blob) :]) == b"\xaa" * spare
    else:
        assert bytes(buf) == b"\xaa" * len(buf)


@pytest.mark.parametrize("how", DAMAGES)
def test_into_a_buffer_damage_is_still_refused(tmp_path: Path, how: str) -> None:
    st = DirectoryStore(tmp_path, verify=False, fsync=False)
    blob = make_blob(20_000, 1, version=2, model="model-x")
    st.put(how, blob)
    damage(tmp_path / how, how)
    with pytest.raises(CorruptEncodedKVError):
        st.get_parsed(how, into=bytearray(len(blob) + 64))
    assert not (tmp_path / how).exists()


# ------------------------------------------------------------ the CRC left to the caller


@pytest.mark.parametrize("many", [False, True])
def test_verify_crc_false_leaves_the_crc_to_the_caller(tmp_path: Path, many: bool) -> None:
    """A payload flip is handed over (the caller's own pass finds it); every other check still runs."""
    st = DirectoryStore(tmp_path, verify=False, fsync=False)
    blob = make_blob(20_000, 1, version=2, model="model-x")
    st.put("k", blob)
    damage(tmp_path / "k", "flip_payload")
    p = st.get_parsed_many(["k"], verify_crc=False)[0] if many else st.get_parsed("k", verify_crc=False)
    assert p.header == parse(blob).header and p.crc == parse(blob).crc
    with pytest.raises(CorruptEncodedKVError) as ei:
        check_crc(p.header, p.crc, payload_crc(p.header, p.crc_prefix, (p.payload,)))
    assert ei.value.reason == Reason.CRC_MISMATCH
    assert (tmp_path / "k").exists()  # not refused by the store: the caller removes it
    with pytest.raises(CorruptEncodedKVError):
        st.get_parsed("k")  # the default still checks (and quarantines)
    assert not (tmp_path / "k").exists()


@pytest.mark.parametrize("how", ["truncate", "empty"])
def test_verify_crc_false_still_refuses_a_bad_size(tmp_path: Path, how: str) -> None:
    st = DirectoryStore(tmp_path, verify=False, fsync=False)
    st.put(how, make_blob(20_000, 1, version=2))
    damage(tmp_path / how, how)
    with pytest.raises(CorruptEncodedKVError):
        st.get_parsed(how, verify_crc=False)
    assert not (tmp_path / how).exists()


def test_a_deferred_crc_blob_is_not_remembered_by_the_header_memo(tmp_path: Path) -> None:
    """Read without its CRC, a blob that then fails it must leave no header behind (nor one that passes:
    that path memoises nothing); a verified read of the same header does remember it."""
    st = DirectoryStore(tmp_path, verify=False, fsync=False)
    st.put("bad", make_blob(20_000, 1, version=2, model="model-x"))
    st.put("good", make_blob(20_000, 2, version=2, model="model-x"))
    damage(tmp_path / "bad", "flip_payload")
    clear_header_memo()
    try:
        p = st.get_parsed("bad", verify_crc=False)
        with pytest.raises(CorruptEncodedKVError):
            check_crc(p.header, p.crc, payload_crc(p.header, p.crc_prefix, (p.payload,)))
        st.get_parsed("good", verify_crc=False)
        assert header_memo_info().entries == 0
        st.get_parsed("good")
        assert header_memo_info().entries == 1
    finally:
        clear_header_memo()
