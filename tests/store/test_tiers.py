"""TieredStore (kvcodec/store/tiers.py): write-through, reads from the fastest tier with promotion,
damage never promoted, a remote tier's outage a miss there (a real redis-server killed by PID)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcodec.errors import CorruptEncodedKVError, Reason, StoreUnavailableError
from kvcodec.integrations.vllm.chunk_keys import group_of, is_manifest
from kvcodec.store import DirectoryStore, StoreOptions, open_store
from kvcodec.store.memory import MemoryStore
from kvcodec.store.tiers import Tier, TieredStore
from tests.raises import raises_reason
from tests.redis_servers import redis_missing, redis_single
from tests.store.contract import crc_damaged
from tests.store.test_contract_memory import prompt_chunk

OPTS = StoreOptions(group_of=group_of, evict_first=is_manifest, timeout_s=2.0)


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[TieredStore]:
    ram = MemoryStore(1 << 20, OPTS)
    disk = DirectoryStore.from_options(str(tmp_path / "disk"), OPTS)
    st = TieredStore([Tier("ram", ram), Tier("disk", disk)], OPTS)
    yield st
    st.close()


def _ram_disk(st: TieredStore) -> tuple[MemoryStore, DirectoryStore]:
    ram, disk = (t.store for t in st.tiers)
    return ram, disk  # type: ignore[return-value]


def test_writes_go_through_to_every_tier(tiers: TieredStore) -> None:
    items = prompt_chunk(0, 0)
    tiers.put_many(items)
    for t in tiers.tiers:
        assert t.store.contains_many([k for k, _ in items]) == [True] * len(items)


def test_a_read_below_promotes_the_chunk_with_its_manifest(tiers: TieredStore) -> None:
    ram, disk = _ram_disk(tiers)
    items = prompt_chunk(0, 0)
    disk.put_many(items)  # written by another process on this host: only on disk
    keys = [k for k, _ in items]
    assert tiers.contains_many(keys[-1:]) == [True]  # the lookup finds the manifest on disk
    got = tiers.get_parsed_many(keys[:-1], verify_crc=False)  # the load reads the layers' blobs
    assert [bytes(p.blob) for p in got] == [b for _, b in items[:-1]]
    assert ram.contains_many(keys) == [True] * len(keys)  # the whole chunk, manifest included
    tiers.get_parsed_many(keys[:-1])
    stats = tiers.tier_stats()
    assert stats["disk"]["served"] == 1 and stats["ram"]["served"] == 1
    assert stats["ram"]["promoted"] == len(keys)


def test_damage_on_top_is_served_from_below_and_replaced(tiers: TieredStore) -> None:
    ram, _ = _ram_disk(tiers)
    items = prompt_chunk(0, 0)
    tiers.put_many(items)
    key, good = items[1]
    ram._blobs[key] = crc_damaged(good)
    assert bytes(tiers.get(key)) == good
    assert bytes(ram.get(key)) == good  # the good copy promoted in its place
    assert tiers.tier_stats()["ram"]["damaged"] == 1


def test_damage_below_is_refused_and_never_promoted(tiers: TieredStore) -> None:
    ram, disk = _ram_disk(tiers)
    key, good = prompt_chunk(0, 0)[0]
    for read in (lambda: tiers.get(key), lambda: tiers.get_parsed_many([key], verify_crc=False)):
        (Path(disk.root) / key).write_bytes(crc_damaged(good))
        with raises_reason(CorruptEncodedKVError, Reason.CRC_MISMATCH):
            read()
        assert ram.contains(key) is False
    assert tiers.contains(key) is False  # the disk tier quarantined it


def test_the_ram_tier_holds_its_bound_over_a_stream_of_prompts(tmp_path: Path) -> None:
    one = sum(len(b) for _, b in prompt_chunk(0, 0))
    ram = MemoryStore(4 * one, OPTS)
    st = TieredStore([Tier("ram", ram), Tier("disk", DirectoryStore.from_options(str(tmp_path), OPTS))], OPTS)
    for p in range(20):
        for c in range(2):
            st.put_many(prompt_chunk(p, c))
            assert ram.total_bytes <= ram.max_bytes
    first = [k for k, _ in prompt_chunk(0, 0)]
    assert ram.contains_many(first) == [False] * len(first) and all(st.contains_many(first))
    st.close()


@pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))
def test_a_ram_tier_keeps_hitting_while_redis_is_down(tmp_path: Path) -> None:
    with redis_single(tmp_path) as server:
        remote = open_store(server.url, StoreOptions(group_of=group_of, timeout_s=0.5, key_prefix="tiers"))
        ram = MemoryStore(1 << 20, OPTS)
        st = TieredStore([Tier("ram", ram), Tier("remote", remote)], OPTS)
        hot, cold = prompt_chunk(0, 0), prompt_chunk(1, 0)
        st.put_many(hot)
        remote.put_many(cold)  # another host's chunk: only in Redis
        server.kill()
        keys = [k for k, _ in hot]
        assert st.contains_many(keys) == [True] * len(keys)
        assert [bytes(p.blob) for p in st.get_parsed_many(keys)] == [b for _, b in hot]
        assert st.contains_many([cold[-1][0]]) == [False]  # down: a miss, not an error
        with pytest.raises(StoreUnavailableError):
            st.get_parsed_many([k for k, _ in cold])
        st.put_many(prompt_chunk(2, 0))  # saved in RAM; Redis's refusal counted
        assert st.tier_stats()["remote"]["write_failures"] == 1
        assert st.tier_stats()["remote"]["unavailable"] >= 2
        server.start()  # back, empty (no persistence here): another host writes the chunk again
        remote.put_many(cold)
        assert [bytes(p.blob) for p in st.get_parsed_many([k for k, _ in cold])] == [b for _, b in cold]
        assert ram.contains_many([k for k, _ in cold]) == [True] * len(cold)  # promoted, manifest too
        st.close()
