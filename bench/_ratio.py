"""Side-by-side timing that survives noisy machines: interleaved rounds, medians, ratios.

Timing A alone then B alone lets a burst of load from another process land on
one side only. Here the callables take turns round after round, and the ratio
of their medians is reported: it holds when absolute times drift.

Each call is timed on two clocks: wall time (what a user waits) and the calling
thread's CPU time (``time.thread_time``: the time the thread actually ran). On
a shared 2-core machine with other processes runnable, wall times include
whole scheduler slices spent waiting, so wall medians swing by 2x or more from
run to run; CPU times do not, which is why the gated ratios use them. Every
call measured here runs on the calling thread (torch is held to one thread by
bench/conftest.py; kvcodec starts none), so its CPU time is its whole cost.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Timings", "cpu_speedups", "interleaved", "interleaved_timings", "ratio_info"]


@dataclass
class Timings:
    """Median seconds per call of each callable, on the wall clock and on the thread's CPU clock."""

    wall: dict[str, float]
    cpu: dict[str, float]


def interleaved_timings(
    fns: dict[str, Callable[[], object]], *, rounds: int = 25, warmup: int = 3
) -> Timings:
    """Wall and CPU medians of each callable, measured in alternating rounds."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            c0, t0 = time.thread_time(), time.perf_counter()
            f()
            t1, c1 = time.perf_counter(), time.thread_time()
            wall[name].append(t1 - t0)
            cpu[name].append(c1 - c0)
    return Timings(
        wall={n: statistics.median(s) for n, s in wall.items()},
        cpu={n: statistics.median(s) for n, s in cpu.items()},
    )


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
    return interleaved_timings(fns, rounds=rounds, warmup=warmup).wall


def _speedups(medians: dict[str, float], bases: tuple[str, ...], prefix: str) -> dict[str, float]:
    out = {}
    for name, sec in medians.items():
        if name in bases:
            continue
        for base in bases:
            if base in medians:
                out[f"{prefix}speedup_{name}_vs_{base}"] = round(medians[base] / sec, 3)
    return out


def ratio_info(
    medians: dict[str, float] | Timings, baselines: str | tuple[str, ...], nbytes: int
) -> dict[str, float]:
    """extra_info entries: each median in ms, its GB/s over ``nbytes``, and its speed-up over each baseline.

    ``speedup_A_vs_B`` = median(B) / median(A), both from the same interleaved rounds: on CPU time
    when given :class:`Timings` (then ``wall_speedup_A_vs_B`` is the wall-clock one, for reading only).
    """
    bases = (baselines,) if isinstance(baselines, str) else baselines
    wall = medians.wall if isinstance(medians, Timings) else medians
    out: dict[str, float] = {}
    for name, sec in wall.items():
        out[f"{name}_ms"] = round(sec * 1e3, 4)
        out[f"{name}_GBps"] = round(nbytes / sec / 1e9, 3)
    if isinstance(medians, Timings):
        out.update({f"{name}_cpu_ms": round(sec * 1e3, 4) for name, sec in medians.cpu.items()})
        out.update(_speedups(medians.cpu, bases, ""))
        out.update(_speedups(wall, bases, "wall_"))
    else:
        out.update(_speedups(wall, bases, ""))
    return out
