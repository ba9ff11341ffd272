"""Benchmark-suite hooks.

Every benchmark is single-threaded per call: torch's intra-op pool is set to
one thread here, for kvcodec and LMCache alike (kvcodec's own code never
starts threads; scaling comes from the caller's pool, see test_bench_threads.py).

``KVCODEC_BENCH_SLOWDOWN=N`` makes ``kvcodec.codec.encode`` do its work N
times, before the benchmark modules import it: the gate's own test uses it to
show that a real slowdown fails the gate. It exists only in this suite.
"""

from __future__ import annotations

import os

import torch

torch.set_num_threads(1)

_N = int(os.environ.get("KVCODEC_BENCH_SLOWDOWN", "1"))
if _N > 1:
    import kvcodec.codec as _codec

    _real = _codec.encode

    def _slow_encode(*args, **kwargs):
        for _ in range(_N - 1):
            _real(*args, **kwargs)
        return _real(*args, **kwargs)

    _codec.encode = _slow_encode
