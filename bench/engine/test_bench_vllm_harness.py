"""The engine benchmark's arithmetic, on made-up engine results (no vLLM, no engine: milliseconds).

It checks what turns the engines' raw rows into the table: medians per engine, the
ratio each target is judged on, and met / NOT met / not measured. The engines
themselves are checked by ``bench_vllm.py --smoke`` (tiny models, every engine).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_vllm import PROMPT_LEN, Prompts, summarize, table


def ttft_row(ttft: float, hooks: dict[str, float], **extra: float) -> dict:
    return {"ttft_s": ttft, "cached": 0, "steps": 2, "hooks": hooks, "settle_s": 0.0, "cpu_s": ttft, **extra}


def engine(phases: dict, stats: dict | None = None, lookups: tuple[float, ...] = ()) -> dict:
    clocks = [{"role": "WORKER", "stats": stats}] if stats else []
    calls = [{"seconds": x, "prompt": PROMPT_LEN, "local": 0, "answer": 2048} for x in lookups]
    calls.append({"seconds": 1.0, "prompt": 300, "local": 0, "answer": 0})  # the short warm-up: not counted
    clocks.append({"role": "SCHEDULER", "stats": None, "lookups": calls})
    return {"phases": {k: {"rows": v} for k, v in phases.items()}, "clocks": clocks}


def decode(walls: list[float], token_at: int) -> dict:
    steps = [
        {"wall_s": w, "hooks": {}, "saver_token": i == token_at, "batch": 5} for i, w in enumerate(walls)
    ]
    return {"steps": steps, "settle_s": 0.0}


def results(async_save_s: float) -> dict:
    """none, sync and async engines of the fast and slow stores; async waits ``async_save_s`` per prompt."""
    cold_none = [ttft_row(1.0, {}), ttft_row(1.2, {}), ttft_row(1.1, {})]
    res = {
        "none": engine(
            {"cold": cold_none, "own_hit": [ttft_row(0.02, {})] * 3, "decode_batch": decode([1, 0.1, 0.1], 0)}
        ),
        "hit-sync": engine({"hit": [ttft_row(0.05, {"start_load_kv": 0.02})]}, lookups=(0.001, 0.003, 0.001)),
        "hit-async": engine(
            {"hit": [ttft_row(0.06, {"start_load_kv": 0.001, "get_finished": 0.01, "idle_load_wait": 0.5})]},
            lookups=(0.001,),
        ),
        "example-hit": engine({"hit": [ttft_row(0.09, {"start_load_kv": 0.05})]}),
        "l32-hit": engine({"hit": [ttft_row(0.05, {})]}, lookups=(0.002,)),
    }
    for mode, save_s in (("sync", 0.2), ("async", async_save_s)):
        for store in ("fast", "slow"):
            rows = [ttft_row(1.1 + save_s, {"wait_for_save": save_s}, store_bytes_added=75)] * 3
            res[f"{mode}-{store}"] = engine(
                {"cold": rows, "decode_batch": decode([1 + save_s, 0.1, 0.1], 0)},
                {"chunks_saved": 8, "saves_skipped": 0},
            )
    res["example-save"] = engine({"cold": [ttft_row(1.2, {}, store_bytes_added=100)] * 3})
    return res


def test_medians_and_ratios():
    s, ts = summarize(results(0.005))
    assert s["none"]["cold_ttft_s"] == 1.1  # median of 1.0, 1.2, 1.1
    assert s["sync-fast"]["worker_hooks_s"] == 0.2
    assert s["sync-fast"]["counters"] == {"chunks_saved": 8, "saves_skipped": 0}
    by = {t.what: t for t in ts}
    hook = by["1. hook time per prompt, async / sync, fast store"]
    assert abs(hook.value - 0.005 / 0.2) < 1e-12 and hook.verdict == "met"
    hit = by["3. hit from disk (sync load) above vLLM's own hit / recompute"]
    assert abs(hit.value - (0.05 - 0.02) / 1.1) < 1e-12 and hit.verdict == "met"
    sync = "5a. load time of a hit, kvcodec (sync load: the whole load, in the step) / ExampleConnector"
    assert abs(by[sync].value - 0.4) < 1e-12
    share = "5a. load time of a hit, kvcodec (async load: the step's share: the writes) / ExampleConnector"
    assert abs(by[share].value - 0.011 / 0.05) < 1e-12  # the idle steps' waits are not load work
    assert abs(by["5b. bytes stored per prompt, kvcodec / ExampleConnector"].value - 0.75) < 1e-12
    assert abs(by["6. lookup per prompt, 32 layers / 12 layers"].value - 2.0) < 1e-12
    assert by["6. lookup per prompt, 32 layers / 12 layers"].verdict == "NOT met"


def test_a_slow_async_save_fails_its_targets():
    by = {t.what: t for t in summarize(results(0.1))[1]}
    assert by["1. hook time per prompt, async / sync, slow store"].verdict == "NOT met"  # 0.1 / 0.2
    assert by["2. cold TTFT, async slow store / no connector"].verdict == "NOT met"  # 1.2 / 1.1
    decode = by["4. decode step while a prompt saves to the slow store, async / none"]
    assert decode.verdict == "met"  # 1.3 s / 1.2 s over the same 3 steps: 1.083x


def test_missing_engines_are_not_measured_and_still_tabled():
    res = results(0.005)
    for name in ("async-fast", "async-slow", "hit-async"):
        res.pop(name, None)
    s, ts = summarize(res)
    by = {t.what: t for t in ts}
    assert by["1. hook time per prompt, async / sync, fast store"].verdict == "not measured"
    assert by["3. hit from disk (async load) above vLLM's own hit / recompute"].value is None
    text = table(s, ts)
    assert "| not measured |" in text and "| sync-fast |" in text


def test_prompts_are_fixed_and_distinct():
    a, b = Prompts.make(3, PROMPT_LEN), Prompts.make(3, PROMPT_LEN)
    assert a == b
    firsts = {tuple(p[:16]) for p in [a.warmup, a.fresh_warmup, a.saver, *a.timed]}
    assert len(firsts) == 6 and all(len(p) == PROMPT_LEN for p in a.timed)
