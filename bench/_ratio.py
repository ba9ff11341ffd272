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
