"""The connector's scheduler side on its own: no vLLM, no torch (requests and scheduler outputs are
read duck-typed, the store is a real DirectoryStore reached only through ``contains_many``)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvcodec.integrations.vllm.chunk_keys import ChunkKeys, ChunkRef, HeadSplit, group_of
from kvcodec.integrations.vllm.config import KvcodecConfig
from kvcodec.integrations.vllm.keys import prefix_hashes
from kvcodec.integrations.vllm.metadata import StepPlan
from kvcodec.integrations.vllm.scheduler import KvcodecScheduler, LookupShape
from kvcodec.store import DirectoryStore, StoreOptions

CHUNK, BLOCK = 32, 16
TOKENS = list(range(5, 5 + 3 * CHUNK + 1))
HASHES = prefix_hashes(TOKENS[: 3 * CHUNK], CHUNK)
KEYS = ChunkKeys("0123456789abcdef")


def _scheduler(root: Path, **extra: object) -> tuple[KvcodecScheduler, DirectoryStore]:
    store = DirectoryStore.from_options(root, StoreOptions(group_of=group_of, verify_blobs=False))
    cfg = KvcodecConfig.from_extra({"root": str(root), "chunk_size": CHUNK, **extra})
    return KvcodecScheduler(cfg, KEYS, store, LookupShape((0, 1)), BLOCK), store


def _request(rid: str = "r") -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=TOKENS, prompt_embeds=None, lora_request=None)


def _output(rid: str | None, computed: int) -> SimpleNamespace:
    new = SimpleNamespace(
        req_id=rid, prompt_token_ids=TOKENS, block_ids=(list(range(8)),), num_computed_tokens=0
    )
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(
        scheduled_new_reqs=[new] if rid else [],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={rid: computed} if rid else {},
        total_num_scheduled_tokens=computed,
    )


def test_the_scheduler_side_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, kvcodec.integrations.vllm.scheduler\nassert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_leading_present_chunks_are_hit(tmp_path: Path) -> None:
    sched, store = _scheduler(tmp_path)
    for c in (0, 1):
        store.put(KEYS.manifest(ChunkRef.of(HASHES, c)), b"m")
    assert sched.get_num_new_matched_tokens(_request(), 0) == (2 * CHUNK, True)
    assert sched.get_num_new_matched_tokens(_request("s"), 2 * CHUNK) == (0, False)  # vLLM had them
    assert sched.build_connector_meta(_output(None, 0), StepPlan()).lookup_calls == 2  # one per prompt


def test_saves_are_planned_in_order_and_held_at_finish(tmp_path: Path) -> None:
    sched, store = _scheduler(tmp_path)
    store.put(KEYS.manifest(ChunkRef.of(HASHES, 1)), b"m")  # chunk 1 present, chunk 0 not
    sched.get_num_new_matched_tokens(_request(), 0)
    meta = sched.build_connector_meta(_output("r", len(TOKENS)), StepPlan())
    assert [(s.chunk, s.parent_hash) for s in meta.saves] == [(0, None), (2, HASHES[1])]
    assert meta.saves[1].block_ids == list(range(6))
    assert sched.request_finished(_request(), []) == (True, None)
    assert sched.build_connector_meta(_output(None, 0), StepPlan()).held == ["r"]


def test_the_save_plan_does_not_ask_again_for_the_chunks_a_hit_found(tmp_path: Path) -> None:
    """A hit's lookup found chunks 0 and 1 stored: the step that schedules the request plans a save
    of chunk 2 only, asking the store about chunk 2 alone (one lookup call per prompt, not two)."""
    sched, store = _scheduler(tmp_path, async_load=False)
    for c in (0, 1):
        store.put(KEYS.manifest(ChunkRef.of(HASHES, c)), b"m")
    asked: list[list[str]] = []
    real = store.contains_many
    store.contains_many = lambda keys: asked.append(list(keys)) or real(keys)  # type: ignore[method-assign]
    assert sched.get_num_new_matched_tokens(_request(), 0) == (2 * CHUNK, False)
    sched.update_state_after_alloc(
        _request(), SimpleNamespace(get_block_ids=lambda: (list(range(8)),)), 2 * CHUNK
    )
    meta = sched.build_connector_meta(_output("r", len(TOKENS)), StepPlan())
    assert [s.chunk for s in meta.saves] == [2] and len(meta.loads) == 1
    assert len(asked) == 2 and asked[1] == [KEYS.manifest(ChunkRef.of(HASHES, 2))]


@pytest.mark.parametrize("failed", [False, True])
def test_a_failed_asynchronous_load_has_its_chunks_looked_up_again(tmp_path: Path, failed: bool) -> None:
    """An asynchronous load that fails removes its chunk: the save plan then asks the store about the
    hit's chunks again (and saves the missing one); a load that succeeds is trusted."""
    sched, store = _scheduler(tmp_path)
    for c in (0, 1):
        store.put(KEYS.manifest(ChunkRef.of(HASHES, c)), b"m")
    assert sched.get_num_new_matched_tokens(_request(), 0) == (2 * CHUNK, True)
    sched.update_state_after_alloc(
        _request(), SimpleNamespace(get_block_ids=lambda: (list(range(8)),)), 2 * CHUNK
    )
    sched.build_connector_meta(_output(None, 0), StepPlan())  # the load goes out
    sched.update_connector_output(SimpleNamespace(finished_recving=set()))  # a step it is not done in
    if failed:
        store.delete(KEYS.manifest(ChunkRef.of(HASHES, 1)))  # what the worker does with a failed chunk
    sched.update_connector_output(
        SimpleNamespace(finished_recving={"r"}, invalid_block_ids={5} if failed else set())
    )
    meta = sched.build_connector_meta(_output("r", len(TOKENS)), StepPlan())
    assert [s.chunk for s in meta.saves] == ([1, 2] if failed else [2])


def test_a_capped_scheduler_defers_loads_until_one_is_received(tmp_path: Path) -> None:
    sched, store = _scheduler(tmp_path, max_concurrent_loads=1)
    store.put(KEYS.manifest(ChunkRef.of(HASHES, 0)), b"m")
    blocks = SimpleNamespace(get_block_ids=lambda: ([0, 1],))
    assert sched.get_num_new_matched_tokens(_request("a"), 0) == (CHUNK, True)
    sched.update_state_after_alloc(_request("a"), blocks, CHUNK)
    assert sched.get_num_new_matched_tokens(_request("b"), 0) == (None, False)
    meta = sched.build_connector_meta(_output(None, 0), StepPlan())
    assert [ld.req_id for ld in meta.loads] == ["a"] and meta.loads_deferred == 1
    sched.update_connector_output(SimpleNamespace(finished_recving={"a"}))
    assert sched.get_num_new_matched_tokens(_request("b"), 0) == (CHUNK, True)


def test_only_a_manifest_key_is_a_manifest() -> None:
    """What the store evicts first from a chunk's group (so no lookup finds a manifest whose blobs go)."""
    from kvcodec.integrations.vllm.chunk_keys import is_manifest

    keys = ChunkKeys("0123456789abcdef", HeadSplit(4, 2), world=2)
    ref = ChunkRef.of(HASHES, 2)
    assert is_manifest(keys.manifest(ref)) and is_manifest(keys.manifest(ref, 1))
    others = (keys.blob(0, 1, ref), keys.blob(1, 1, ref), keys.rank_marker(1, ref), "m-M-x", "plain")
    assert not any(is_manifest(k) for k in others)


def test_keys_name_head_ranges_not_tensor_parallel_ranks() -> None:
    """A blob's key names its layer and KV-head range: a chunk written at TP=2 is two blobs per layer
    (heads 0-1 and 2-3 of 4) whichever rank wrote them; at TP=1 one blob of every head."""
    ref = ChunkRef.of(HASHES, 1)
    tp2 = ChunkKeys("0123456789abcdef", HeadSplit(4, 2), world=2)
    tp1 = ChunkKeys("0123456789abcdef", HeadSplit(4, 1))
    assert tp2.blob(1, 3, ref) == f"0123456789abcdef-L3.2.4{ref.suffix}"
    assert tp2.blob(1, 3, ref) == tp1.part_blob(3, ref, HeadSplit(4, 2), 1)
    assert (
        tp1.blob(0, 3, ref) == f"0123456789abcdef-L3{ref.suffix}" == tp2.part_blob(3, ref, HeadSplit(4, 1), 0)
    )
    assert tp2.manifest(ref) == tp1.manifest(ref, 2) != tp1.manifest(ref)
    # More ranks than KV heads: vLLM replicates each head on world // heads ranks.
    assert HeadSplit.of_world(1, 2) == HeadSplit(1, 1) and HeadSplit(1, 1).part_of_rank(1, 2) == 0
    assert HeadSplit(8, 4).overlapping(2, 6) == [1, 2]


def test_a_chunk_stored_at_another_split_is_hit_and_says_which(tmp_path: Path) -> None:
    store = DirectoryStore.from_options(tmp_path, StoreOptions(group_of=group_of, verify_blobs=False))
    cfg = KvcodecConfig.from_extra({"root": str(tmp_path), "chunk_size": CHUNK})
    keys = ChunkKeys("0123456789abcdef", HeadSplit(4, 2), world=2)
    sched = KvcodecScheduler(cfg, keys, store, LookupShape((0, 1), 4, (2, 1, 4)), BLOCK)
    store.put(keys.manifest(ChunkRef.of(HASHES, 0), 1), b"x")  # chunk 0 by a TP=1 engine
    store.put(keys.manifest(ChunkRef.of(HASHES, 1), 4), b"x")  # chunk 1 by a TP=4 engine
    assert sched.get_num_new_matched_tokens(_request(), 0) == (2 * CHUNK, True)
    sched.update_state_after_alloc(
        _request(), SimpleNamespace(get_block_ids=lambda: (list(range(8)),)), 2 * CHUNK
    )
    (load,) = sched.build_connector_meta(_output(None, 0), StepPlan()).loads
    assert load.splits == [1, 4] and load.split(0, 2) == 1 and load.split(2, 2) == 2


def test_an_io_error_of_the_store_is_a_counted_miss_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """EIO/ESTALE from a shared directory must not reach vLLM's schedule() (the engine core would die)."""
    sched, store = _scheduler(tmp_path)
    store.put(KEYS.manifest(ChunkRef.of(HASHES, 0)), b"m")
    real = os.lstat

    def eio(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "lstat", eio)
    with caplog.at_level(logging.WARNING, logger="vllm.kvcodec"):
        assert sched.get_num_new_matched_tokens(_request("a"), 0) == (0, False)
        assert sched.get_num_new_matched_tokens(_request("b"), 0) == (0, False)
    assert sched.build_connector_meta(_output(None, 0), StepPlan()).lookups_unavailable == 2
    lines = [r for r in caplog.records if "lookup failed" in r.getMessage()]
    assert len(lines) == 1 and "OSError" in lines[0].getMessage(), [r.getMessage() for r in caplog.records]
    monkeypatch.setattr(os, "lstat", real)
    assert sched.get_num_new_matched_tokens(_request("c"), 0) == (CHUNK, True)  # the outage is over


def test_a_request_never_looked_up_is_not_saved(tmp_path: Path) -> None:
    """Without its recorded seed (LoRA, salt) its chunks' keys are unknown: base-model keys would be wrong."""
    sched, _ = _scheduler(tmp_path)
    assert sched.build_connector_meta(_output("r", len(TOKENS)), StepPlan()).saves == []
    sched.get_num_new_matched_tokens(_request("s"), 0)
    assert len(sched.build_connector_meta(_output("s", len(TOKENS)), StepPlan()).saves) == 3
