"""``make bench-fleet``: LMCache's Redis L2 with kvcodec's serde vs no serde vs LMCache's ``fp8``, in one run.

For each serde: a fresh redis-server, host A's and host B's ``kvcodec-lmcache server`` (``resp``
adapter) started side by side; LMCache's own client stores SEQS x 4 Llama-3-8B-shaped objects through
A (32 layers x 256 tokens x 8 KV heads x 128, bf16: 32 MiB each); then B, with an empty L1, is asked
for them. Measured:

* bytes in Redis: the values' total length, and ``used_memory`` over the empty server's;
* B's fetch time per object: LMCache's own "Prefetch request completed ... in X ms" (Redis GET +
  deserialize into L1, per request) over the objects of the request; and the client's lookup wall
  time (which waits for that prefetch) and retrieve time (L1 -> the engine's blocks), per object.

Numbers go to ``--json`` (bench/results/fleet.json) and a table to stdout. One machine, one run: the
ratios are side by side; absolute times depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import re
import runpy
import statistics
import sys
import tempfile
import time
from pathlib import Path

runpy.run_path(str(Path(__file__).resolve().parents[2] / "tests" / "paths.py"))["import_tests_package"]()
from tests.integrations.lmcache.fleet import harness as h  # noqa: E402  (by location: no repo root on sys.path)

SHAPE_SPEC = "(2,256,16,8,128):bfloat16:32"  # Llama-3-8B's KV: 32 layers, 8 KV heads x 128, 16-token blocks
OBJECT_BYTES = 2 * 32 * 256 * 8 * 128 * 2
SERDES = {
    "kvcodec": {"type": "kvcodec", "head_dim": 128, "page_size": 16, "model": "bench"},
    "none": None,
    "fp8": {"type": "fp8"},
}
PREFETCH = re.compile(
    r"Prefetch request completed.*?(\d+)/(\d+) retained keys \((\d+) L1, (\d+) L2\) in ([\d.]+) ms"
)


def _one(name: str, serde: dict | None, seqs: int, work: Path) -> dict:
    work.mkdir()
    with h.redis_single(work) as redis:
        empty = redis.used_memory()
        adapter = h.adapter_json(redis.resp_adapter, serde)
        with h.lmcache_servers(work, {"A": adapter, "B": adapter}, l1_gb=1.0) as servers:
            stored, _ = h.run_client([h.Step("A", "store", servers["A"], None)], work, seqs, SHAPE_SPEC)
            objects = seqs * stored["A"]["chunks_per_seq"]
            h.wait_keys(redis, objects, writer=servers["A"])
            time.sleep(1.0)  # let the last SETs settle before reading used_memory
            values = redis.values()
            used = redis.used_memory() - empty
            loaded, _ = h.run_client([h.Step("B", "load", servers["B"], None)], work, seqs, SHAPE_SPEC)
            log_b = servers["B"].log_text()
    loads = loaded["B"]["loads"]
    prefetch = [(int(kept), int(l2), float(ms)) for kept, _, _, l2, ms in PREFETCH.findall(log_b)]
    hits = sum(r["hit_chunks"] for r in loads)
    return {
        "serde": name,
        "objects": objects,
        "hits": hits,
        "value_bytes": sum(len(v) for v in values.values()),
        "value_ratio": sum(len(v) for v in values.values()) / (objects * OBJECT_BYTES),
        "used_memory": used,
        "used_memory_ratio": used / (objects * OBJECT_BYTES),
        "prefetch_ms_per_object": statistics.median(ms / l2 for kept, l2, ms in prefetch if l2)
        if prefetch
        else None,
        "lookup_ms_per_object": statistics.median(r["lookup_ms"] / max(r["total_chunks"], 1) for r in loads),
        "retrieve_ms_per_object": statistics.median(
            r["retrieve_ms"] / r["hit_chunks"] for r in loads if r.get("hit_chunks") and r.get("retrieve_ms")
        )
        if hits
        else None,
    }


def _table(rows: list[dict]) -> str:
    raw = next(r for r in rows if r["serde"] == "none")
    lines = [
        "| serde | hits | bytes in Redis (values) | used_memory | B prefetch ms/object | vs none | "
        "B lookup ms/object | B retrieve ms/object |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = (
            r["prefetch_ms_per_object"] / raw["prefetch_ms_per_object"]
            if raw["prefetch_ms_per_object"]
            else 0
        )
        lines.append(
            f"| {r['serde']} | {r['hits']}/{r['objects']} | {r['value_bytes'] / 2**20:.1f} MiB "
            f"({r['value_ratio']:.4f}x) | {r['used_memory'] / 2**20:.1f} MiB ({r['used_memory_ratio']:.3f}x) | "
            f"{r['prefetch_ms_per_object']:.1f} | {rel:.2f}x | {r['lookup_ms_per_object']:.1f} | "
            f"{(r['retrieve_ms_per_object'] or 0):.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=3, help="sequences of 1024 tokens (4 objects each)")
    ap.add_argument("--json", default="bench/results/fleet.json")
    args = ap.parse_args(argv)
    if why := h.redis_missing():
        print(f"SKIP bench-fleet: {why}")
        return 0
    with tempfile.TemporaryDirectory(prefix="kvcodec-fleet-bench-") as tmp:
        rows = [_one(name, serde, args.seqs, Path(tmp) / name) for name, serde in SERDES.items()]
    table = _table(rows)
    print(table)
    out = {"command": "make bench-fleet", "argv": sys.argv[1:], "object_bytes": OBJECT_BYTES, "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
