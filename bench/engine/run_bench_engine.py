"""Run one vLLM engine (CPU, in-process) through the benchmark's phases and print what it measured, as JSON.

``PYTHONPATH=<repo> python run_bench_engine.py SPEC.json OUT.json`` in a fresh process, so each engine
starts with an empty prefix cache and whatever it reuses comes through its connector.
The engine is driven step by step (``LLMEngine.add_request`` / ``step``), so each
step's wall time and the time spent inside the connector's hooks during it (from
:data:`timed_connector.CLOCKS`) are known.

SPEC: ``model``, ``connector`` (null, or ``{"class": ..., "extra": {...}}`` for a class
of :mod:`timed_connector`), ``store`` (the directory the connector writes, watched to
tell when background writes have settled), ``engine`` (extra ``LLM`` arguments), and
``phases``:

- ``{"kind": "ttft", "name": ..., "prompts": [[ids]...]}``: each prompt alone,
  ``max_tokens=1``; per prompt the time to its first token, the steps it took, the
  cached tokens vLLM reports, the hook seconds per hook during those steps, then the
  time until the store has settled (writes still running after the token), and the
  process's CPU seconds (all threads) until the token and until the store settled,
  and the bytes the store grew by.
- ``{"kind": "decode_batch", "name": ..., "decodes": [[ids]...], "saver": [ids],
  "after": n}``: the decodes run until each has a token, then the saver prompt
  joins; the wall time and hook seconds of every step from then until ``after``
  steps past the saver's first token.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
if os.environ.get("KVCODEC_VLLM_AMX") != "1":  # as tests/integrations/vllm/engine/run_engine.py: vLLM's
    import torch  # AMX attention dies of SIGILL on a connector hit first, so it runs its portable kernels

    torch.cpu._is_amx_tile_supported = lambda: False

SETTLE_S = 0.3
"""The store counts as settled when its file list has not changed for this long and no temp file is left."""


def _transfer_config(spec: dict) -> dict | None:
    conn = spec.get("connector")
    if not conn:
        return None
    return {
        "kv_connector": conn["class"],
        "kv_connector_module_path": "bench.engine.timed_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": conn["extra"],
    }


def _store_state(root: str | None) -> tuple[int, int, bool]:
    """(files, bytes, a temp file present) under ``root``, recursively."""
    files = size = 0
    temp = False
    for dirpath, _, names in os.walk(root or "/nonexistent"):
        for n in names:
            if n.startswith(".tmp") or n.endswith(".tmp"):
                temp = True
                continue
            try:
                size += os.stat(os.path.join(dirpath, n)).st_size
            except FileNotFoundError:
                continue
            files += 1
    return files, size, temp


def settle(root: str | None, timeout: float = 60.0) -> float:
    """Seconds until ``root`` stops changing (background writes done); 0 without a store."""
    if not root:
        return 0.0
    t0 = time.perf_counter()
    last, since = None, t0
    while time.perf_counter() - t0 < timeout:
        state = _store_state(root)
        now = time.perf_counter()
        if state != last:
            last, since = state, now
        elif not state[2] and now - since >= SETTLE_S:
            return since - t0
        time.sleep(0.02)
    return timeout


class Stepper:
    """The engine driven step by step, with the connector clocks read around each step."""

    def __init__(self, llm: Any) -> None:
        self.engine = llm.llm_engine
        self.n = 0

    @staticmethod
    def hook_seconds() -> dict[str, float]:
        timed = sys.modules.get("bench.engine.timed_connector")  # loaded by vLLM when a connector is set
        total: dict[str, float] = {}
        for clock in timed.CLOCKS if timed else []:
            for hook, s in clock.seconds.items():
                total[hook] = total.get(hook, 0.0) + s
            for hook, s in clock.cpu.items():
                total[f"cpu:{hook}"] = total.get(f"cpu:{hook}", 0.0) + s
        return total

    def add(self, prompt: list[int], max_tokens: int) -> str:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.n += 1
        rid = f"r{self.n}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        return rid

    def steps(self) -> Iterator[tuple[list[Any], float, dict[str, float]]]:
        """(outputs, wall seconds, hook seconds) per step while requests are unfinished.

        The hook seconds hold each hook's wall time, its thread's CPU time (``cpu:<hook>``) and the
        whole process's CPU time during the step (``cpu:step``, every thread, the writers' too).
        """
        while self.engine.has_unfinished_requests():
            h0 = self.hook_seconds()
            t0, c0 = time.perf_counter(), time.process_time()
            outs = self.engine.step()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            h1 = self.hook_seconds()
            yield outs, wall, {**{k: h1[k] - h0.get(k, 0.0) for k in h1}, "cpu:step": cpu}


def _add_hooks(acc: dict[str, float], step: dict[str, float]) -> None:
    for k, v in step.items():
        acc[k] = acc.get(k, 0.0) + v


def run_ttft(st: Stepper, phase: dict, store: str | None) -> list[dict]:
    rows = []
    for prompt in phase["prompts"]:
        bytes0 = _store_state(store)[1]
        t0, c0 = time.perf_counter(), time.process_time()
        rid = st.add(prompt, 1)
        row: dict[str, Any] = {"ttft_s": None, "cached": None, "steps": 0, "hooks": {}}
        for outs, _, h in st.steps():
            row["steps"] += 1
            _add_hooks(row["hooks"], h)
            for o in outs:
                if o.request_id == rid and row["ttft_s"] is None and o.outputs and o.outputs[0].token_ids:
                    row["ttft_s"], row["cpu_ttft_s"] = time.perf_counter() - t0, time.process_time() - c0
                    row["cached"] = o.num_cached_tokens
        row["settle_s"] = settle(store)
        row["cpu_s"] = time.process_time() - c0
        row["store_bytes_added"] = _store_state(store)[1] - bytes0
        rows.append(row)
    return rows


def run_decode_batch(st: Stepper, phase: dict, store: str | None) -> dict:
    decodes = {st.add(p, phase["decode_tokens"]) for p in phase["decodes"]}
    started: set[str] = set()
    it = st.steps()
    for outs, _, _ in it:
        started |= {o.request_id for o in outs if o.request_id in decodes and o.outputs[0].token_ids}
        if started == decodes:
            break
    saver = st.add(phase["saver"], 1)
    rows, left = [], None
    for outs, wall, h in it:
        done = any(o.request_id == saver and o.outputs[0].token_ids for o in outs)
        rows.append({"wall_s": wall, "hooks": h, "saver_token": done, "batch": len(outs)})
        if done and left is None:
            left = phase["after"]
        elif left is not None:
            left -= 1
        if left == 0:
            break
    for _ in it:  # let the decodes finish (not timed)
        pass
    return {"steps": rows, "settle_s": settle(store)}


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        seed=0,
        kv_transfer_config=_transfer_config(spec),
        **spec.get("engine", {}),
    )
    result: dict[str, Any] = {"start_s": time.perf_counter() - t0, "phases": {}}
    st = Stepper(llm)
    store = spec.get("store")
    for phase in spec["phases"]:
        t1 = time.perf_counter()
        if phase["kind"] == "ttft":
            res: Any = run_ttft(st, phase, store)
        else:
            res = run_decode_batch(st, phase, store)
        result["phases"][phase["name"]] = {
            "kind": phase["kind"],
            "rows": res,
            "wall_s": time.perf_counter() - t1,
        }
    timed = sys.modules.get("bench.engine.timed_connector")
    result["clocks"] = [c.snapshot() for c in timed.CLOCKS] if timed else []
    files, size, _ = _store_state(store)
    result["store"] = {"files": files, "bytes": size}
    with open(out_path, "w") as f:
        json.dump(result, f)
    print(json.dumps({"ok": True, "out": out_path}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
