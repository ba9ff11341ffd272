"""CI performance gate: fail on a real slowdown, stay quiet on a noisy machine.

It reads a pytest-benchmark JSON and checks ratios measured within one run —
``speedup_kvcodec*_vs_yardstick`` in each benchmark's ``extra_info``: a fixed
yardstick workload's CPU time over kvcodec's, the two taking turns round after
round, least CPU time per block, median over blocks (bench/_ratio.py) — against
the floors in a baseline file. CPU time leaves out the time spent waiting for a
core, and machine-wide changes (clock, memory bandwidth) move both sides of a
ratio; a slower kvcodec moves only one. A ratio below
``baseline * (1 - tolerance)`` fails the gate (exit 1).

    python bench/gate.py RESULTS.json... [--baseline bench/baseline.json] [--tolerance 0.2]
    python bench/gate.py RESULTS.json... --update   # write the baseline from RESULTS

With several result files (repeated runs) the gate checks each ratio's median
over them, and ``--update`` records each ratio's minimum, a conservative floor.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

GATED = re.compile(r"^speedup_kvcodec\w*_vs_yardstick$")
DEFAULT_BASELINE = Path(__file__).with_name("baseline.json")


def ratios(results: dict) -> dict[str, dict[str, float]]:
    """{benchmark name: {gated ratio key: value}} from a pytest-benchmark JSON."""
    out: dict[str, dict[str, float]] = {}
    for b in results.get("benchmarks", []):
        got = {k: float(v) for k, v in b.get("extra_info", {}).items() if GATED.match(k)}
        if got:
            out[b["name"]] = got
    return out


def merge(runs: list[dict[str, dict[str, float]]], how: str) -> dict[str, dict[str, float]]:
    """Combine several runs' ratios per key: "median" or "min"."""
    f = statistics.median if how == "median" else min
    names = {n for r in runs for n in r}
    out: dict[str, dict[str, float]] = {}
    for n in sorted(names):
        keys = {k for r in runs for k in r.get(n, {})}
        out[n] = {k: round(f([r[n][k] for r in runs if k in r.get(n, {})]), 4) for k in sorted(keys)}
    return out


def check(
    current: dict[str, dict[str, float]], baseline: dict[str, dict[str, float]], tolerance: float
) -> list[str]:
    """Lines describing each failure (empty when the gate passes)."""
    failures = []
    for name, keys in baseline.items():
        for key, base in keys.items():
            cur = current.get(name, {}).get(key)
            if cur is None:
                failures.append(f"{name}: {key} missing from the results (baseline {base:.3f})")
            elif cur < base * (1 - tolerance):
                failures.append(
                    f"{name}: {key} = {cur:.3f}, below {base:.3f} x (1 - {tolerance}) = {base * (1 - tolerance):.3f}"
                )
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, nargs="+")
    ap.add_argument("--baseline", type=Path, default=DEFAULT_BASELINE)
    ap.add_argument("--tolerance", type=float, default=0.2, help="allowed relative drop (default 0.2)")
    ap.add_argument("--update", action="store_true", help="write the baseline from the results")
    a = ap.parse_args(argv)
    runs = []
    for path in a.results:
        try:
            runs.append(ratios(json.loads(path.read_text())))
        except (OSError, ValueError) as e:
            print(f"gate: error: cannot read {path}: {e}", file=sys.stderr)
            return 2
    current = merge(runs, "min" if a.update else "median")
    if a.update:
        a.baseline.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
        print(f"gate: wrote {sum(len(v) for v in current.values())} ratios to {a.baseline}")
        return 0
    try:
        baseline = json.loads(a.baseline.read_text())
    except (OSError, ValueError) as e:
        print(f"gate: error: cannot read baseline {a.baseline}: {e}", file=sys.stderr)
        return 2
    for name, keys in sorted(current.items()):
        for key, cur in sorted(keys.items()):
            base = baseline.get(name, {}).get(key)
            print(f"{name:<40} {key:<40} {cur:8.3f}  (baseline {'-' if base is None else f'{base:.3f}'})")
    failures = check(current, baseline, a.tolerance)
    for f in failures:
        print(f"gate: SLOWER: {f}", file=sys.stderr)
    print(
        f"gate: {'FAIL' if failures else 'ok'} ({len(failures)} of {sum(len(v) for v in baseline.values())} ratios below floor)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
