"""Run one vLLM engine (CPU) over token-id prompts and print what it did, as JSON.

Each engine runs in a fresh process (``python run_engine.py SPEC.json``), so a
second engine starts with an empty local prefix cache and whatever it reuses
comes through the connector. SPEC: ``model``, ``prompts`` (lists of token ids),
``max_tokens``, optional ``store`` (enables KvcodecConnector with that root),
``model_id``, ``fused`` (the connector's fused-path mode), ``async_save``, ``async_load``,
``max_pending_save_bytes``, ``max_concurrent_loads``, ``writer_threads``, ``max_bytes`` (connector
keys), ``chunk_size``, ``block_size``,
``max_num_batched_tokens`` (small: chunked prefill), ``max_model_len``, ``kv_cache_memory_bytes``, ``cwd`` (run from there: a relative ``model``),
``prefix_caching`` (false: vLLM's own prefix cache off, so a repeated prompt comes from the store),
``repeat`` (run the prompts that many times, one after another), ``drain`` (wait for the connector's
pending writes after each prompt), and faults injected by ``faulty_connector.py``: ``slow_put_s`` (every
store write sleeps that long first: a slow store), ``fail_get`` (every store read of a key containing
that text raises RuntimeError: a bug in the read path), ``slow_gather_s`` (every copy out of the cache
waits that long first), ``shutdown_timeout_s`` (how long the connector's shutdown drains pending writes; default: its own), ``log_stats`` (vLLM's
stat loggers on; the ``vllm:kvcodec*`` Prometheus metrics and vLLM's prompt tokens cached by source,
as ``vllm:prompt_tokens_cached_by_source{SOURCE}``, are returned), ``update_at`` (indices of the
prompts before which the weights are changed in place, through ``collective_rpc``, and
``reset_prefix_cache(reset_connector=True)`` is called, as after an RL weight update: each reset's
result in ``resets``), ``kv_events`` (vLLM's KV events on, "null" publisher; the events published
with ``medium`` STORAGE, the connector's, are returned as ``events``), ``tp`` (tensor-parallel size;
above 1 the workers run in their own processes (``mp``) and ``stats`` sums their counters, each in
``rank_stats``; the caller runs it with ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` and
``VLLM_CPU_OMP_THREADS_BIND``).
After the prompts the connector is shut down (pending writes drained or abandoned) before its
counters are read. Output (last stdout line):
``{"outputs": [{"cached": n, "tokens": [...], "top2": [[lp1, lp2], ...]}, ...], "stats": {...},
"metrics": {...}}`` (``top2``: the two best log-probabilities at each generated position).
"""

from __future__ import annotations

import json
import os
import sys

# faulty_connector.py beside this script, also when PYTHONSAFEPATH (set by the tests) keeps it off sys.path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def vllm_without_amx() -> bool:
    """vLLM's CPU kernels as on a CPU without AMX, unless ``KVCODEC_VLLM_AMX=1``; whether AMX was hidden.

    On an AMX host vllm-cpu 0.32 takes AMX paths that these engines cannot run, whatever the connector:
    its AMX attention dies of SIGILL (``tilezero`` in an OpenMP worker, cpu_attn_amx.hpp) when an
    engine's first forward is a prefix hit from a connector (seen with head_dim 64 and 256; an engine
    whose first prompt is computed, then hit in vLLM's own cache, runs), and its AMX_MLA backend takes
    only blocks of a multiple of 32. Hidden, vLLM takes its portable kernels ("vec" attention,
    CPU_MLA), as on the hosts without AMX where these tests were written, so a test means the same
    on either host. Module level, so that TP workers started by spawn (which import this file again)
    hide it too."""
    if os.environ.get("KVCODEC_VLLM_AMX") == "1":
        return False
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False
    return True


AMX_HIDDEN = vllm_without_amx()


_CONNECTOR_KEYS = (
    "model_id",
    "fused",
    "async_save",
    "async_load",
    "max_pending_save_bytes",
    "max_concurrent_loads",
    "writer_threads",
    "max_bytes",
)
_FAULTS = ("slow_put_s", "fail_get", "slow_gather_s")


def _transfer_config(spec: dict) -> dict | None:
    """The connector's config; with a fault in the spec, the connector of ``faulty_connector.py``."""
    if not spec.get("store"):
        return None
    extra = {"root": spec["store"], "chunk_size": spec.get("chunk_size", 256), "scope": "per_page_head"}
    for key in _CONNECTOR_KEYS:
        if spec.get(key) is not None:
            extra[key] = spec[key]
    module = "kvcodec.integrations.vllm"
    faults = {k: spec[k] for k in _FAULTS if spec.get(k)}
    if faults:
        import faulty_connector  # beside this script: its directory is on sys.path

        faulty_connector.FAULTS.update(faults)
        module = "faulty_connector"
    return {
        "kv_connector": "KvcodecConnector",
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def _metrics(llm) -> dict:
    """The kvcodec Prometheus metrics vLLM's stat loggers recorded, and the cached tokens by source."""
    out = {}
    for m in llm.get_metrics():
        if "kvcodec" in m.name:
            out[m.name] = getattr(m, "value", None)
        elif m.name == "vllm:prompt_tokens_cached_by_source":
            out[f"{m.name}{{{m.labels.get('source')}}}"] = m.value
    return out


def _events_config(spec: dict):
    if not spec.get("kv_events"):
        return None
    from vllm.config import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="null")


def _capture_events(llm) -> list:
    """Record every STORAGE event the scheduler publishes (the engine core runs in this process)."""
    pub = llm.llm_engine.engine_core.engine_core.scheduler.kv_event_publisher
    publish, got = pub.publish, []

    def record(batch) -> None:
        for e in batch.events:
            if getattr(e, "medium", None) == "STORAGE":
                got.append(
                    {
                        "type": type(e).__name__,
                        "blocks": len(e.block_hashes),
                        "tokens": len(e.token_ids),
                        "block_size": e.block_size,
                        "locality": e.locality,
                        "first_token": e.token_ids[0],
                    }
                )
        publish(batch)

    pub.publish = record
    return got


def _perturb_weights(worker) -> int:
    """An in-place weight update (run in each worker): every attention projection moves, so the KV
    the engine computes from now on differs from what it saved before."""
    import torch

    n = 0
    with torch.no_grad():
        for name, p in worker.model_runner.get_model().named_parameters():
            if "qkv" in name or "kv_a" in name or "kv_b" in name:
                p.add_(torch.randn_like(p) * 0.05 * p.float().std().to(p.dtype))
                n += 1
    return n


def _update_and_reset(llm) -> bool:
    """Change the weights in place, then reset the prefix caches, the connector's included."""
    assert all(llm.collective_rpc(_perturb_weights)), "no attention weights to update"
    return llm.reset_prefix_cache(reset_connector=True)


def main(path: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    if spec.get("cwd"):
        os.chdir(spec["cwd"])
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=spec.get("block_size", 32),
        max_model_len=spec.get("max_model_len", 2048),
        enforce_eager=True,
        max_num_seqs=4,
        kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 64 << 20),
        seed=0,
        kv_transfer_config=_transfer_config(spec),
        max_num_batched_tokens=spec.get("max_num_batched_tokens"),
        disable_log_stats=not spec.get("log_stats", False),
        enable_prefix_caching=spec.get("prefix_caching", True),
        num_gpu_blocks_override=spec.get("num_blocks"),
        kv_events_config=_events_config(spec),
        tensor_parallel_size=spec.get("tp", 1),
        distributed_executor_backend="mp" if spec.get("tp", 1) > 1 else None,
    )
    events = _capture_events(llm) if spec.get("kv_events") else []
    params = SamplingParams(
        temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True, detokenize=False, logprobs=2
    )
    outs = []
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"] * spec.get("repeat", 1)]
    # One at a time (a later prompt may reuse earlier chunks), or all at once ("batch").
    batches = [prompts] if spec.get("batch") else [[p] for p in prompts]
    resets = []
    for o in _generate(llm, batches, params, spec.get("update_at", []), resets):
        if spec.get("drain"):
            assert all(llm.collective_rpc(_drain)), "the connector's writes did not finish in 120 s"
        c = o.outputs[0]
        top2 = [sorted((x.logprob for x in lp.values()), reverse=True)[:2] for lp in c.logprobs]
        outs.append({"cached": o.num_cached_tokens, "tokens": list(c.token_ids), "top2": top2})
    stats, metrics = {}, {}
    if spec.get("log_stats"):
        metrics = _metrics(llm)
    ranks = []
    if spec.get("store") and spec.get("tp", 1) > 1:  # workers in their own processes: ask each
        ranks = llm.collective_rpc(_worker_stats)
        stats = {k: sum(r.get(k, 0) for r in ranks) for k in ranks[0]}
    elif spec.get("store"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
        if spec.get("shutdown_timeout_s") is not None:
            conn.shutdown_timeout_s = spec["shutdown_timeout_s"]
        conn.shutdown()
        stats = dict(conn.stats)
    out = {"outputs": outs, "stats": stats, "metrics": metrics, "resets": resets, "events": events}
    print(json.dumps({**out, "rank_stats": ranks, "amx_hidden": AMX_HIDDEN}), flush=True)


def _worker_stats(worker) -> dict:
    """In a worker: drain the connector's writes, shut it down, return its counters."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group()
    conn.drain(120)
    conn.shutdown()
    return dict(conn.stats)


def _drain(worker) -> bool:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().drain(120)


def _generate(llm, batches: list, params, update_at: list[int], resets: list):
    """Each batch's outputs in order; before the prompt at each index of ``update_at``, the weights
    change and the caches reset (one prompt a batch then)."""
    done = 0
    for batch in batches:
        if done in update_at:
            resets.append(_update_and_reset(llm))
        yield from llm.generate(batch, params, use_tqdm=False)
        done += len(batch)


if __name__ == "__main__":
    main(sys.argv[1])
