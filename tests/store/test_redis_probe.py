"""A Redis server that is connected but silent (SIGSTOP): after the first timeout the store's calls
fail at once, without I/O, but for one probe per ``PROBE_INTERVAL_S``; the probe's answer ends the
outage (issue 27). The interval is set per phase (60 s: no probe can fall due; 0: the next call
probes), so nothing here depends on how fast the machine is."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest

from kvcodec.errors import Reason, StoreUnavailableError
from kvcodec.integrations.vllm.chunk_keys import group_of
from kvcodec.store import StoreOptions, open_store, redis_outage
from tests.raises import raises_reason
from tests.redis_servers import chunk_keys, make_blob, redis_cluster, redis_missing, redis_single
from tests.store.test_redis_outage import every_call, records

pytestmark = pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))

SILENT = StoreOptions(group_of=group_of, timeout_s=0.3)


def test_a_silent_server_costs_one_timeout_per_probe(tmp_path: Path, monkeypatch, caplog) -> None:
    keys = chunk_keys(layers=2, chunk=0)
    blob = make_blob(256, 1)
    monkeypatch.setattr(redis_outage, "PROBE_INTERVAL_S", 60.0)
    with redis_single(tmp_path) as srv, open_store(srv.url, SILENT) as st, caplog.at_level(logging.INFO):
        st.put_many([(k, blob) for k in keys])
        assert srv.proc is not None
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            with raises_reason(StoreUnavailableError, Reason.STORE_TIMEOUT):
                st.contains_many(keys)
            assert st.stats()["timeouts"] == 1
            calls = every_call(st, keys)
            for call in calls:  # inside the interval: refused at once, no I/O, no timeout
                with raises_reason(StoreUnavailableError, Reason.STORE_UNAVAILABLE):
                    call()
            assert st.stats()["timeouts"] == 1 and st.stats()["errors"] == len(calls)
            monkeypatch.setattr(redis_outage, "PROBE_INTERVAL_S", 0.0)
            with raises_reason(StoreUnavailableError, Reason.STORE_TIMEOUT):  # the probe, still silent
                st.get_parsed_many(keys)
            assert st.stats()["timeouts"] == 2
            assert len(records(caplog, logging.WARNING)) == 1 and not records(caplog, logging.INFO)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        monkeypatch.setattr(redis_outage, "PROBE_INTERVAL_S", 0.2)
        time.sleep(0.3)  # the next probe is due; the SCAN that follows it must not be refused
        assert st.keys() == sorted(keys)  # the probe (a SCAN) answered: the outage is over
        monkeypatch.setattr(redis_outage, "PROBE_INTERVAL_S", 60.0)
        assert [bytes(p.blob) for p in st.get_parsed_many(keys)] == [blob] * len(keys)
        assert len(records(caplog, logging.INFO)) == 1


def test_a_silent_cluster_node_fails_fast_for_its_chunks_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(redis_outage, "PROBE_INTERVAL_S", 60.0)
    with redis_cluster(tmp_path) as cl, open_store(cl.url, SILENT) as st:
        chunks = [chunk_keys(layers=2, chunk=c) for c in range(12)]
        blob = make_blob(256, 3)
        for keys in chunks:
            st.put_many([(k, blob) for k in keys])
        victim = cl.node_of(st.name_of(chunks[0][0]))
        lost = [k for k in chunks if cl.node_of(st.name_of(k[0])) is victim]
        kept = [k for k in chunks if cl.node_of(st.name_of(k[0])) is not victim]
        assert victim.proc is not None and lost and kept
        os.kill(victim.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(StoreUnavailableError):
                st.get_parsed_many(lost[0])
            timeouts = st.stats()["timeouts"]
            assert timeouts >= 1
            for keys in lost:  # the silent node's chunks: refused at once
                with raises_reason(StoreUnavailableError, Reason.STORE_UNAVAILABLE):
                    st.get_parsed_many(keys)
            for keys in kept:  # the other nodes serve
                assert len(st.get_parsed_many(keys)) == len(keys)
            assert st.stats()["timeouts"] == timeouts
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        monkeypatch.setattr(redis_outage, "PROBE_INTERVAL_S", 0.0)
        assert len(st.get_parsed_many(lost[0])) == len(lost[0])  # the probe answered
        assert victim.ping()
