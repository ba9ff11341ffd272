"""The BlobStore contract: tests any backend runs (DirectoryStore in test_contract_directory.py,
RedisStore in test_contract_redis.py).

A backend's test module subclasses :class:`BlobStoreContract` (as ``TestXxx``) and gives two fixtures:

* ``store_factory``: ``store_factory(options: StoreOptions | None = None) -> BlobStore``, a fresh,
  empty store each call (the fixture closes them at teardown);
* ``plant``: ``plant(store, key, data: bytes)`` stores ``data`` under ``key`` as the backend holds a
  blob, bypassing every check (a writer of damaged bytes), e.g. a file write or a raw SET.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvcodec.errors import CorruptEncodedKVError, Reason, UnsupportedConfigError
from kvcodec.format import ParsedBlob, parse
from kvcodec.integrations.vllm.chunk_keys import ChunkRef
from kvcodec.store import STORE_COUNTERS, BlobStore, GroupRead, InvalidKeyError
from tests.raises import raises_reason
from tests.redis_servers import connector_keys
from tests.store.test_store import make_blob

__all__ = ["BlobStoreContract", "chunk_blob_keys", "crc_damaged"]

BAD_KEYS = ("", ".hidden", "a/b", "../up", "x" * 201, "sp ace")


def chunk_blob_keys(layers: int, chunk: int = 0) -> list[str]:
    """One chunk's layer blobs and its manifest (last), as the connector names them."""
    keys: Any = connector_keys("0123456789abcdef")
    ref = ChunkRef(chunk, f"h{chunk:04d}", f"h{chunk - 1:04d}" if chunk else None)
    return [keys.blob(0, layer, ref) for layer in range(layers)] + [keys.manifest(ref)]


def crc_damaged(blob: bytes) -> bytes:
    """``blob`` with one payload bit flipped: it still parses, its CRC fails."""
    b = bytearray(blob)
    b[-1] ^= 0x40
    return bytes(b)


def blob(seed: int, nbytes: int = 2048) -> bytes:
    return make_blob(nbytes, seed, version=2)


class BlobStoreContract:
    """What every BlobStore does; see the module docstring for the fixtures a backend provides."""

    @pytest.fixture
    def store(self, store_factory: Callable[..., BlobStore]) -> BlobStore:
        return store_factory()

    # ----------------------------------------------------------------- the interface

    def test_is_a_blob_store(self, store: BlobStore) -> None:
        assert isinstance(store, BlobStore)
        assert isinstance(store.partial_groups, bool)
        assert isinstance(store.location, str) and store.location

    def test_put_then_get_round_trips(self, store: BlobStore) -> None:
        b = blob(1)
        store.put("k1", b)
        store.put("k2", bytearray(blob(2)))
        store.put("k3", memoryview(blob(3)))
        assert bytes(store.get("k1")) == b
        assert bytes(store.get("k2")) == blob(2) and bytes(store.get("k3")) == blob(3)

    def test_get_parsed_is_get_parsed_once(self, store: BlobStore) -> None:
        b = blob(4)
        store.put("k", b)
        parsed = store.get_parsed("k")
        assert isinstance(parsed, ParsedBlob)
        assert bytes(parsed.blob) == bytes(store.get("k")) == b
        assert parsed.header == parse(b).header
        buf = bytearray(len(b) + 100)
        again = store.get_parsed("k", into=buf)
        assert bytes(again.blob) == b

    def test_put_overwrites_and_readers_see_whole_blobs(self, store: BlobStore) -> None:
        a, b = blob(5), blob(6)
        store.put("k", a)
        store.put("k", b)
        assert bytes(store.get("k")) == b
        seen: list[bytes] = []
        done = threading.Event()

        def read() -> None:
            while not done.is_set():
                seen.append(bytes(store.get_parsed("k").blob))

        reader = threading.Thread(target=read)
        reader.start()
        try:
            for i in range(60):
                store.put("k", a if i % 2 else b)
        finally:
            done.set()
            reader.join()
        assert seen and set(seen) <= {a, b}

    def test_reads_take_the_largest_blob_the_caller_expects(self, store: BlobStore) -> None:
        """``max_bytes`` (issue 34): a blob up to it is read; a longer one is damage, refused before
        it is read and removed; the bound must be a positive int."""
        b = blob(11)
        store.put_many([("k1", b), ("k2", b)])
        assert bytes(store.get_parsed_many(["k1", "k2"], max_bytes=len(b))[1].blob) == b
        assert bytes(store.get("k1", max_bytes=len(b))) == b
        with raises_reason(CorruptEncodedKVError, Reason.SIZE_MISMATCH):
            store.get_parsed("k1", max_bytes=len(b) - 1)
        with pytest.raises(KeyError):
            store.get_parsed("k1")
        for bad in (0, -1, 2.0, True):
            with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE):
                store.get_parsed("k2", max_bytes=bad)  # type: ignore[arg-type]

    def test_a_miss_is_key_error_and_false(self, store: BlobStore) -> None:
        for read in (store.get, store.get_parsed):
            with pytest.raises(KeyError) as info:
                read("absent")
            assert info.value.args == ("absent",)
        assert store.contains("absent") is False
        assert store.delete("absent") is False

    def test_delete_removes(self, store: BlobStore) -> None:
        store.put("k", blob(7))
        assert store.contains("k") is True
        assert store.delete("k") is True
        assert store.contains("k") is False
        with pytest.raises(KeyError):
            store.get("k")

    def test_keys_and_iter_keys_list_what_is_stored(self, store: BlobStore) -> None:
        assert store.keys() == [] and list(store.iter_keys()) == []
        names = ["b-1", "a-2", "c-3"]
        for i, k in enumerate(names):
            store.put(k, blob(10 + i))
        assert store.keys() == sorted(names)
        assert sorted(store.iter_keys()) == sorted(names)

    def test_contains_many_answers_in_order(self, store: BlobStore) -> None:
        store.put("x", blob(20))
        store.put("z", blob(21))
        assert store.contains_many(["x", "y", "z", "x"]) == [True, False, True, True]
        assert store.contains_many([]) == []

    def test_put_many_stores_each(self, store: BlobStore) -> None:
        keys = chunk_blob_keys(layers=3)
        items = [(k, blob(30 + i)) for i, k in enumerate(keys)]
        store.put_many(items)
        assert [bytes(store.get(k)) for k in keys] == [b for _, b in items]
        store.put_many([])

    def test_get_parsed_many_is_all_or_nothing(self, store: BlobStore) -> None:
        keys = chunk_blob_keys(layers=3, chunk=1)
        blobs = [blob(40 + i) for i in range(len(keys))]
        store.put_many(list(zip(keys[:-1], blobs[:-1])))
        with pytest.raises(KeyError) as info:
            store.get_parsed_many(keys)
        assert info.value.args == (keys[-1],)
        store.put(keys[-1], blobs[-1])
        got = store.get_parsed_many(keys)
        assert [bytes(p.blob) for p in got] == blobs
        assert store.get_parsed_many([]) == []

    def test_a_read_ahead_changes_no_read(self, store: BlobStore, monkeypatch) -> None:
        """``read_ahead`` is a hint: reads after it, in its order or not, give what is stored; a
        group missing a key is still a KeyError; ``read_ahead([])`` ends it. (Redis on loopback
        reads ahead only when asked: asked here.)"""
        monkeypatch.setenv("KVCODEC_REDIS_READ_AHEAD", "on")
        groups = [chunk_blob_keys(layers=2, chunk=c) for c in range(3)]
        blobs = {k: blob(60 + i) for i, k in enumerate(k for g in groups for k in g)}
        store.put_many([(k, b) for k, b in blobs.items() if k != groups[1][0]])
        store.read_ahead([GroupRead(tuple(g), 1 << 20) for g in groups])
        assert [bytes(p.blob) for p in store.get_parsed_many(groups[0], max_bytes=1 << 20)] == [
            blobs[k] for k in groups[0]
        ]
        with pytest.raises(KeyError):
            store.get_parsed_many(groups[1], max_bytes=1 << 20)
        assert [bytes(p.blob) for p in store.get_parsed_many(groups[2])] == [blobs[k] for k in groups[2]]
        store.read_ahead([])

    # ----------------------------------------------------------------- damage and bad input

    @pytest.mark.parametrize("how", ["get", "get_parsed", "get_parsed_many"])
    def test_a_damaged_blob_keeps_its_reason_and_is_gone_after(
        self, store: BlobStore, plant: Callable[[BlobStore, str, bytes], None], how: str
    ) -> None:
        plant(store, "bad", crc_damaged(blob(50)))
        reads: dict[str, Callable[[], Any]] = {
            "get": lambda: store.get("bad"),
            "get_parsed": lambda: store.get_parsed("bad"),
            "get_parsed_many": lambda: store.get_parsed_many(["bad"]),
        }
        with raises_reason(CorruptEncodedKVError, Reason.CRC_MISMATCH):
            reads[how]()
        assert store.contains("bad") is False
        with pytest.raises(KeyError):
            store.get("bad")

    def test_a_damaged_member_fails_get_parsed_many(
        self, store: BlobStore, plant: Callable[[BlobStore, str, bytes], None]
    ) -> None:
        keys = chunk_blob_keys(layers=2, chunk=2)
        store.put_many([(k, blob(60 + i)) for i, k in enumerate(keys)])
        plant(store, keys[1], crc_damaged(blob(61)))
        with raises_reason(CorruptEncodedKVError, Reason.CRC_MISMATCH):
            store.get_parsed_many(keys)
        assert store.contains_many(keys) == [True, False, True]

    @pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
    def test_invalid_keys_are_refused(self, store: BlobStore, key: str) -> None:
        calls: list[Callable[[], Any]] = [
            lambda: store.put(key, blob(70)),
            lambda: store.put_many([("ok", blob(70)), (key, blob(71))]),
            lambda: store.get(key),
            lambda: store.get_parsed(key),
            lambda: store.get_parsed_many(["ok", key]),
            lambda: store.contains(key),
            lambda: store.contains_many(["ok", key]),
            lambda: store.delete(key),
        ]
        for call in calls:
            with raises_reason(InvalidKeyError, Reason.BAD_KEY):
                call()
        assert store.keys() == []  # put_many checked every key before storing any

    def test_a_non_str_key_is_refused(self, store: BlobStore) -> None:
        with raises_reason(InvalidKeyError, Reason.BAD_KEY):
            store.get(b"bytes-key")  # type: ignore[arg-type]

    # ----------------------------------------------------------------- counters and close

    def test_stats_has_exactly_the_store_counters(self, store: BlobStore) -> None:
        before = store.stats()
        assert tuple(before) == STORE_COUNTERS
        assert all(isinstance(v, (int, float)) and v >= 0 for v in before.values())
        b = blob(80)
        store.put("k", b)
        store.get_parsed("k")
        with pytest.raises(KeyError):
            store.get("absent")
        after = store.stats()
        assert tuple(after) == STORE_COUNTERS
        assert after["bytes_written"] - before["bytes_written"] >= len(b)
        assert after["bytes_read"] - before["bytes_read"] >= len(b)
        assert after["hits"] - before["hits"] >= 1 and after["misses"] - before["misses"] >= 1
        assert after["round_trips"] - before["round_trips"] >= 3

    def test_close_ends_the_store(self, store_factory: Callable[..., BlobStore]) -> None:
        st = store_factory()
        st.put("k", blob(90))
        st.close()
        with pytest.raises(UnsupportedConfigError):
            st.get("k")
        with pytest.raises(UnsupportedConfigError):
            st.put("k", blob(91))
