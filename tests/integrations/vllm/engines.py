"""Real vLLM engines for the tests: ``engine/run_engine.py`` run on a spec in a fresh process.

Each test module builds its own spec (model, prompts, store, connector keys: see ``run_engine.py``);
this runs it, keeps the engine's log beside the spec, and returns the engine's result line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

__all__ = ["ENGINE", "bench_model", "run_engine", "store_files", "tiny_model"]

ENGINE = Path(__file__).parent / "engine"


def run_engine(
    tmp: Path, name: str, spec: dict, *, timeout: float = 900, env: dict[str, str] | None = None
) -> tuple[dict, str]:
    """Run ``spec`` as engine ``name``; its result (``outputs``, ``stats``, ``metrics``) and its log,
    also written to ``tmp/<name>.log``. A run past ``timeout`` seconds or exiting non-zero fails."""
    path = tmp / f"spec-{name}.json"
    path.write_text(json.dumps(spec))
    try:
        proc = subprocess.run(
            [sys.executable, str(ENGINE / "run_engine.py"), str(path)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"engine {name} did not finish in {timeout} s")
    log = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(log)
    assert proc.returncode == 0, f"engine {name} failed:\n{proc.stderr[-4000:]}"
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith('{"outputs"')]  # log lines may follow
    return json.loads(line), log


def store_files(store: Path) -> dict[str, bytes]:
    """Every file under a key in a store directory: each layer's blob and each chunk's manifest."""
    return {k: (store / k).read_bytes() for k in sorted(os.listdir(store)) if not k.startswith(".")}


def tiny_model(tmp: Path) -> str:
    """The tests' tiny random Llama, written under ``tmp``; its path."""
    sys.path.insert(0, str(ENGINE))
    from make_model import make_model

    return make_model(str(tmp / "tiny-llama"))


def bench_model(tmp: Path) -> str:
    """The random 12-layer hidden-512 Llama of the engine benchmark (``bench/engine``), under ``tmp``."""
    sys.path.insert(0, str(Path(__file__).parents[3] / "bench" / "engine"))
    from make_bench_model import make_bench_model

    return make_bench_model(str(tmp / "bench-llama"))
