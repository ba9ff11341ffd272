"""The connector's store tiers (kvcodec/integrations/vllm/store_tiers.py): what each config opens, the
RAM tier shared by one process's connectors, and a RAM tier that keeps hitting while Redis is down."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcodec.errors import Reason, UnsupportedConfigError
from kvcodec.integrations.vllm.chunk_keys import group_of, is_manifest
from kvcodec.integrations.vllm.config import KvcodecConfig
from kvcodec.integrations.vllm.store_tiers import _check_fleet_key as check_fleet_key
from kvcodec.integrations.vllm.store_tiers import open_tiers, stores_of
from kvcodec.store import DirectoryStore, StoreOptions
from kvcodec.store.tiers import TieredStore
from tests.raises import raises_reason
from tests.redis_servers import redis_missing, redis_single
from tests.store.test_contract_memory import prompt_chunk

OPTS = StoreOptions(group_of=group_of, evict_first=is_manifest, timeout_s=0.5)


def test_a_root_alone_is_the_directory_store(tmp_path: Path) -> None:
    st = open_tiers(KvcodecConfig(root=str(tmp_path)), OPTS)
    assert isinstance(st, DirectoryStore)
    st.close()


def test_host_cache_bytes_puts_one_shared_ram_tier_in_front(tmp_path: Path) -> None:
    cfg = KvcodecConfig(root=str(tmp_path), host_cache_bytes=1 << 20)
    sched, work = open_tiers(cfg, OPTS), open_tiers(cfg, OPTS)  # the scheduler's and the worker's
    assert isinstance(sched, TieredStore) and [t.name for t in sched.tiers] == ["ram", "disk"]
    chunk = prompt_chunk(0, 0)
    work.put_many(chunk)
    ram = stores_of(sched)[0]
    assert ram.contains_many([k for k, _ in chunk]) == [True] * len(chunk)  # the lookup's RAM sees it
    work.close()
    assert sched.get(chunk[0][0]) is not None  # the other connector's tier is still open
    sched.close()
    fresh = open_tiers(cfg, OPTS)  # the last close freed the tier: a new one starts empty
    assert stores_of(fresh)[0].keys() == [] and fresh.contains(chunk[0][0])  # the disk kept it
    fresh.close()


def test_a_fleet_key_is_taken_where_a_tier_seals_values(tmp_path: Path) -> None:
    """Decided by the store's ``seals_values`` (RedisStore), not by its class name: a directory alone
    refuses a fleet key file; the same directory in front of a Redis store takes it (no connection
    is made: the store connects on its first call)."""
    key = tmp_path / "fleet.key"
    key.write_text("k" * 32)
    alone = KvcodecConfig(root=str(tmp_path / "d"), fleet_key_file=str(key))
    with raises_reason(UnsupportedConfigError, Reason.UNSUPPORTED):
        check_fleet_key(open_tiers(alone, OPTS), alone, keyed=True)
    fronted = KvcodecConfig(root=str(tmp_path / "d"), store="redis://127.0.0.1:1/0", fleet_key_file=str(key))
    st = open_tiers(fronted, OPTS)
    assert [getattr(s, "seals_values", False) for s in stores_of(st)] == [False, True]
    check_fleet_key(st, fronted, keyed=True)
    st.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1GB"])
def test_host_cache_bytes_is_a_positive_int(tmp_path: Path, bad: object) -> None:
    with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE):
        KvcodecConfig.from_extra({"root": str(tmp_path), "host_cache_bytes": bad})


@pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))
def test_root_and_redis_make_ram_disk_remote_and_survive_an_outage(tmp_path: Path) -> None:
    with redis_single(tmp_path) as server:
        cfg = KvcodecConfig(root=str(tmp_path / "local"), store=server.url, host_cache_bytes=1 << 20)
        st = open_tiers(cfg, OPTS)
        assert isinstance(st, TieredStore) and [t.name for t in st.tiers] == ["ram", "disk", "remote"]
        chunk = prompt_chunk(0, 0)
        st.put_many(chunk)
        assert [t.store.contains(chunk[-1][0]) for t in st.tiers] == [True, True, True]
        server.kill()
        keys = [k for k, _ in chunk]
        assert st.contains_many(keys) == [True] * len(keys)
        assert [bytes(p.blob) for p in st.get_parsed_many(keys[:-1])] == [b for _, b in chunk[:-1]]
        assert st.tier_stats()["ram"]["served"] == 1
        st.close()


def test_the_worker_promotes_the_manifest_the_scheduler_found(tmp_path: Path) -> None:
    """Two connectors of one process: the scheduler-side one finds a chunk's manifest on disk, the
    worker-side one reads its blobs; the RAM tier then holds the whole chunk, so the next lookup hits there."""
    cfg = KvcodecConfig(root=str(tmp_path), host_cache_bytes=1 << 20)
    sched, work = open_tiers(cfg, OPTS), open_tiers(cfg, OPTS)
    chunk = prompt_chunk(0, 0)
    keys = [k for k, _ in chunk]
    stores_of(work)[1].put_many(chunk)  # on disk only (written before this process started)
    assert sched.contains_many(keys[-1:]) == [True]
    work.get_parsed_many(keys[:-1], verify_crc=False)
    assert stores_of(sched)[0].contains_many(keys) == [True] * len(keys)
    work.close()
    sched.close()


def test_each_tier_has_its_counters_in_the_connector_stats(tmp_path: Path) -> None:
    """``flat_stats``: the store's counters and each tier's as ``<tier>_<name>``, every one a counter
    the connector exports (``store_<name>``; Prometheus ``vllm:kvcodec_store_<tier>_<name>_total``)."""
    from kvcodec.integrations.vllm.counters import STORE_STATS, TIER_STATS
    from kvcodec.integrations.vllm.store_tiers import flat_stats

    st = open_tiers(KvcodecConfig(root=str(tmp_path), host_cache_bytes=1 << 20), OPTS)
    chunk = prompt_chunk(0, 0)
    st.put_many(chunk)
    st.get_parsed_many([k for k, _ in chunk])
    stats = flat_stats(st)
    assert {f"store_{k}" for k in stats} <= set(STORE_STATS) | set(TIER_STATS)
    assert stats["ram_served"] == 1 and stats["disk_served"] == 0 and stats["ram_hits"] == len(chunk)
    assert stats["hits"] == stats["ram_hits"] + stats["disk_hits"]
    st.close()
