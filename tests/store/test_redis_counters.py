"""What the Redis store's ``hits``/``misses`` count (only the reads that return blobs, not ``contains``
lookups nor a writer's checks), and the ``verify_crc`` keyword of the BlobStore protocol (the CRC
checked, or left to the caller as every store leaves it) on a real redis-server (issue 27)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcodec.errors import CorruptEncodedKVError, Reason
from kvcodec.integrations.vllm.chunk_keys import group_of
from kvcodec.store import StoreOptions, open_store
from tests.raises import raises_reason
from tests.redis_servers import chunk_keys, make_blob, redis_missing, redis_single

pytestmark = pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))

OPTS = StoreOptions(group_of=group_of, timeout_s=2.0)


def test_hits_and_misses_count_blob_reads_only(tmp_path: Path) -> None:
    keys = chunk_keys(layers=2, chunk=0)
    with redis_single(tmp_path) as srv, open_store(srv.url, OPTS) as st:
        st.put(keys[0], make_blob(64, 0))
        assert st.contains_many(keys) == [True, False, False]
        assert st.contains(keys[0])
        assert (st.stats()["hits"], st.stats()["misses"]) == (0, 0)
        st.get_parsed(keys[0])
        st.get(keys[0])
        with pytest.raises(KeyError):
            st.get_parsed_many(keys)
        assert (st.stats()["hits"], st.stats()["misses"]) == (3, 2)


def test_verify_crc_false_leaves_the_crc_to_the_caller(tmp_path: Path) -> None:
    with redis_single(tmp_path) as srv, open_store(srv.url, OPTS) as st:
        blob = make_blob(64, 0)
        st.put("k", blob)
        assert bytes(st.get_parsed("k", None, verify_crc=False).blob) == blob
        assert [bytes(p.blob) for p in st.get_parsed_many(["k"], verify_crc=False)] == [blob]
        damaged = bytearray(blob)
        damaged[-1] ^= 0x40
        with srv.client() as c:
            c.set(st.name_of("k"), bytes(damaged))
        unchecked = st.get_parsed("k", verify_crc=False)  # the caller's check (the load's write pass)
        assert bytes(unchecked.blob) == bytes(damaged) and st.contains("k")
        with raises_reason(CorruptEncodedKVError, Reason.CRC_MISMATCH):
            st.get_parsed_many(["k"])  # checked: refused and deleted
        assert not st.contains("k")
