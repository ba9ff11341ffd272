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

from kvcodec.integrations.vllm import connector as connector_mod
from kvcodec.integrations.vllm.connector import KvcodecConnector, KvcodecMetadata, LoadSpec, SaveSpec
from kvcodec.store import DirectoryStore
from tests.integrations.vllm.workers import BLOCK_IDS, CHUNK, HASHES, HEAD, LAYERS, cpu_worker


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
    end = time.monotonic() + 60
    while time.monotonic() < end:
        _, received = conn.get_finished(set())
        errors |= conn.get_block_ids_with_load_errors()
        if received:
            return received, errors
        time.sleep(0.01)
    return None, errors


@pytest.mark.parametrize("exc", [RuntimeError("a bug"), MemoryError(), OSError(5, "EIO")])
def test_a_failing_read_is_a_load_error_and_the_request_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, exc: BaseException
) -> None:
    conn = cpu_worker(tmp_path)
    _save_both_chunks(conn)
    second = conn._blob_key(0, 1, 1, HASHES[1], HASHES[0])
    real_get = DirectoryStore.get_parsed

    def get(self: DirectoryStore, key: str, **kwargs: object) -> object:
        if key == second:
            raise exc
        return real_get(self, key, **kwargs)

    monkeypatch.setattr(DirectoryStore, "get_parsed", get)
    with caplog.at_level(logging.WARNING, logger="vllm.kvcodec"):
        received, errors = _load(conn)
    assert received == {"r"}, "the request was never reported received"
    assert errors == {5, 2}, "chunk 1's blocks must be recomputed, chunk 0's kept"
    assert conn.stats["chunks_failed"] == 1 and conn.stats["chunks_loaded"] == 1
    lines = [r for r in caplog.records if "request r chunk 1 not loaded" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    # Chunk 1 no longer looks present (vLLM's next lookup of the request must not load it again).
    assert conn._store.contains(conn._manifest_key(0, HASHES[0], None))
    assert not conn._store.contains(conn._manifest_key(1, HASHES[1], HASHES[0]))
    conn.shutdown()


def test_a_failing_load_job_fails_the_whole_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception outside any one chunk (here: the job's own bookkeeping) still reports every block."""
    conn = cpu_worker(tmp_path)
    _save_both_chunks(conn)

    def broken(self: KvcodecConnector, spec: LoadSpec) -> None:
        raise KeyError("a stats counter")

    monkeypatch.setattr(KvcodecConnector, "_prepare", broken)
    received, errors = _load(conn)
    assert received == {"r"}
    assert errors == {7, 6, 5, 2}
    assert conn.stats["chunks_failed"] == 1 and conn.stats["chunks_loaded"] == 0
    conn.shutdown()


def test_a_failing_write_into_the_cache_is_a_load_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = cpu_worker(tmp_path)
    _save_both_chunks(conn)
    real = connector_mod.write_chunk
    calls = []

    def write(*args: object, **kwargs: object) -> None:
        calls.append(1)
        if len(calls) > 1:  # chunk 1
            raise ValueError("a bug")
        real(*args, **kwargs)

    monkeypatch.setattr(connector_mod, "write_chunk", write)
    received, errors = _load(conn)
    assert received == {"r"} and errors == {5, 2}
    assert conn.stats["chunks_failed"] == 1
    assert not conn._store.contains(conn._manifest_key(1, HASHES[1], HASHES[0]))
    conn.shutdown()


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failing_store_write_is_counted_and_nothing_stalls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, async_save: bool
) -> None:
    conn = cpu_worker(tmp_path, async_save=async_save, writer_threads=1)

    def put(self: DirectoryStore, key: str, blob: object) -> None:
        raise RuntimeError("a bug in the store")

    monkeypatch.setattr(DirectoryStore, "put", put)
    with caplog.at_level(logging.WARNING, logger="vllm.kvcodec"):
        _save_both_chunks(conn)
    assert conn.stats["save_errors"] == 2 and conn.stats["chunks_saved"] == 0
    assert sum("not saved (RuntimeError" in r.getMessage() for r in caplog.records) == 2
    assert not conn._inflight
    monkeypatch.undo()
    _save_both_chunks(conn)  # the writer still works, and the chunks were not left marked in flight
    assert conn.stats["chunks_saved"] == 2
    t0 = time.perf_counter()
    conn.shutdown()
    assert time.perf_counter() - t0 < 5


def test_a_failing_gather_is_counted_and_the_step_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = cpu_worker(tmp_path)

    def gather(*args: object, **kwargs: object) -> None:
        raise IndexError("a bug")

    monkeypatch.setattr(connector_mod, "gather_kv", gather)
    _save_both_chunks(conn)
    assert conn.stats["save_errors"] == 2 and conn.stats["chunks_saved"] == 0
    conn.shutdown()


def test_loads_reuse_their_read_buffers_and_return_them_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first load's buffers are reused by the second (its blobs read into them, the cache the
    same); a load whose second chunk fails still gives every buffer back."""
    conn = cpu_worker(tmp_path)
    _save_both_chunks(conn)
    assert conn._buffers.idle_bytes == 0
    assert _load(conn, "a") == ({"a"}, set())
    held = conn._buffers.idle_bytes
    first = {n: c.clone() for n, c in conn._caches.items()}
    assert held >= 2 * LAYERS * 1000  # both chunks' blobs, every layer
    for c in conn._caches.values():
        c[[7, 6, 5, 2]] = 0
    assert _load(conn, "b") == ({"b"}, set())
    assert conn._buffers.idle_bytes == held  # the same buffers, none allocated anew
    assert all(conn._caches[n].equal(first[n]) for n in first)
    real = DirectoryStore.get_parsed

    def failing(self: DirectoryStore, key: str, **kwargs: object) -> object:
        if "-C1-" in key:
            raise OSError(5, "EIO")
        return real(self, key, **kwargs)

    monkeypatch.setattr(DirectoryStore, "get_parsed", failing)
    received, errors = _load(conn, "c")
    assert received == {"c"} and errors == {5, 2}
    assert conn._buffers.idle_bytes == held
    conn.shutdown()


def test_cpu_async_loads_are_written_by_the_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU caches: the loader thread writes the chunks too (vLLM leaves a loading request's blocks
    alone until it is reported); the step's ``get_finished`` only reports the request."""
    conn = cpu_worker(tmp_path)
    _save_both_chunks(conn)
    want = {n: c.clone() for n, c in conn._caches.items()}
    for c in conn._caches.values():
        c[[7, 6, 5, 2]] = 0
    real = connector_mod.write_chunk
    writers = []

    def write(*args: object, **kwargs: object) -> None:
        writers.append(threading.current_thread().name)
        real(*args, **kwargs)

    monkeypatch.setattr(connector_mod, "write_chunk", write)
    assert _load(conn, "r") == ({"r"}, set())
    assert writers and all(w.startswith("kvcodec-loader") for w in writers), writers
    for n, c in conn._caches.items():  # the load's blocks hold the saved chunks' K again, bit for bit
        assert c[[7, 6, 5, 2], ..., :HEAD].equal(want[n][BLOCK_IDS, ..., :HEAD])
    conn.shutdown()
