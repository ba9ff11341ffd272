"""Asynchronous saves from CPU caches copy chunks out of the cache off the step, so vLLM must not reuse
the blocks before the copy (no engine: the hooks are called as vLLM's scheduler and model runner call
them; the copies are held back by a gate to make the interleavings certain):

* the scheduler keeps a finished request's blocks (``request_finished`` -> True) when it sent saves;
* ``get_finished`` reports such a request sent once, and only after its copies are done;
* ``handle_preemptions`` copies a preempted request's chunks out before it returns, without waiting
  for the gatherer's queue, so the forward may then overwrite the blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs vLLM")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvcodec.integrations.vllm.connector import KvcodecConnector, KvcodecMetadata, SaveSpec
from kvcodec.integrations.vllm.layout import gather_kv
from kvcodec.integrations.vllm.worker import ConnectorParts
from tests.integrations.vllm.workers import BLOCK_IDS, CHUNK, HASHES, HEAD, TOKENS, connector, cpu_worker


def _saves(req_id: str, hashes: list[str] = HASHES) -> list[SaveSpec]:
    return [SaveSpec(req_id, c, hashes[c], hashes[c - 1] if c else None, BLOCK_IDS) for c in range(2)]


def _step(conn: KvcodecConnector, meta: KvcodecMetadata) -> set[str] | None:
    """One model-runner step's hooks; returns the requests reported sent."""
    conn.bind_connector_metadata(meta)
    conn.handle_preemptions(meta)
    conn.wait_for_save()
    sent, _ = conn.get_finished(set())
    conn.clear_connector_metadata()
    return sent


class Gate:
    """Holds every copy out of the cache until ``event`` is set; counts the copies made."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.copies = 0

    def gather(self, *args: Any, **kwargs: Any) -> Any:
        self.event.wait(60)
        self.copies += 1
        return gather_kv(*args, **kwargs)

    def worker(self, root: Path) -> KvcodecConnector:
        """A CPU worker whose copies out of the cache pass this gate."""
        return cpu_worker(root, ConnectorParts(gather=self.gather))


def _returns(call: Callable[[], Any], within_s: float = 30.0) -> tuple[bool, Any]:
    """(whether ``call`` returned within ``within_s`` while the gate stays closed, what it returned):
    run on a thread and waited for on an event, so a call that blocks fails instead of hanging."""
    done, out = threading.Event(), []

    def run() -> None:
        out.append(call())
        done.set()

    threading.Thread(target=run, daemon=True).start()
    returned = done.wait(within_s)
    return returned, out[0] if returned else None


def _gathering(conn: KvcodecConnector) -> dict[str, list[Any]]:
    return conn.worker.saves.gathering  # type: ignore[union-attr]


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if not p.name.startswith(".")}


def _sync_blobs(root: Path) -> dict[str, bytes]:
    """What a synchronous save of both chunks writes from the untouched caches."""
    conn = cpu_worker(root, async_save=False)
    _step(conn, KvcodecMetadata(saves=_saves("w")))
    conn.shutdown()
    return _files(root)


def test_a_finished_request_is_reported_sent_once_its_copies_are_done(tmp_path: Path) -> None:
    gate = Gate()
    conn = gate.worker(tmp_path)
    assert _returns(lambda: _step(conn, KvcodecMetadata(saves=_saves("w")))) == (True, None)
    assert gate.copies == 0  # the step did not copy (nor wait for the gate)
    assert _step(conn, KvcodecMetadata(held=["w"])) is None  # finished, its copies still pending
    gate.event.set()
    assert conn.drain(60)
    assert _step(conn, KvcodecMetadata()) == {"w"}
    assert _step(conn, KvcodecMetadata()) is None  # reported once
    assert conn.stats["requests_held"] == 1 and conn.stats["chunks_saved"] == 2
    conn.shutdown()


def test_a_held_request_without_pending_copies_is_reported_at_once(tmp_path: Path) -> None:
    conn = cpu_worker(tmp_path)
    _step(conn, KvcodecMetadata(saves=_saves("w")))
    assert conn.drain(60)
    assert _step(conn, KvcodecMetadata(held=["w"])) == {"w"}
    conn.shutdown()


def test_a_preempted_requests_chunks_are_copied_before_its_blocks_are_reused(tmp_path: Path) -> None:
    want = _sync_blobs(tmp_path / "sync")
    gate = Gate()
    conn = gate.worker(tmp_path / "async")
    # Another request's chunk first: the gatherer takes it and waits at the gate; w's chunks queue.
    _step(conn, KvcodecMetadata(saves=[SaveSpec("o", 0, "f" * 16, None, [7, 6])]))
    _step(conn, KvcodecMetadata(saves=_saves("w")))
    while not any(g.claimed for g in _gathering(conn).get("o", ())):
        time.sleep(0.01)
    done = threading.Event()

    def preempt() -> None:
        conn.handle_preemptions(KvcodecMetadata(preempted=["w"]))
        done.set()

    threading.Thread(target=preempt, daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set()  # copying w's chunks (at the gate too), not waiting for the queue
    gate.event.set()
    assert done.wait(60)
    assert not _gathering(conn).get("w")
    for cache in conn.worker.caches.caches.values():  # type: ignore[union-attr]  # the forward reuses w's blocks
        cache[BLOCK_IDS] = 0
    assert conn.drain(60)
    got = {k: v for k, v in _files(tmp_path / "async").items() if k in want}
    assert got == want, "a chunk was copied after its blocks were reused"
    assert conn.stats["requests_preempted"] == 1
    conn.shutdown()


def test_handle_preemptions_takes_queued_chunks_off_the_gatherer(tmp_path: Path) -> None:
    """The gatherer busy on another request: the preempted request's chunks are copied by the step
    thread itself, each exactly once."""
    gate = Gate()
    conn = gate.worker(tmp_path)
    _step(conn, KvcodecMetadata(saves=[SaveSpec("o", 0, "f" * 16, None, [7, 6])]))
    _step(conn, KvcodecMetadata(saves=_saves("w")))
    while not any(g.claimed for g in _gathering(conn).get("o", ())):
        time.sleep(0.01)
    ran = threading.Thread(target=conn.handle_preemptions, args=(KvcodecMetadata(preempted=["w"]),))
    ran.start()
    while gate.copies == 0 and ran.is_alive():
        gate.event.set()  # let every copy through; the gatherer's first is another request's
        time.sleep(0.01)
    ran.join(60)
    assert conn.drain(60)
    layers = len(conn.worker.caches.caches)  # type: ignore[union-attr]
    assert gate.copies == 3 * layers  # o's chunk and w's two chunks, each layer copied once
    assert conn.stats["chunks_saved"] == 3
    conn.shutdown()


def _request(req_id: str) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=TOKENS,
        prompt_embeds=None,
        lora_request=None,
        mm_features=None,
        cache_salt=None,
    )


def _scheduled(req_id: str | None) -> SimpleNamespace:
    """A scheduler output in which a new request (if any) computes its whole prompt, and "p" is preempted."""
    new = SimpleNamespace(
        req_id=req_id, prompt_token_ids=TOKENS, block_ids=(BLOCK_IDS,), num_computed_tokens=0
    )
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(
        scheduled_new_reqs=[new] if req_id else [],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req_id: len(TOKENS)} if req_id else {},
        total_num_scheduled_tokens=len(TOKENS) if req_id else 0,
        preempted_req_ids={"p"},
    )


@pytest.mark.parametrize("async_save", [True, False])
def test_the_scheduler_holds_blocks_only_for_asynchronous_saves(tmp_path: Path, async_save: bool) -> None:
    conn = connector(tmp_path, KVConnectorRole.SCHEDULER, async_save=async_save)
    conn.get_num_new_matched_tokens(_request("w"), 0)
    meta = conn.build_connector_meta(_scheduled("w"))
    assert len(meta.saves) == 2 and meta.preempted == ["p"] and not meta.idle
    assert conn.request_finished(_request("w"), list(BLOCK_IDS)) == (async_save, None)
    after = conn.build_connector_meta(_scheduled(None))
    assert after.held == (["w"] if async_save else [])
    assert after.idle  # a step that computes nothing: get_finished may wait for the loader
    # A request that never had a chunk to save is never held.
    assert conn.request_finished(_request("never"), []) == (False, None)


def test_a_preemption_waits_for_no_other_requests_copies(tmp_path: Path) -> None:
    gate = Gate()
    conn = gate.worker(tmp_path)
    _step(conn, KvcodecMetadata(saves=_saves("o")))
    # w has no copies: returns with the gate still closed
    assert _returns(lambda: conn.handle_preemptions(KvcodecMetadata(preempted=["w"])))[0]
    assert gate.copies == 0
    gate.event.set()
    assert conn.drain(60)
    conn.shutdown()


def test_at_the_memory_bound_chunks_wait_in_their_held_blocks(tmp_path: Path) -> None:
    """With room for one chunk's copy, a second request's chunks are not skipped: they stay in the
    cache (the request held) until the first chunk's write frees the memory, then are saved too."""
    gate = Gate()
    one = 2 * CHUNK * 2 * 2 * HEAD * 2  # a chunk of both layers: tokens x heads x (K+V) x bf16
    conn = cpu_worker(tmp_path, ConnectorParts(gather=gate.gather), max_pending_save_bytes=one)
    _step(conn, KvcodecMetadata(saves=_saves("a")))
    _step(conn, KvcodecMetadata(saves=_saves("b", HASHES[::-1])))
    assert _step(conn, KvcodecMetadata(held=["a", "b"])) is None  # their copies wait
    gate.event.set()
    assert conn.drain(60)
    assert _step(conn, KvcodecMetadata()) == {"a", "b"}
    assert conn.stats["chunks_saved"] == 4 and conn.stats["saves_skipped"] == 0
    assert conn.stats["saves_waited"] >= 1
    conn.shutdown()


def test_a_preemption_at_the_memory_bound_skips_and_logs_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A preempted request's chunks must leave its blocks now: when their copies do not fit, they are
    skipped (counted, one WARNING with the count), never waited for."""
    gate = Gate()
    one = 2 * CHUNK * 2 * 2 * HEAD * 2
    conn = cpu_worker(tmp_path, ConnectorParts(gather=gate.gather), max_pending_save_bytes=one)
    _step(conn, KvcodecMetadata(saves=[SaveSpec("o", 0, "f" * 16, None, [7, 6])]))
    while not any(g.claimed for g in _gathering(conn).get("o", ())):
        time.sleep(0.01)  # o's copy holds all the room, at the gate
    _step(conn, KvcodecMetadata(saves=_saves("w")))
    with caplog.at_level(logging.WARNING, logger="vllm.kvcodec"):
        conn.handle_preemptions(KvcodecMetadata(preempted=["w"]))
    assert not _gathering(conn).get("w")
    assert conn.stats["saves_skipped"] == 2
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("kvcodec: 1 chunk save(s) skipped"), lines
    gate.event.set()
    assert conn.drain(60)
    assert conn.stats["chunks_saved"] == 1
    conn.shutdown()


@pytest.mark.parametrize("hook", ["start_load_kv", "wait_for_save", "handle_preemptions"])
def test_a_wrong_metadata_type_is_refused(tmp_path: Path, hook: str) -> None:
    conn = cpu_worker(tmp_path)
    meta = SimpleNamespace(saves=[], loads=[], preempted=["x"])
    conn.bind_connector_metadata(meta)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="KvcodecMetadata"):
        if hook == "handle_preemptions":
            conn.handle_preemptions(meta)  # type: ignore[arg-type]
        elif hook == "start_load_kv":
            conn.start_load_kv(None)  # type: ignore[arg-type]
        else:
            conn.wait_for_save()
    conn.shutdown()
