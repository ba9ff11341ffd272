"""CPU codec throughput, side by side with LMCache 0.5.6's AsymK16V8Codec when it is installed.

Shape: one layer of 2048 tokens x 8 KV heads x 128 head_dim, fp16, per_page_head,
page_size 16 (LMCache is given the paged view ``[128, 16, 8, 128]`` with page_axis=0).

Bytes moved, written out (E = 2048*8*128 elements):
- encode + to bytes: reads K and V (2E + 2E bytes) and writes the blob
  (2E + E + scales + header); GB/s is quoted over the 4E input bytes.
- from bytes + decode (raw FP8): reads the blob once; from ``bytes`` (read-only)
  the payload is copied out in that same pass (CRC and copy fused: writes 3E), as
  LMCache copies K and V; from a writable buffer (bytearray, the store's
  copy-on-write mmap) K and V are views (reads only). GB/s over the blob's bytes.
- decode with dequant to fp16: reads the blob (copying it out of ``bytes``: 3E
  written), writes V (2E); GB/s over the blob's bytes.

"kvcodec" is the default backend (auto: the C loops of the cpu backend when
built); "kvcodec_torch" the pure-torch reference, measured in the same rounds.
kvcodec writes version-1 blobs here, as LMCache does, so the bytes compare.

Ratios come from interleaved rounds in one run (bench/_ratio.py), so they hold
on a noisy machine; the targets from the codec issue are recorded beside them.
The CI gate checks ``speedup_*_vs_yardstick``: a fixed yardstick workload's
CPU time over kvcodec's, interleaved, from cold caches (``_record``,
``bench/_ratio.py: cpu_speedups``); the wall-clock ratios against memcpy and
LMCache are for reading.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch
from _ratio import cpu_speedups, interleaved, ratio_info

from kvcodec.codec import decode, encode
from kvcodec.format import parse

GATE_ONLY = os.environ.get("KVCODEC_BENCH_GATE") == "1"
"""Set by ``make bench-gate``: only the gated figures (no wall-clock comparison with memcpy and LMCache)."""

lm = None
if not GATE_ONLY:  # importing LMCache takes seconds the gate does not need
    try:
        import lmcache.v1.kv_codec as lm  # type: ignore[import-not-found]
    except Exception:  # pragma: no cover - optional comparison
        lm = None

TOKENS, HEADS, DIM, PAGE = 2048, 8, 128, 16
ELEMS = TOKENS * HEADS * DIM
GATE_ROUNDS = 41
"""Interleaved rounds behind each gated ratio (CPU-time medians; see bench/_ratio.py)."""


@pytest.fixture(scope="module")
def layer() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(TOKENS // PAGE, PAGE, HEADS, DIM, generator=g).half()
    v = (torch.randn(TOKENS // PAGE, PAGE, HEADS, DIM, generator=g) * 2).half()
    return k, v


@pytest.fixture(scope="module")
def blob(layer) -> bytearray:
    k, v = layer
    return encode(k, v, scope="per_page_head", version=1)


def _lm_codec():
    return lm.AsymK16V8Codec(scale_scope=lm.ScaleScope.PER_PAGE_HEAD)


def _fields():
    return dict(chunk_size=TOKENS, page_size=PAGE, kv_head_count=HEADS, head_dim=DIM)


def _memcpy(nbytes: int):
    """A plain one-thread copy of ``nbytes``, timed beside kvcodec for reading (wall clock)."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def _yardstick():
    """Fixed work of the kinds the codec does, over one layer's bytes: a copy of K and V, a CRC of V
    and V's fp16 -> fp32 widening. Its speed moves with the machine's (memory bandwidth, clock, a
    neighbour's load) and never with kvcodec's code: the gate's unit of speed."""
    rng = np.random.default_rng(1)
    kv = rng.integers(0, 256, 4 * ELEMS, dtype=np.uint8)
    kv_out = np.empty_like(kv)
    v16 = rng.standard_normal(ELEMS, dtype=np.float32).astype(np.float16)
    v32 = np.empty(ELEMS, dtype=np.float32)

    def work() -> None:
        np.copyto(kv_out, kv)
        zlib.crc32(v16)
        np.copyto(v32, v16)

    return work


_YARDSTICK = _yardstick()
_SWEEP = np.ones(32 << 20, dtype=np.uint8)
_SWEEP_OUT = np.empty_like(_SWEEP)


def _cold_caches() -> None:
    """Stream 32 MiB (2 x 32 MiB of traffic) through the caches, so that every gated call reads its inputs from memory, as a
    connector's call on a freshly read blob does, whatever other processes left in the shared cache."""
    np.copyto(_SWEEP_OUT, _SWEEP)


def _record(benchmark, fns: dict, nbytes: int, target: float | None, others: dict | None = None) -> None:
    """Time kvcodec's callable(s) beside a memcpy of the same bytes and LMCache's (``others``), interleaved
    on the wall clock for reading; then, for the CI gate, kvcodec's own against the yardstick on CPU time
    (``speedup_*_vs_yardstick``)."""
    gated = cpu_speedups(fns, _YARDSTICK, before=_cold_caches)
    benchmark.extra_info.update({f"speedup_{name}_vs_yardstick": r for name, r in gated.items()})
    if GATE_ONLY:
        return
    every = {**fns, **(others or {}), "memcpy": _memcpy(nbytes)}
    baselines = ("memcpy", *(n for n in every if n.startswith("lmcache")))
    benchmark.extra_info.update(ratio_info(interleaved(every), baselines, nbytes))
    if target is not None and len(baselines) > 1:
        benchmark.extra_info["target_speedup_vs_lmcache"] = target


def test_encode(benchmark, layer):
    k, v = layer
    out = benchmark(lambda: encode(k, v, scope="per_page_head", version=1))
    benchmark.extra_info.update(input_bytes=4 * ELEMS, blob_bytes=len(out))
    fns = {
        "kvcodec": lambda: encode(k, v, scope="per_page_head", version=1),
        "kvcodec_torch": lambda: encode(k, v, scope="per_page_head", version=1, backend="torch"),
    }
    others = {}
    if lm is not None:
        c = _lm_codec()
        others["lmcache"] = lambda: c.to_bytes(c.encode(k, v, page_axis=0, **_fields()))
        assert bytes(out) == others["lmcache"]()  # same bytes, or the comparison is moot
    _record(benchmark, fns, 4 * ELEMS, 3.0, others)


def test_decode_raw(benchmark, blob):
    ref = bytes(blob)
    res = benchmark(lambda: decode(ref))
    assert res.v.dtype == torch.float8_e4m3fn
    fns = {"kvcodec": lambda: decode(ref)}
    others = {}
    if lm is not None:
        c = _lm_codec()
        others["lmcache"] = lambda: c.decode(c.from_bytes(ref))
    _record(benchmark, fns, len(blob), 3.0, others)


def test_decode_dequant_fp16(benchmark, blob):
    ref = bytes(blob)
    res = benchmark(lambda: decode(ref, out_v_dtype=torch.float16))
    assert res.v.dtype == torch.float16 and res.v.shape == (TOKENS, HEADS, DIM)
    fns = {
        "kvcodec_dequant": lambda: decode(ref, out_v_dtype=torch.float16),
        "kvcodec_torch_dequant": lambda: decode(ref, out_v_dtype=torch.float16, backend="torch"),
    }
    others = {}
    if lm is not None:
        c = _lm_codec()
        others["lmcache_raw"] = lambda: c.decode(c.from_bytes(ref))
    _record(benchmark, fns, len(blob), 1.0, others)


def test_decode_raw_writable_buffer(benchmark, blob):
    """The store's path: a writable buffer, K and V returned as views (no copy at all)."""
    res = benchmark(lambda: decode(blob))
    assert res.k.data_ptr() == torch.frombuffer(blob, dtype=torch.uint8).data_ptr() + parse(blob).header_len
    fns = {"kvcodec_views": lambda: decode(blob)}
    others = {}
    if lm is not None:
        c = _lm_codec()
        ref = bytes(blob)
        others["lmcache"] = lambda: c.decode(c.from_bytes(ref))
    _record(benchmark, fns, len(blob), 5.0, others)


def _compat():
    from kvcodec.integrations.lmcache import compat

    return compat.AsymK16V8Codec(scale_scope=compat.ScaleScope.PER_PAGE_HEAD)


def test_compat_encode(benchmark, layer):
    """The drop-in API (encode + to_bytes) beside kvcodec.encode, same bytes (target: within 10%)."""
    k, v = layer
    c = _compat()
    compat_fn = lambda: c.to_bytes(c.encode(k, v, page_axis=0, **_fields()))  # noqa: E731
    assert compat_fn() == bytes(encode(k, v, scope="per_page_head", version=1))
    benchmark(compat_fn)
    fns = {"compat": compat_fn, "kvcodec": lambda: encode(k, v, scope="per_page_head", version=1)}
    benchmark.extra_info.update(ratio_info(interleaved(fns), "kvcodec", 4 * ELEMS))
    benchmark.extra_info["target_speedup_compat_vs_kvcodec_min"] = 0.9


def test_compat_decode(benchmark, blob):
    """from_bytes + decode through the drop-in API beside kvcodec.decode of the same bytes."""
    ref = bytes(blob)
    c = _compat()
    compat_fn = lambda: c.decode(c.from_bytes(ref))  # noqa: E731
    benchmark(compat_fn)
    fns = {"compat": compat_fn, "kvcodec": lambda: decode(ref)}
    benchmark.extra_info.update(ratio_info(interleaved(fns), "kvcodec", len(ref)))
    benchmark.extra_info["target_speedup_compat_vs_kvcodec_min"] = 0.9
