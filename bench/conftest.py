"""Benchmark-suite hooks.

Every benchmark is single-threaded per call: torch's intra-op pool is set to
one thread here, for kvcodec and LMCache alike (kvcodec's own code never
starts threads; scaling comes from the caller's pool, see test_bench_threads.py).

``KVCODEC_BENCH_SLOWDOWN=X`` (a factor > 1, e.g. 1.5) makes ``kvcodec.codec.encode``
cost X times its CPU time, before the benchmark modules import it: after each
real call the thread spins for (X - 1) times the CPU time that call took, as
extra work in encode would. The gate's self-test uses it to show that a real
slowdown fails the gate. It exists only in this suite.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# The benchmarks import their helpers (_ratio) from this folder; pytest's importlib mode puts no
# folder on sys.path (the repo root must never be there: its kernels/ would shadow `kernels`).
sys.path.insert(0, str(Path(__file__).resolve().parent))
torch.set_num_threads(1)

_FACTOR = float(os.environ.get("KVCODEC_BENCH_SLOWDOWN", "1"))
if _FACTOR > 1:
    import time

    import kvcodec.codec as _codec

    _real = _codec.encode

    def _slow_encode(*args, **kwargs):
        c0 = time.thread_time()
        out = _real(*args, **kwargs)
        until = time.thread_time() + (_FACTOR - 1) * (time.thread_time() - c0)
        while time.thread_time() < until:
            pass
        return out

    _codec.encode = _slow_encode
