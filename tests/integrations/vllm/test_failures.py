"""Background jobs that fail in unexpected ways (no engine): a load job's exception reaches vLLM as a
failed load of the request's blocks (recomputed) and the request is still reported; a save job's is
counted and logged and stalls neither the writer nor ``drain``. The connector's worker side is driven
directly: CPU caches registered, metadata bound, the hooks called as vLLM's model runner calls them."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs vLLM")

from kvcodec.integrations.vllm.chunk_keys import ChunkRef
from kvcodec.integrations.vllm.chunk_writes import write_chunk
from kvcodec.integrations.vllm.connector import KvcodecConnector, KvcodecMetadata, LoadSpec, SaveSpec
from kvcodec.integrations.vllm.worker import ConnectorParts
from tests.integrations.vllm.workers import BLOCK_IDS, CHUNK, HASHES, HEAD, LAYERS, HookedStore, cpu_worker

REF0, REF1 = ChunkRef.of(HASHES, 0), ChunkRef.of(HASHES, 1)


def _hooked(tmp_path: Path, **extra: object) -> tuple[KvcodecConnector, HookedStore]:
    store = HookedStore(tmp_path)
    return cpu_worker(tmp_path, ConnectorParts(store=store), **extra), store


def _present(conn: KvcodecConnector, ref: ChunkRef) -> bool:
    return conn.store.contains(conn.keys.manifest(ref))


def _save_both_chunks(conn: KvcodecConnector) -> None:
    saves = [SaveSpec("w", c, HASHES[c], HASHES[c - 1] if c else None, BLOCK_IDS) for c in range(2)]
    conn.bind_connector_metadata(KvcodecMetadata(saves=saves))
    conn.wait_for_save()
    conn.clear_connector_metadata()
    assert conn.drain(60), "the writer did not go idle"


def _load(conn: KvcodecConnector, req_id: str = "r") -> tuple[set[str] | None, set[int]]:
    """One background load of both chunks into other blocks; the hooks vLLM calls until it is received."""
    spec = LoadSpec(req_id, 0, 2 * CHUNK, HASHES, [7, 6, 5, 2], background=True)
    conn.bind_connector_metadata(KvcodecMetadata(loads=[spec]))
    conn.start_load_kv(None)  # type: ignore[arg-type]
    conn.clear_connector_metadata()
    errors: set[int] = set()
    for _ in range(6000):  # a liveness bound (polls), not a speed check
        _, received = conn.get_finished(set())
        errors |= conn.get_block_ids_with_load_errors()
        if received:
            return received, errors
        time.sleep(0.01)
    return None, errors


@pytest.mark.parametrize("exc", [RuntimeError("a bug"), MemoryError(), OSError(5, "EIO")])
def test_a_failing_read_is_a_load_error_and_the_request_finishes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, exc: BaseException
) -> None:
    conn, store = _hooked(tmp_path)
    _save_both_chunks(conn)
    second = conn.keys.blob(0, 1, REF1)

    def get(key: str) -> None:
        if key == second:
            raise exc

    store.on_read = get
    with caplog.at_level(logging.WARNING, logger="vllm.kvcodec"):
        received, errors = _load(conn)
    assert received == {"r"}, "the request was never reported received"
    assert errors == {5, 2}, "chunk 1's blocks must be recomputed, chunk 0's kept"
    assert conn.stats["chunks_failed"] == 1 and conn.stats["chunks_loaded"] == 1
    lines = [r for r in caplog.records if "request r chunk 1 not loaded" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    # Chunk 1 no longer looks present (vLLM's next lookup of the request must not load it again).
    assert _present(conn, REF0) and not _present(conn, REF1)
    conn.shutdown()


def test_a_failing_load_job_fails_the_whole_request(tmp_path: Path) -> None:
    """An exception outside any one chunk (here: the job's own bookkeeping) still reports every block."""
    conn = cpu_worker(tmp_path)
    _save_both_chunks(conn)

    def broken(spec: LoadSpec) -> None:
        raise KeyError("a stats counter")

    conn.worker.loads.prepare = broken  # type: ignore[assignment,union-attr]
    received, errors = _load(conn)
    assert received == {"r"}
    assert errors == {7, 6, 5, 2}
    assert conn.stats["chunks_failed"] == 1 and conn.stats["chunks_loaded"] == 0
    conn.shutdown()


def test_a_failing_write_into_the_cache_is_a_load_error(tmp_path: Path) -> None:
    calls = []

    def write(*args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) > 1:  # chunk 1
            raise ValueError("a bug")
        write_chunk(*args, **kwargs)  # type: ignore[arg-type]

    conn = cpu_worker(tmp_path, ConnectorParts(write=write))
    _save_both_chunks(conn)
    received, errors = _load(conn)
    assert received == {"r"} and errors == {5, 2}
    assert conn.stats["chunks_failed"] == 1
    assert not _present(conn, REF1)
    conn.shutdown()


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failing_store_write_is_counted_and_nothing_stalls(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, async_save: bool
) -> None:
    conn, store = _hooked(tmp_path, async_save=async_save, writer_threads=1)

    def put(key: str) -> None:
        raise RuntimeError("a bug in the store")

    store.on_write = put
    with caplog.at_level(logging.WARNING, logger="vllm.kvcodec"):
        _save_both_chunks(conn)
    assert conn.stats["save_errors"] == 2 and conn.stats["chunks_saved"] == 0
    assert sum("not saved (RuntimeError" in r.getMessage() for r in caplog.records) == 2
    assert not conn.worker.saves.inflight  # type: ignore[union-attr]
    store.on_write = None
    _save_both_chunks(conn)  # the writer still works, and the chunks were not left marked in flight
    assert conn.stats["chunks_saved"] == 2
    done = threading.Thread(target=conn.shutdown)
    done.start()
    done.join(60)  # shutdown returns (nothing left waiting on the failed jobs); a liveness bound only
    assert not done.is_alive()


def test_a_failing_gather_is_counted_and_the_step_goes_on(tmp_path: Path) -> None:
    def gather(*args: object, **kwargs: object) -> None:
        raise IndexError("a bug")

    conn = cpu_worker(tmp_path, ConnectorParts(gather=gather))  # type: ignore[arg-type]
    _save_both_chunks(conn)
    assert conn.stats["save_errors"] == 2 and conn.stats["chunks_saved"] == 0
    conn.shutdown()


def test_loads_reuse_their_read_buffers_and_return_them_after_a_failure(tmp_path: Path) -> None:
    """The first load's buffers are reused by the second (its blobs read into them, the cache the
    same); a load whose second chunk fails still gives every buffer back."""
    conn, store = _hooked(tmp_path)
    buffers, caches = conn.worker.loads.buffers, conn.worker.caches.caches  # type: ignore[union-attr]
    _save_both_chunks(conn)
    assert buffers.idle_bytes == 0
    assert _load(conn, "a") == ({"a"}, set())
    held = buffers.idle_bytes
    first = {n: c.clone() for n, c in caches.items()}
    assert held >= 2 * LAYERS * 1000  # both chunks' blobs, every layer
    for c in caches.values():
        c[[7, 6, 5, 2]] = 0
    assert _load(conn, "b") == ({"b"}, set())
    assert buffers.idle_bytes == held  # the same buffers, none allocated anew
    assert all(caches[n].equal(first[n]) for n in first)

    def failing(key: str) -> None:
        if REF1.suffix in key:
            raise OSError(5, "EIO")

    store.on_read = failing
    received, errors = _load(conn, "c")
    assert received == {"c"} and errors == {5, 2}
    assert buffers.idle_bytes == held
    conn.shutdown()


def test_cpu_async_loads_are_written_by_the_loader(tmp_path: Path) -> None:
    """CPU caches: the loader thread writes the chunks too (vLLM leaves a loading request's blocks
    alone until it is reported); the step's ``get_finished`` only reports the request."""
    writers = []

    def write(*args: object, **kwargs: object) -> None:
        writers.append(threading.current_thread().name)
        write_chunk(*args, **kwargs)  # type: ignore[arg-type]

    conn = cpu_worker(tmp_path, ConnectorParts(write=write))
    caches = conn.worker.caches.caches  # type: ignore[union-attr]
    _save_both_chunks(conn)
    want = {n: c.clone() for n, c in caches.items()}
    for c in caches.values():
        c[[7, 6, 5, 2]] = 0
    assert _load(conn, "r") == ({"r"}, set())
    assert writers and all(w.startswith("kvcodec-loader") for w in writers), writers
    for n, c in caches.items():  # the load's blocks hold the saved chunks' K again, bit for bit
        assert c[[7, 6, 5, 2], ..., :HEAD].equal(want[n][BLOCK_IDS, ..., :HEAD])
    conn.shutdown()
