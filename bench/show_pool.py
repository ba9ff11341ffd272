"""Print the pool-scaling results of ``make bench-threads`` as one table (pytest-benchmark JSON in)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLUMNS = (
    ("one_thread_ms", "1 thread ms"),
    ("pool_of_2_ms", "pool of 2 ms"),
    ("speedup_pool_of_2_vs_one_thread", "speed-up"),
    ("ceiling_speedup_gil_free_item", "ceiling"),
    ("page_faults_per_chunk_one_thread", "faults/chunk 1t"),
    ("page_faults_per_chunk_pool_of_2", "faults/chunk 2t"),
)


def rows(path: Path) -> list[list[str]]:
    """One row per pool benchmark in a results file."""
    out = []
    for b in json.loads(path.read_text())["benchmarks"]:
        info = b["extra_info"]
        if "speedup_pool_of_2_vs_one_thread" in info:
            out.append([f"{path.stem}: {b['param']}", *(str(info.get(k, "")) for k, _ in COLUMNS)])
    return out


def main(paths: list[str]) -> int:
    table = [["run: chunk", *(title for _, title in COLUMNS)]]
    for p in paths:
        table += rows(Path(p))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
