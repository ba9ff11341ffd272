"""Peak extra memory of an encode: the output plus a fixed bound, never a full-size fp32 V.

Each measurement runs in a fresh subprocess: inputs are built, the kernel's
peak-RSS mark is reset (``/proc/self/clear_refs`` = 5), one encode runs, and
``VmHWM - RSS before`` is the extra memory it needed. A layer of 16384 tokens x
8 heads x 128 (fp16) has a 32 MiB V: an fp32 copy of it alone would add 64 MiB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXED_BOUND = 16 * 2**20
"""Scratch blocks, per-token scales, allocator slack: independent of the layer's size."""

_CHILD = r"""
import json, re, sys, torch
torch.manual_seed(0)
T, H, D = int(sys.argv[1]), 8, 128
k = torch.randn(T // 16, 16, H, D).half()
v = (torch.randn(T // 16, 16, H, D) * 3).half()
which = sys.argv[2]
if which == "lmcache":
    import lmcache.v1.kv_codec as lm
    c = lm.AsymK16V8Codec(scale_scope=lm.ScaleScope.PER_PAGE_HEAD)
    run = lambda: c.to_bytes(c.encode(k, v, page_axis=0))
else:
    from kvcodec import encode
    run = lambda: encode(k, v, scope="per_page_head")
run()  # warm up imports and one-time allocations
import gc; gc.collect()
def status(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
out = run()
peak = status("VmHWM")
print(json.dumps({"extra": peak - before, "output": len(out), "v_bytes": v.numel() * 2}))
"""


def _measure(which: str, tokens: int) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tokens), which],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-2000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_encode_peak_memory_is_output_plus_fixed_bound(benchmark):
    tokens = 16384
    m = benchmark.pedantic(_measure, args=("kvcodec", tokens), rounds=1, iterations=1)
    benchmark.extra_info.update(m, fixed_bound=FIXED_BOUND, tokens=tokens)
    assert m["extra"] <= m["output"] + FIXED_BOUND, m
    assert m["extra"] < m["output"] + 2 * m["v_bytes"]  # would fail with an fp32 copy of V


def test_lmcache_peak_memory_for_comparison(benchmark):
    pytest.importorskip("lmcache.v1.kv_codec", reason="LMCache 0.5.6 not installed (make lmcache)")
    m = benchmark.pedantic(_measure, args=("lmcache", 16384), rounds=1, iterations=1)
    benchmark.extra_info.update(m)
