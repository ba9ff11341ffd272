"""Side-by-side timing that survives noisy machines: interleaved rounds, medians, ratios.

Timing A alone then B alone lets a burst of load from another process land on
one side only. Here the callables take turns round after round, and the ratio
of their medians is reported: it holds when absolute times drift.

:func:`cpu_speedups`, the CI gate's figure, times each call on the calling
thread's CPU time (``time.thread_time``: the time the thread actually ran). On a
shared 2-core machine with other processes runnable, wall times include whole
scheduler slices spent waiting, so wall medians swing by 2x or more from run to
run; CPU times do not. Every call measured here runs on the calling thread
(torch is held to one thread by bench/conftest.py; kvcodec starts none), so its
CPU time is its whole cost.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["cpu_speedups", "interleaved", "ratio_info"]


def _cpu_minima(
    fns: dict[str, Callable[[], object]], rounds: int, before: Callable[[], object]
) -> dict[str, float]:
    """Least thread CPU time per call of each callable over ``rounds`` alternating rounds."""
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            before()
            c0 = time.thread_time()
            f()
            best[name] = min(best[name], time.thread_time() - c0)
    return best


def cpu_speedups(
    fns: dict[str, Callable[[], object]],
    yardstick: Callable[[], object],
    *,
    blocks: int = 5,
    rounds: int = 15,
    warmup: int = 2,
    before: Callable[[], object] = lambda: None,
) -> dict[str, float]:
    """{name: speed-up of ``fns[name]`` over ``yardstick``}, the figure a CI gate can hold on a busy machine.

    In each of ``blocks`` blocks the callables and the yardstick take turns for
    ``rounds`` rounds; a block's speed-up is the yardstick's least CPU time over
    the callable's (time the thread ran: waiting for a core does not count, and
    the least is the call least disturbed by cache and clock changes from other
    work). The median over the blocks drops a block that a burst of load skewed.
    ``before`` runs untimed ahead of every call (e.g. to start each from cold caches).
    """
    timed = {**fns, "__yardstick__": yardstick}
    for _ in range(warmup):
        for f in timed.values():
            f()
    per_block: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(blocks):
        best = _cpu_minima(timed, rounds, before)
        for name in fns:
            per_block[name].append(best["__yardstick__"] / best[name])
    return {name: round(statistics.median(r), 4) for name, r in per_block.items()}


def interleaved(
    fns: dict[str, Callable[[], object]], *, rounds: int = 25, warmup: int = 3
) -> dict[str, float]:
    """Median wall seconds per call of each callable, measured in alternating rounds."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def ratio_info(medians: dict[str, float], baselines: str | tuple[str, ...], nbytes: int) -> dict[str, float]:
    """extra_info entries: each median in ms, its GB/s over ``nbytes``, and its speed-up over each baseline.

    ``speedup_A_vs_B`` = median(B) / median(A), both from the same interleaved rounds.
    """
    out: dict[str, float] = {}
    bases = (baselines,) if isinstance(baselines, str) else baselines
    for name, sec in medians.items():
        out[f"{name}_ms"] = round(sec * 1e3, 4)
        out[f"{name}_GBps"] = round(nbytes / sec / 1e9, 3)
        if name in bases:
            continue
        for base in bases:
            if base in medians:
                out[f"speedup_{name}_vs_{base}"] = round(medians[base] / sec, 3)
    return out
