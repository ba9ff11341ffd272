"""A hit from Redis is read ahead (``BlobStore.read_ahead``) into buffers the loader lends and takes back.

The load tells the store its chunk reads before the first one; the bytes written into the cache are
those of a load without the hint; one round trip per chunk; the buffers the replies went into are
back in the loader's pool once the chunks are written. A real redis-server; no engine: the hooks
are called as vLLM's model runner calls them (``tests/.../workers.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs vLLM")

from kvcodec.integrations.vllm.connector import KvcodecConnector, KvcodecMetadata, LoadSpec, SaveSpec
from tests.integrations.vllm.workers import BLOCK_IDS, CHUNK, HASHES, cpu_worker
from tests.redis_servers import redis_missing, redis_single

LOAD_BLOCKS = [7, 6, 5, 2]


def _worker(url: str) -> KvcodecConnector:
    return cpu_worker(None, store=url)


def _load(conn: KvcodecConnector) -> set[int]:
    conn.bind_connector_metadata(KvcodecMetadata(loads=[LoadSpec("r", 0, 2 * CHUNK, HASHES, LOAD_BLOCKS)]))
    conn.start_load_kv(None)  # type: ignore[arg-type]  # a synchronous load: read, check, write here
    conn.clear_connector_metadata()
    return conn.get_block_ids_with_load_errors()


@pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))
def test_a_redis_hit_is_read_ahead_into_lent_buffers(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVCODEC_REDIS_READ_AHEAD", "on")  # a loopback server: not read ahead by default
    with redis_single(tmp_path / "redis") as srv:
        saver = _worker(srv.url)
        saves = [SaveSpec("w", c, HASHES[c], HASHES[c - 1] if c else None, BLOCK_IDS) for c in range(2)]
        saver.bind_connector_metadata(KvcodecMetadata(saves=saves))
        saver.wait_for_save()
        saver.clear_connector_metadata()
        assert saver.drain(60)
        saver.shutdown()

        hinted, plain = _worker(srv.url), _worker(srv.url)
        store = hinted.worker.loads.store  # type: ignore[union-attr]
        told: list[int] = []
        real = store.read_ahead
        monkeypatch.setattr(store, "read_ahead", lambda reads: (told.append(len(reads)), real(reads)))
        monkeypatch.setattr(plain.worker.loads.store, "read_ahead", lambda reads: None)  # type: ignore[union-attr]
        trips = store.stats()["round_trips"]
        assert _load(hinted) == set() and _load(plain) == set()
        assert told == [2, 0]  # both chunks told, then the hint dropped
        assert store.stats()["round_trips"] - trips == 2
        pool = hinted.worker.loads.buffers  # type: ignore[union-attr]
        assert pool.idle_bytes > 0 and pool.owns(pool.take())
        for n, c in hinted.worker.caches.caches.items():  # type: ignore[union-attr]
            assert torch.equal(c.view(torch.int16), plain.worker.caches.caches[n].view(torch.int16))
        assert hinted.stats["chunks_loaded"] == plain.stats["chunks_loaded"] == 2
        hinted.shutdown()
        plain.shutdown()
