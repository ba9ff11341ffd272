"""What the connector checks at start and does at the edges of its life (no engine): a store config
error found only on connect stops it at start, a fleet key a directory store would ignore is warned
about (refused as ``fleet_key_file``), a load-failure policy other than "recompute" is warned about,
a full store's refused saves are logged, and ``shutdown`` closes the store it opened."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs vLLM")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvcodec import CodecError, UnsupportedConfigError
from kvcodec.integrations.vllm.connector import KvcodecMetadata, SaveSpec
from kvcodec.integrations.vllm.worker import ConnectorParts
from kvcodec.store import StoreFullError
from tests.integrations.vllm import workers
from tests.integrations.vllm.workers import BLOCK_IDS, HASHES, HookedStore, connector, cpu_worker
from tests.redis_servers import redis_missing, redis_single

FLEET_KEY = "k" * 32
SCHED = KVConnectorRole.SCHEDULER


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def test_a_fleet_key_on_a_directory_store_is_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVCODEC_FLEET_KEY", FLEET_KEY)
    with caplog.at_level(logging.WARNING, logger="vllm.kvcodec"):
        connector(tmp_path, SCHED).shutdown()
    assert len(_warnings(caplog, "fleet key")) == 1, [r.getMessage() for r in caplog.records]
    monkeypatch.delenv("KVCODEC_FLEET_KEY")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.kvcodec"):
        connector(tmp_path, SCHED).shutdown()
    assert _warnings(caplog, "fleet key") == []


def test_a_fleet_key_file_on_a_directory_store_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "fleet.key"
    key.write_text(FLEET_KEY + "\n")
    with pytest.raises(UnsupportedConfigError, match="fleet_key_file"):
        connector(tmp_path / "store", SCHED, fleet_key_file=str(key))


def test_a_load_failure_policy_other_than_recompute_is_warned_about(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = workers.KVTransferConfig

    def failing(**kwargs: Any) -> Any:
        return real(**{**kwargs, "kv_load_failure_policy": "fail"})

    with caplog.at_level(logging.WARNING, logger="vllm.kvcodec"):
        connector(tmp_path, SCHED).shutdown()
        assert _warnings(caplog, "kv_load_failure_policy") == []
        monkeypatch.setattr(workers, "KVTransferConfig", failing)
        connector(tmp_path, SCHED).shutdown()
    lines = _warnings(caplog, "kv_load_failure_policy")
    assert len(lines) == 1 and "'fail'" in lines[0] and "recompute" in lines[0], lines


def test_a_full_store_logs_the_saves_it_refuses(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def full(key: str) -> None:
        raise StoreFullError("OOM command not allowed when used memory > 'maxmemory'")

    conn = cpu_worker(tmp_path, ConnectorParts(store=HookedStore(tmp_path, on_write=full)))
    saves = [SaveSpec("w", c, HASHES[c], HASHES[c - 1] if c else None, BLOCK_IDS) for c in range(2)]
    with caplog.at_level(logging.WARNING, logger="vllm.kvcodec"):
        conn.bind_connector_metadata(KvcodecMetadata(saves=saves))
        conn.wait_for_save()
        conn.clear_connector_metadata()
        assert conn.drain(60), "the writer did not go idle"
    assert conn.stats["store_full"] == 2 and conn.stats["chunks_saved"] == 0
    lines = _warnings(caplog, "store is full")
    assert len(lines) == 1 and "store_full" in lines[0], [r.getMessage() for r in caplog.records]
    conn.shutdown()


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_shutdown_closes_the_store_it_opened(tmp_path: Path, role: KVConnectorRole) -> None:
    conn = cpu_worker(tmp_path) if role == KVConnectorRole.WORKER else connector(tmp_path, role)
    conn.shutdown()
    with pytest.raises(CodecError):
        conn.store.contains("x")


def test_shutdown_leaves_a_store_passed_in_open(tmp_path: Path) -> None:
    store = HookedStore(tmp_path)
    connector(tmp_path, SCHED, ConnectorParts(store=store)).shutdown()
    assert store.contains("x") is False


@pytest.mark.skipif(redis_missing() is not None, reason=str(redis_missing()))
def test_a_cluster_url_with_a_database_is_refused_at_start(tmp_path: Path) -> None:
    """The store finds it only when it connects: the connector asks at start, not at the first request."""
    extra = ["--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf")]
    with redis_single(tmp_path, extra) as server:
        with pytest.raises(UnsupportedConfigError, match="database 0"):
            connector(tmp_path, SCHED, store=f"redis://127.0.0.1:{server.port}/1")


def test_the_worker_builds_its_handlers_when_the_caches_are_registered(tmp_path: Path) -> None:
    """Before ``register_kv_caches`` no handler exists (a hook that needs one says so); the stats,
    ``drain`` and ``shutdown`` work; after it both handlers work on the registered caches."""
    conn = connector(tmp_path, KVConnectorRole.WORKER)
    worker = conn.worker
    assert worker is not None and worker.registered is None
    with pytest.raises(RuntimeError, match="before register_kv_caches"):
        conn.get_block_ids_with_load_errors()
    assert conn.stats["writer_queue_depth"] == 0 and conn.drain(1)
    conn.shutdown()
    conn = cpu_worker(tmp_path)
    worker = conn.worker
    assert worker is not None and worker.registered is not None
    assert worker.loads.caches is worker.saves.caches is worker.caches
    assert sorted(worker.caches.caches) == workers.NAMES and worker.loads.heads is worker.setup.heads
    conn.shutdown()
