"""Reads sent ahead (``BlobStore.read_ahead``, :meth:`kvcodec.store.redis_wire.Wire.read_ahead`) and
reply buffers lent by the caller's pool, on a real redis-server.

A read-ahead changes when commands are sent, never what a read returns: each group read after it
gives the bytes stored, one round trip each; a read that differs, or a hint dropped half way, leaves
no reply behind for a later read; a window smaller than the groups still serves every group; a server
killed in between is an outage, not a hang. Lent buffers hold the replies and are reused once given
back; a TieredStore tells only its last tier the reads no faster tier can serve. On a cluster each
node is sent its own chunks ahead (its GETRANGE calls rise before any read)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvcodec.errors import StoreUnavailableError
from kvcodec.integrations.vllm.buffers import ReadBuffers
from kvcodec.integrations.vllm.chunk_keys import group_of
from kvcodec.store import GroupRead, StoreOptions, open_store, redis_wire
from kvcodec.store import redis as redis_store
from kvcodec.store.memory import MemoryStore
from kvcodec.store.tiers import Tier, TieredStore
from tests.redis_servers import chunk_keys, make_blob, redis_cluster, redis_missing, redis_single, wait_for

LAYERS, CHUNKS, MAX = 4, 5, 1 << 20
SIZES = [300, 196_000, 197_200, 787_300]
"""Whole values and values stored in two parts (head and tail)."""


@pytest.fixture(autouse=True)
def read_ahead_on(monkeypatch) -> None:
    """These servers are on loopback, where ``auto`` sends nothing ahead: the hint's tests ask for it."""
    monkeypatch.setenv("KVCODEC_REDIS_READ_AHEAD", "on")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator:
    if redis_missing() is not None:
        pytest.skip(str(redis_missing()))
    with redis_single(tmp_path_factory.mktemp("ahead")) as srv:
        yield srv


@pytest.fixture
def stored(server) -> Iterator[tuple]:
    """A store holding CHUNKS chunks of LAYERS blobs; the key groups and their blobs."""
    groups, blobs = [], {}
    with open_store(server.url, StoreOptions(key_prefix="ahead")) as s:
        for c in range(CHUNKS):
            keys = chunk_keys(layers=LAYERS - 1, chunk=c)
            for i, k in enumerate(keys):
                blobs[k] = make_blob(SIZES[i % len(SIZES)], 10 * c + i)
            s.put_many([(k, blobs[k]) for k in keys])
            groups.append(keys)
        yield s, groups, blobs


def _reads(groups: list[list[str]]) -> list[GroupRead]:
    return [GroupRead(tuple(g), MAX) for g in groups]


def _read(s, keys: list[str], **kw) -> list[bytes]:
    return [bytes(p.blob) for p in s.get_parsed_many(keys, max_bytes=MAX, **kw)]


def test_each_group_read_ahead_gives_the_stored_bytes_one_round_trip_each(stored) -> None:
    s, groups, blobs = stored
    before = s.stats()["round_trips"]
    s.read_ahead(_reads(groups))
    for g in groups:
        assert _read(s, g) == [blobs[k] for k in g]
    assert s.stats()["round_trips"] - before == len(groups)


def test_a_window_smaller_than_the_groups_serves_them_all(stored, monkeypatch) -> None:
    s, groups, blobs = stored
    monkeypatch.setattr(redis_wire, "READ_AHEAD_BYTES", 1)  # one group out at a time
    s.read_ahead(_reads(groups))
    for g in groups:
        assert _read(s, g) == [blobs[k] for k in g]


@pytest.mark.parametrize("how", ["another read", "dropped", "hint again"])
def test_replies_left_unread_never_reach_a_later_read(stored, how: str) -> None:
    s, groups, blobs = stored
    s.read_ahead(_reads(groups))
    assert _read(s, groups[0]) == [blobs[k] for k in groups[0]]
    if how == "another read":  # not what was sent ahead: the hint goes
        assert _read(s, groups[3]) == [blobs[k] for k in groups[3]]
    elif how == "dropped":
        s.read_ahead([])
    else:
        s.read_ahead(_reads(groups[2:]))
    for g in (groups[1], groups[2], groups[4]):
        assert _read(s, g) == [blobs[k] for k in g]


def test_a_server_killed_after_the_hint_is_an_outage_not_a_hang(server, stored) -> None:
    s, groups, _ = stored
    s.read_ahead(_reads(groups))
    server.kill()
    try:
        with pytest.raises(StoreUnavailableError):
            for g in groups:
                _read(s, g)
    finally:
        server.start()
    s.read_ahead([])


def test_replies_go_into_buffers_the_pool_lends_and_reuses(stored) -> None:
    s, groups, blobs = stored
    pool = ReadBuffers()
    got = s.get_parsed_many(groups[0], max_bytes=MAX, buffers=pool)
    lent = {id(p.buffer.obj): p.buffer.obj for p in got}
    assert len(lent) == 1 and all(pool.owns(b) for b in lent.values())
    assert [bytes(p.blob) for p in got] == [blobs[k] for k in groups[0]]
    del got
    pool.give(list(lent.values()))
    again = s.get_parsed_many(groups[1], max_bytes=MAX, buffers=pool)
    assert {id(p.buffer.obj) for p in again} == set(lent)  # the same memory, read into again
    assert [bytes(p.blob) for p in again] == [blobs[k] for k in groups[1]]


def test_a_pool_never_owns_what_it_did_not_lend() -> None:
    pool = ReadBuffers()
    assert not pool.owns(bytearray(10)) and not pool.owns(b"x")
    assert pool.owns(pool.lend(10)) and len(pool.lend(10)) >= 10


def test_a_tiered_store_tells_its_last_tier_only_what_no_faster_tier_holds(stored, monkeypatch) -> None:
    s, groups, blobs = stored
    ram = MemoryStore(64 << 20)
    ram.put_many([(k, blobs[k]) for k in groups[1]])
    told: list = []
    monkeypatch.setattr(s, "read_ahead", lambda reads: told.append([r.keys for r in reads]))
    tiered = TieredStore([Tier("ram", ram), Tier("remote", s)])
    tiered.read_ahead(_reads(groups[:3]))
    assert told == [[tuple(groups[0]), tuple(groups[2])]]


@pytest.mark.parametrize("mode", ["auto", "off", "unknown"])
def test_a_server_on_this_host_is_not_read_ahead_unless_asked(stored, server, monkeypatch, mode: str) -> None:
    s, groups, blobs = stored
    monkeypatch.setenv("KVCODEC_REDIS_READ_AHEAD", mode)
    before = _getranges(server)
    trips = s.stats()["round_trips"]
    s.read_ahead(_reads(groups))
    time.sleep(0.2)  # what a read-ahead would have sent is answered by now
    assert _getranges(server) == before
    for g in groups:
        assert _read(s, g) == [blobs[k] for k in g]
    assert s.stats()["round_trips"] - trips == len(groups)
    assert _getranges(server) == before + 2 * sum(map(len, groups))
    s.read_ahead([])


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_no_command_is_built_for_a_server_not_read_ahead_from(stored, monkeypatch, mode: str) -> None:
    """Under ``auto`` (once the loopback server was reached) and ``off`` a hint costs no command built:
    the connector tells the store every chunk of a hit; under ``on`` each key's commands are built."""
    s, groups, blobs = stored
    monkeypatch.setenv("KVCODEC_REDIS_READ_AHEAD", mode)
    assert _read(s, groups[0]) == [blobs[k] for k in groups[0]]
    built: list = []
    real = redis_store.read_commands
    monkeypatch.setattr(redis_store, "read_commands", lambda *a: built.append(a) or real(*a))
    s.read_ahead(_reads(groups))
    assert built == [] and not s.reads_ahead()
    monkeypatch.setenv("KVCODEC_REDIS_READ_AHEAD", "on")
    s.read_ahead(_reads(groups[:1]))
    assert len(built) == len(groups[0]) and s.reads_ahead()
    s.read_ahead([])


def test_read_ahead_on_sends_before_the_reads(stored, server) -> None:
    s, groups, _ = stored
    before = _getranges(server)
    s.read_ahead(_reads(groups[:1]))
    wait_for(lambda: _getranges(server) == before + 2 * len(groups[0]), 10, "the first chunk read ahead")
    s.read_ahead([])


# ---------------------------------------------------------------- a cluster: each node its own groups


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator:
    if redis_missing() is not None:
        pytest.skip(str(redis_missing()))
    with redis_cluster(tmp_path_factory.mktemp("ahead-cluster")) as cl:
        yield cl


def _getranges(node) -> int:
    with node.client() as c:
        return int(c.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0))


@pytest.mark.parametrize("grouped", [True, False], ids=["a chunk on one slot", "each key its own slot"])
def test_on_a_cluster_each_node_is_sent_its_own_chunks_ahead(cluster, monkeypatch, grouped: bool) -> None:
    monkeypatch.setattr(redis_wire, "READ_AHEAD_BYTES", 1 << 30)  # every group out at once
    opts = StoreOptions(key_prefix=f"ahead-{grouped}", group_of=group_of if grouped else None)
    with open_store(cluster.url, opts) as s:
        groups = [chunk_keys(layers=LAYERS - 1, chunk=c) for c in range(8)]
        blobs = {k: make_blob(SIZES[i % len(SIZES)], i) for g in groups for i, k in enumerate(g)}
        s.put_many([(k, blobs[k]) for g in groups for k in g])
        owner = {k: cluster.node_of(s.name_of(k)).port for g in groups for k in g}
        assert len(set(owner.values())) > 1  # the values lie on several nodes
        before = {n.port: _getranges(n) for n in cluster.nodes}
        s.read_ahead(_reads(groups))
        first = {p: before[p] + 2 * sum(owner[k] == p for k in groups[0]) for p in before}
        wait_for(  # before any read, each node answers what the first chunk asks of it (Redis paces the rest)
            lambda: all(_getranges(n) >= first[n.port] for n in cluster.nodes), 10, "nodes read ahead"
        )
        trips = s.stats()["round_trips"]
        for g in groups:
            assert _read(s, g) == [blobs[k] for k in g]
        ahead_trips = s.stats()["round_trips"] - trips
        assert {n.port: _getranges(n) for n in cluster.nodes} == {  # nothing was asked twice
            p: before[p] + 2 * sum(owner[k] == p for k in owner) for p in before
        }
        s.read_ahead([])
        trips = s.stats()["round_trips"]
        for g in groups:
            assert _read(s, g) == [blobs[k] for k in g]
        assert ahead_trips == s.stats()["round_trips"] - trips == (len(groups) if grouped else len(owner))
