"""While a request waits for its asynchronous load, vLLM keeps stepping with nothing to compute. In
such an idle step ``get_finished`` waits (up to ``IDLE_LOAD_WAIT_S``) for the loader rather than let
vLLM spin, and returns the load in that same call once it is ready; a step that computes something
never waits. No engine: the hooks are called as vLLM's model runner calls them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs vLLM")

from kvcodec.integrations.vllm.connector import KvcodecConnector, KvcodecMetadata, LoadSpec, SaveSpec
from kvcodec.integrations.vllm.worker import ConnectorParts
from tests.integrations.vllm.workers import BLOCK_IDS, CHUNK, HASHES, cpu_worker

LONG_WAIT_S = 60.0
"""The idle wait, made long: a call that returns well before it was woken by the loader."""


def _finished(conn: KvcodecConnector, meta: KvcodecMetadata) -> tuple[set[str] | None, bool]:
    """(the loads ``get_finished`` reported, whether it returned within half the idle wait): run on a
    thread and waited for on an event, so a call that sat out the whole wait shows as False."""
    done, out = threading.Event(), []

    def run() -> None:
        conn.bind_connector_metadata(meta)
        out.append(conn.get_finished(set())[1])
        conn.clear_connector_metadata()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    early = done.wait(LONG_WAIT_S / 2)
    assert done.wait(2 * LONG_WAIT_S)  # the call's own bound (the idle wait) ends it
    return out[0], early


@pytest.fixture
def gated_load(tmp_path: Path) -> Iterator[tuple[KvcodecConnector, threading.Event]]:
    """A connector with both chunks stored and one background load started, held at a gate."""
    conn = cpu_worker(tmp_path, ConnectorParts(idle_load_wait_s=LONG_WAIT_S))
    saves = [SaveSpec("w", c, HASHES[c], HASHES[c - 1] if c else None, BLOCK_IDS) for c in range(2)]
    conn.bind_connector_metadata(KvcodecMetadata(saves=saves))
    conn.wait_for_save()
    conn.clear_connector_metadata()
    assert conn.drain(60)
    gate = threading.Event()
    loads = conn.worker.loads  # type: ignore[union-attr]

    def gated(spec: LoadSpec) -> object:
        gate.wait(LONG_WAIT_S)
        return loads.read_and_check(spec)

    loads.prepare = gated  # type: ignore[assignment]
    spec = LoadSpec("r", 0, 2 * CHUNK, HASHES, [7, 6, 5, 2], background=True)
    conn.bind_connector_metadata(KvcodecMetadata(loads=[spec]))
    conn.start_load_kv(None)  # type: ignore[arg-type]
    conn.clear_connector_metadata()
    yield conn, gate
    gate.set()
    conn.shutdown()


def test_a_busy_step_never_waits_for_a_load(gated_load: tuple[KvcodecConnector, threading.Event]) -> None:
    conn, _ = gated_load
    received, early = _finished(conn, KvcodecMetadata(idle=False))
    assert received is None and early


def test_an_idle_step_returns_the_load_as_soon_as_it_is_ready(
    gated_load: tuple[KvcodecConnector, threading.Event],
) -> None:
    conn, gate = gated_load
    threading.Timer(0.2, gate.set).start()
    received, early = _finished(conn, KvcodecMetadata(idle=True))
    assert received == {"r"}, "the idle step did not wait for the load"
    assert early, "woken by the loader, not by the timeout"
    assert conn.stats["chunks_loaded"] == 2


def test_an_idle_step_without_pending_loads_does_not_wait(tmp_path: Path) -> None:
    conn = cpu_worker(tmp_path, ConnectorParts(idle_load_wait_s=LONG_WAIT_S))
    received, early = _finished(conn, KvcodecMetadata(idle=True))
    assert received is None and early
    conn.shutdown()
