"""Decodes beside a busy Python thread: what each hand-over of the GIL costs a loader.

A connector's loader thread decodes a hit's blobs while the engine's own loop runs Python beside it. Each
time a kvcodec call releases the GIL, that busy thread takes it and keeps it until its switch interval
ends (5 ms by default), so a decode's wall time grows with the releases it makes, not with its CPU time.
This script decodes ``--blobs`` blobs of ``--shape`` (plain, lossless in one C call, lossless stage by
stage) into reused ``out_k`` / ``out_v``, alone and with a thread counting in a Python loop beside it,
the ways taking turns round after round, and reports each one's median wall and CPU time (the calling
thread's) to ``bench/results/gil-handover.json``.

Run: ``.venv/bin/python bench/gil_handover.py`` (defaults: 96 blobs of 256 x 4 x 64, bf16, per_page_head
page 16: the 12-layer model's hit in docs/fleet.md; 9 rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

import kvcodec
from kvcodec import backends

RESULTS = Path(__file__).resolve().parent / "results" / "gil-handover.json"


def _blobs(n: int, shape: tuple[int, int, int], compression: str) -> list[bytearray]:
    g = torch.Generator().manual_seed(0)
    kv = [[torch.randn(*shape, generator=g).to(torch.bfloat16) for _ in "kv"] for _ in range(n)]
    return [kvcodec.encode(k, v, scope="per_page_head", page_size=16, compression=compression) for k, v in kv]


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def _timed(load: Callable[[], None], busy: bool) -> tuple[float, float]:
    """Wall and CPU seconds of ``load``, with a thread spinning in Python beside it when ``busy``."""
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,)) if busy else None
    if spinner:
        spinner.start()
        time.sleep(0.005)
    w0, c0 = time.perf_counter(), time.thread_time()
    load()
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    stop.set()
    if spinner:
        spinner.join()
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blobs", type=int, default=96)
    ap.add_argument("--shape", type=int, nargs=3, default=(256, 4, 64))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = tuple(args.shape)
    stored = {c: _blobs(args.blobs, shape, c) for c in ("none", "lossless")}
    out_k, out_v = torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.bfloat16)
    one_call = backends.lossless_expand

    def load(compression: str, stages: bool = False) -> Callable[[], None]:
        def run() -> None:
            backends.lossless_expand = (lambda *a, **kw: False) if stages else one_call
            try:
                for b in stored[compression]:
                    kvcodec.decode(b, out_k=out_k, out_v=out_v)
            finally:
                backends.lossless_expand = one_call

        return run

    ways = {
        "plain": load("none"),
        "lossless": load("lossless"),
        "lossless_stage_by_stage": load("lossless", True),
    }
    samples: dict[str, list[tuple[float, float]]] = {f"{w}_{b}": [] for w in ways for b in ("alone", "busy")}
    for _ in range(args.rounds):
        for busy in (False, True):
            for name, run in ways.items():
                samples[f"{name}_{'busy' if busy else 'alone'}"].append(_timed(run, busy))
    med = {
        k: {"wall_ms": round(statistics.median(w for w, _ in v) * 1e3, 2),
            "cpu_ms": round(statistics.median(c for _, c in v) * 1e3, 2)}
        for k, v in samples.items()
    }  # fmt: skip
    result = {"blobs": args.blobs, "shape": list(shape), "rounds": args.rounds, "median": med}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for k, v in med.items():
        print(f"{k:32} wall {v['wall_ms']:8.1f} ms  cpu {v['cpu_ms']:6.1f} ms")


if __name__ == "__main__":
    main()
