"""Outages of a real redis-server / cluster node: every call raises StoreUnavailableError, one WARNING
per outage, one INFO when it is back, and the same store object works again after a restart on the
same port. A server that accepts but never answers is a STORE_TIMEOUT."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcodec.errors import Reason, StoreUnavailableError
from kvcodec.integrations.vllm.chunk_keys import group_of
from kvcodec.store import StoreOptions, open_store, redis_outage
from tests.raises import raises_reason
from tests.redis_servers import chunk_keys, free_port, make_blob, redis_cluster, redis_missing, redis_single

pytestmark = pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))


@pytest.fixture(autouse=True)
def probe_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check each call's own failure: every call is a probe (no fail-fast window)."""
    monkeypatch.setattr(redis_outage, "PROBE_INTERVAL_S", 0.0)


LOGGER = "kvcodec.store.redis"
OPTS = StoreOptions(group_of=group_of, timeout_s=2.0)
"""A timeout generous for a busy test machine: a dead server refuses connections, which fails at
once whatever the timeout (the silent server's test uses a short one)."""


def every_call(st: Any, keys: list[str]) -> list[Callable[[], Any]]:
    blob = make_blob(256, 1)
    return [
        lambda: st.put(keys[0], blob),
        lambda: st.put_many([(k, blob) for k in keys]),
        lambda: st.get(keys[0]),
        lambda: st.get_parsed(keys[0]),
        lambda: st.get_parsed_many(keys),
        lambda: st.contains(keys[0]),
        lambda: st.contains_many(keys),
        lambda: st.delete(keys[0]),
        lambda: st.keys(),
        lambda: list(st.iter_keys()),
    ]


def records(caplog, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_a_killed_server_fails_every_call_and_a_restart_serves_the_same_store(tmp_path: Path, caplog) -> None:
    keys = chunk_keys(layers=3, chunk=0)
    blobs = [make_blob(512, i) for i in range(len(keys))]
    with redis_single(tmp_path) as srv, open_store(srv.url, OPTS) as st, caplog.at_level(logging.INFO):
        st.put_many(list(zip(keys, blobs)))
        srv.kill()
        for call in every_call(st, keys):
            with raises_reason(StoreUnavailableError, Reason.STORE_UNAVAILABLE):
                call()
        assert len(records(caplog, logging.WARNING)) == 1 and not records(caplog, logging.INFO)
        assert st.stats()["errors"] == len(every_call(st, keys))
        srv.start()  # same port, empty (no persistence)
        assert st.contains_many(keys) == [False] * len(keys)
        st.put_many(list(zip(keys, blobs)))
        assert [bytes(p.blob) for p in st.get_parsed_many(keys)] == blobs
        assert len(records(caplog, logging.INFO)) == 1
        srv.kill()  # a second outage warns again, once
        for call in every_call(st, keys)[:3]:
            with pytest.raises(StoreUnavailableError):
                call()
        assert len(records(caplog, logging.WARNING)) == 2
        st.close()  # during an outage: returns, later calls refused


def test_a_store_opened_while_the_server_is_down_connects_when_it_is_up(tmp_path: Path) -> None:
    with redis_single(tmp_path) as srv:
        srv.kill()
        with open_store(srv.url, OPTS) as st:
            with raises_reason(StoreUnavailableError, Reason.STORE_UNAVAILABLE):
                st.contains("k")
            srv.start()
            st.put("k", make_blob(64, 0))
            assert st.contains("k")


def test_a_server_that_never_answers_is_a_timeout(caplog) -> None:
    port = free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen(16)  # connections complete in the backlog; nothing ever replies
        silent = StoreOptions(timeout_s=0.2)
        with open_store(f"redis://127.0.0.1:{port}/0", silent) as st, caplog.at_level(logging.WARNING):
            for call in every_call(st, chunk_keys(layers=1, chunk=0))[:4]:
                with raises_reason(StoreUnavailableError, Reason.STORE_TIMEOUT):
                    call()
            assert st.stats()["timeouts"] == 4 and st.stats()["errors"] == 0
            assert len(records(caplog, logging.WARNING)) == 1


def test_a_killed_cluster_node_fails_its_chunks_only_and_rejoins(tmp_path: Path, caplog) -> None:
    with redis_cluster(tmp_path) as cl, open_store(cl.url, OPTS) as st, caplog.at_level(logging.INFO):
        chunks = [chunk_keys(layers=2, chunk=c) for c in range(12)]
        blob = make_blob(256, 3)
        for keys in chunks:
            st.put_many([(k, blob) for k in keys])
        victim = cl.node_of(st.name_of(chunks[0][0]))
        lost = [k for k in chunks if cl.node_of(st.name_of(k[0])) is victim]
        kept = [k for k in chunks if cl.node_of(st.name_of(k[0])) is not victim]
        assert lost and kept
        victim.kill()
        for _ in range(2):  # calls to the dead node and to live ones, interleaved: still one outage
            for keys in lost:
                with raises_reason(StoreUnavailableError, Reason.STORE_UNAVAILABLE):
                    st.get_parsed_many(keys)
                assert len(st.get_parsed_many(kept[0])) == len(kept[0])
            for keys in kept:
                assert len(st.get_parsed_many(keys)) == len(keys)
        assert len(records(caplog, logging.WARNING)) == 1 and not records(caplog, logging.INFO)
        cl.restart(victim)
        for keys in lost:
            assert st.contains_many(keys) == [False] * len(keys)  # the node came back empty
            st.put_many([(k, blob) for k in keys])
            assert len(st.get_parsed_many(keys)) == len(keys)
        assert len(records(caplog, logging.INFO)) == 1
