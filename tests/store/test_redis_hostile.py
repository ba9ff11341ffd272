"""RedisStore under hostile contents and hostile servers (issue 34), against real redis-servers on
127.0.0.1: reads bounded by the blob the reader expects (planted oversized values cost at most that),
a value of another Redis type is damage (removed, counted, a miss next time), a read-only replica is a
configuration error said once, a timeout that cannot be a socket's is refused at open, a server that
answers with reply types its commands never give is a typed error, and a silent cluster node stalls
one lookup of many chunks for about one timeout."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcodec.errors import CorruptEncodedKVError, Reason, StoreUnavailableError, UnsupportedConfigError
from kvcodec.integrations.vllm.chunk_keys import group_of
from kvcodec.store import StoreOptions, open_store, redis_outage
from tests.raises import raises_reason
from tests.redis_servers import (
    RedisServer,
    chunk_keys,
    free_port,
    make_blob,
    redis_cluster,
    redis_missing,
    redis_single,
)

pytestmark = pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))

LOGGER = "kvcodec.store.redis"
OPTS = StoreOptions(group_of=group_of, timeout_s=2.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_single(tmp_path_factory.mktemp("redis")) as srv:
        yield srv


@pytest.fixture
def store(server: RedisServer) -> Iterator[object]:
    with server.client() as c:
        c.flushall()
    with open_store(server.url, OPTS) as st:
        yield st


def _records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


# --------------------------------------------------------------------------- bounded reads


def test_planted_oversized_values_cost_at_most_the_expected_blobs(server: RedisServer, store) -> None:
    """Twelve 8 MiB values under one chunk's names: a read that expects 1 KiB blobs holds about that."""
    keys = chunk_keys(layers=12, chunk=0)
    blob = make_blob(512, 1)
    store.put_many([(k, blob) for k in keys])
    junk = os.urandom(8 << 20)
    with server.client() as c:
        for key in keys[:-1]:
            c.set(store.name_of(key), junk)
    tracemalloc.start()
    try:
        with raises_reason(CorruptEncodedKVError, Reason.SIZE_MISMATCH):
            store.get_parsed_many(keys, max_bytes=len(blob))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak} bytes for 12 planted 8 MiB values"
    assert store.stats()["bytes_read"] < 64 << 10
    assert store.contains_many(keys) == [False] * 12 + [True]  # every oversized value was removed


def test_a_read_that_expects_the_blob_size_accepts_it_and_its_envelope(server: RedisServer) -> None:
    key = chunk_keys(layers=1, chunk=0)[0]
    blob = make_blob(512, 2)
    keyed = StoreOptions(group_of=group_of, timeout_s=2.0, fleet_key=b"k" * 16, key_prefix="mac")
    for opts in (OPTS, keyed):
        with open_store(server.url, opts) as st:
            st.put(key, blob)
            assert bytes(st.get_parsed_many([key], max_bytes=len(blob))[0].blob) == blob
            assert bytes(st.get(key, max_bytes=len(blob))) == blob
            assert bytes(st.get_parsed(key, max_bytes=len(blob)).blob) == blob
            with raises_reason(CorruptEncodedKVError, Reason.SIZE_MISMATCH):
                st.get_parsed(key, max_bytes=len(blob) - 1)
            with pytest.raises(KeyError):
                st.get(key)


def test_max_bytes_must_be_a_positive_int(store) -> None:
    for bad in (0, -1, 1.5, True, "8"):
        with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE):
            store.get_parsed_many(["k"], max_bytes=bad)


def test_an_empty_value_is_damage_not_a_hit_for_ever(server: RedisServer, store) -> None:
    key = chunk_keys(layers=1, chunk=0)[0]
    with server.client() as c:
        c.set(store.name_of(key), b"")
    assert store.contains(key)
    with raises_reason(CorruptEncodedKVError, Reason.TRUNCATED_HEADER):
        store.get_parsed_many([key])
    assert not store.contains(key)


# --------------------------------------------------------------------------- wrong types, replicas


def test_a_key_of_another_type_is_damage_removed_and_counted(server: RedisServer, store, caplog) -> None:
    keys = chunk_keys(layers=2, chunk=0)
    store.put_many([(k, make_blob(256, i)) for i, k in enumerate(keys)])
    with server.client() as c:
        c.delete(store.name_of(keys[0]))
        c.rpush(store.name_of(keys[0]), b"x")
        c.delete(store.name_of(keys[1]))
        c.hset(store.name_of(keys[1]), "f", b"x")
    errors = store.stats()["errors"]
    with caplog.at_level(logging.INFO):
        with raises_reason(CorruptEncodedKVError, Reason.WRONG_TYPE):
            store.get_parsed_many(keys)
        assert store.stats()["errors"] == errors + 2  # both counted, both removed in one pipeline
        assert store.contains_many(keys) == [False, False, True]
        with server.client() as c:
            c.sadd(store.name_of(keys[1]), b"x")
        with raises_reason(CorruptEncodedKVError, Reason.WRONG_TYPE):
            store.get(keys[1])
    assert store.stats()["errors"] == errors + 3
    assert store.contains_many(keys) == [False, False, True]
    with pytest.raises(KeyError):
        store.get_parsed_many(keys)
    assert not _records(caplog, logging.WARNING)  # no outage


def test_a_read_only_replica_is_a_config_error_said_once(server: RedisServer, tmp_path: Path, caplog) -> None:
    key = chunk_keys(layers=1, chunk=0)[0]
    blob = make_blob(256, 1)
    with open_store(server.url, OPTS) as primary:
        primary.put(key, blob)
    replica_of = ["--replicaof", "127.0.0.1", str(server.port)]
    with redis_single(tmp_path, replica_of) as replica, caplog.at_level(logging.INFO):
        with open_store(replica.url, OPTS) as st:
            for _ in range(3):
                with raises_reason(UnsupportedConfigError, Reason.STORE_READONLY):
                    st.put(key, blob)
            assert st.contains(key) in (True, False)  # reads still served: no outage recorded
            assert st.stats()["errors"] == 3
        assert len(_records(caplog, logging.ERROR)) == 1
        assert not _records(caplog, logging.WARNING) and not _records(caplog, logging.INFO)


# --------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize("timeout", [float("inf"), 1e300, 1e20, float("nan"), 0, -1, True, "1"])
def test_a_timeout_no_socket_can_take_is_refused_at_open(server: RedisServer, timeout: object) -> None:
    with raises_reason(UnsupportedConfigError, Reason.BAD_VALUE):
        open_store(server.url, StoreOptions(timeout_s=timeout))  # type: ignore[arg-type]


def test_the_longest_timeout_allowed_works(store, server: RedisServer) -> None:
    from kvcodec.store.redis import MAX_TIMEOUT_S

    with open_store(server.url, StoreOptions(timeout_s=MAX_TIMEOUT_S)) as st:
        st.put("k", make_blob(64, 0))
        assert st.contains("k")


# --------------------------------------------------------------------------- hostile replies


_ODD_REPLIES = {
    b"GET": b"*1\r\n:1\r\n",
    b"GETRANGE": b"*1\r\n:1\r\n",
    b"EXISTS": b"*2\r\n:1\r\n:1\r\n",
    b"SCAN": b":5\r\n",
    b"INFO": b"$18\r\ncluster_enabled:0\r\n",
}


class _OddServer:
    """A TCP server on 127.0.0.1 that speaks RESP but answers GET/GETRANGE with an array, EXISTS and
    SCAN with an integer (what no Redis does), INFO as a single server, anything else +OK."""

    def __init__(self) -> None:
        self.port = free_port()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as f:
            while True:
                head = f.readline()
                if not head.startswith(b"*"):
                    return
                args = []
                for _ in range(int(head[1:])):
                    n = int(f.readline()[1:])
                    args.append(f.read(n + 2)[:-2])
                conn.sendall(_ODD_REPLIES.get(args[0].upper(), b"+OK\r\n"))

    def close(self) -> None:
        self.sock.close()


def test_reply_types_no_redis_gives_are_a_typed_error() -> None:
    odd = _OddServer()
    try:
        with open_store(f"redis://127.0.0.1:{odd.port}/0", OPTS) as st:
            calls = [
                lambda: st.get("k"),
                lambda: st.get_parsed_many(["k", "j"]),
                lambda: st.keys(),
                lambda: st.contains_many(["k"]),
            ]
            for call in calls:
                with raises_reason(StoreUnavailableError, Reason.STORE_PROTOCOL):
                    call()
    finally:
        odd.close()


# --------------------------------------------------------------------------- a silent cluster node


def test_a_silent_cluster_node_stalls_one_lookup_of_many_chunks_for_one_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """128 chunks' keys in one lookup, a third of their slots on a SIGSTOPped node: one read times out
    (redis-py's cluster pipeline resent each of that node's commands on a fresh connection, each a
    timeout: ~80 here), then the next lookup fails fast with no read at all. Reads that time out are
    counted, not clocked: the wall time of this stall is a benchmark's business."""
    monkeypatch.setattr(redis_outage, "PROBE_INTERVAL_S", 60.0)
    timed_out = _count_timed_out_reads(monkeypatch)
    opts = StoreOptions(group_of=group_of, timeout_s=0.5)
    with redis_cluster(tmp_path) as cl, open_store(cl.url, opts) as st:
        keys = [k for c in range(128) for k in chunk_keys(layers=1, chunk=c)]
        assert st.contains_many(keys) == [False] * len(keys)  # every node's connection is open
        victim = cl.node_of(st.name_of(keys[0]))
        assert victim.proc is not None
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            with raises_reason(StoreUnavailableError, Reason.STORE_TIMEOUT):
                st.contains_many(keys)
            assert len(timed_out) == 1, f"{len(timed_out)} reads timed out in one lookup"
            with raises_reason(StoreUnavailableError, Reason.STORE_UNAVAILABLE):
                st.contains_many(keys)  # fails fast: the node is down
            assert len(timed_out) == 1, "the lookup after the timeout waited on the silent node again"
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        assert st.stats()["timeouts"] == 1
        monkeypatch.setattr(redis_outage, "PROBE_INTERVAL_S", 0.0)
        assert st.contains_many(keys) == [False] * len(keys)  # the probe answered


def _count_timed_out_reads(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """A list that gets one entry per read that times out: a reply on redis-py's connections, or a
    pipeline's replies on the store's own socket (:mod:`kvcodec.store.redis_wire`)."""
    import redis

    from kvcodec.store import redis_wire

    timed_out: list[object] = []

    def counting(read):
        def counted(self, *args, **kwargs):
            try:
                return read(self, *args, **kwargs)
            except redis.exceptions.TimeoutError:
                timed_out.append(self)
                raise

        return counted

    conn = redis.connection.AbstractConnection
    monkeypatch.setattr(conn, "read_response", counting(conn.read_response))
    monkeypatch.setattr(redis_wire._Reader, "read", counting(redis_wire._Reader.read))
    return timed_out


def _move_slot(cl, name: str, to) -> None:
    """Move the slot of the Redis name ``name``, with its keys, to the node ``to`` (a resharding)."""
    src = cl.node_of(name)
    with src.client() as s, to.client() as d:
        slot = int(s.execute_command("CLUSTER", "KEYSLOT", name))
        src_id, dst_id = s.execute_command("CLUSTER", "MYID"), d.execute_command("CLUSTER", "MYID")
        d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        keys = s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        s.execute_command("MIGRATE", "127.0.0.1", to.port, "", 0, 5000, "KEYS", *keys)
    for node in cl.nodes:
        with node.client() as c:
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


def test_a_chunk_moved_to_another_node_is_still_read(tmp_path: Path) -> None:
    """A resharding after the store learnt the slot map: the old node answers MOVED, and the call
    goes through redis-py's cluster pipeline, which follows it."""
    with redis_cluster(tmp_path) as cl, open_store(cl.url, OPTS) as st:
        keys = chunk_keys(layers=3, chunk=5)
        blobs = [make_blob(197_000, i) for i in range(len(keys) - 1)] + [make_blob(256, 9)]  # heads + tails
        st.put_many(list(zip(keys, blobs)))
        assert st.contains_many(keys) == [True] * len(keys)
        name = st.name_of(keys[0])
        to = next(n for n in cl.nodes if n is not cl.node_of(name))
        _move_slot(cl, name, to)
        assert cl.node_of(name) is to
        assert [bytes(p.blob) for p in st.get_parsed_many(keys)] == blobs
        assert st.contains_many(keys) == [True] * len(keys)
        st.put_many(list(zip(keys, blobs)))
        assert st.keys() == sorted(keys)
