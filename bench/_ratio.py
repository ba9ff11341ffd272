"""Side-by-side timing that survives noisy machines: interleaved rounds, medians, ratios.

Timing A alone then B alone lets a burst of load from another process land on
one side only. Here the callables take turns round after round, and the ratio
of their medians is reported: it holds when absolute times drift.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["interleaved", "ratio_info"]


def interleaved(fns: dict[str, Callable[[], object]], *, rounds: int = 25, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each callable, measured in alternating rounds."""
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


def ratio_info(medians: dict[str, float], baseline: str, nbytes: int) -> dict[str, float]:
    """extra_info entries: each median in ms, its GB/s over ``nbytes`` and its speed-up over ``baseline``."""
    out: dict[str, float] = {}
    base = medians[baseline]
    for name, sec in medians.items():
        out[f"{name}_ms"] = round(sec * 1e3, 4)
        out[f"{name}_GBps"] = round(nbytes / sec / 1e9, 3)
        if name != baseline:
            out[f"speedup_{name}_vs_{baseline}"] = round(base / sec, 2)
    return out
