"""The lossless stage against the copy limit (issue 38): encode and decode with
``compression="lossless"`` as fractions of a same-run memcpy of the raw K+V, on one core.

One layer of 2048 tokens x 8 KV heads x 128 head_dim, bf16, cut into 256-token blobs
(per_page_head, page 16) as a connector stores them. K is built like a real model's: each channel
its own magnitude (a lognormal scale) times a smooth signal, so its exponent plane codes as real K's
does; V is Gaussian. The jobs:

- ``lossless_encode``: the eight blobs encoded with ``compression="lossless"``;
- ``lossless_decode``: the eight lossless blobs decoded into reused K and fp16... bf16 V tensors;
- ``plain_encode`` / ``plain_decode``: the same without compression, for reading beside them.

The yardstick is ``numpy.copyto`` of the layer's raw K+V (8 MiB), in the same interleaved rounds on
the thread's CPU time (bench/_ratio.py). ``make bench-gate`` holds the lossless ratios to floors in
bench/baseline.json (the issue's targets since the fourth session below, the slowest run measured
before it; the gate fails below 80% of them); the issue's targets (decode
>= 0.15, encode >= 0.10 of memcpy) are recorded beside them (every run of the fourth session below is
over them, at least 0.130 / 0.192 where plain encode ran at 0.36-0.37 of memcpy, a fast phase). With
the Huffman coder (kvcodec/csrc/huff.c, schemes 5/6) and the decode that expands the streams straight into a
reused plain payload (no plain blob written or parsed), this bench measured decode 0.104-0.117 and
encode 0.075-0.084 (2026-12-05, the shared 2-core VM, five runs; plain decode 0.40-0.45, encode
0.33-0.37 in the same rounds), up from decode 0.091-0.100 through the plain blob, and from 0.044
each with raw deflate; 2026-12-06, three runs: decode 0.115-0.120, encode 0.082-0.085; later that day on
a Xeon host, with V's streams decoded two at a time and K merged into ``out_k``: decode 0.126-0.182,
encode 0.081-0.125 over fourteen runs, the host's load moving the ratios more than the code does
(docs/quality.md: the builds side by side in one process, and where the time goes); with V's codes
split (schemes 7/8: V's exponents coded, signs and mantissas raw), on an EPYC host, three runs:
decode 0.140-0.158, encode 0.080-0.086 (0.102-0.110 and 0.070-0.076 before, same host and session);
with V's exponents coded two at a time, three runs: decode 0.141-0.148, encode 0.091-0.095; with the
decode tables built for less and 32-bit histograms, five runs (one the gate's): decode 0.147-0.172,
encode 0.091-0.107; with a section's streams sharing code lengths (tables built once a section) and K's
symbols coded two a lookup, nine runs: decode 0.147-0.174, encode 0.095-0.112 (the low ends where the
plain ratios fell too: the host's slower phases); with the decoder's drifting lanes finished in runs and
a blob's expansion in one C call, nine runs: decode 0.129-0.226, encode 0.083-0.142 (the lows in one slow
phase, plain 0.35 / 0.47 in that run); with V's and bf16 K's symbols counted by AVX2 compares, K fetched
ahead of its split and V's runs of five a lookup, eighteen runs beside the build before in a fast-memcpy
phase (plain encode 0.35-0.38): encode 0.096-0.105 against 0.087-0.120, 10-11% more beside plain encode;
decode 0.147-0.163 against 0.145-0.197, 2% more (docs/quality.md); with a decode's checks kept
per thread, V dequantized in the expanding call and the counts in AVX-512 mask registers, fourteen runs
beside that build in a slow-memcpy phase (plain encode 0.38-0.61): encode 0.133-0.223, decode
0.197-0.324, 9.6% and 5.8% more beside the plain ratios.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _ratio import cpu_speedups

import kvcodec

TOKENS, HEADS, DIM, PAGE, BLOB = 2048, 8, 128, 16, 256
COPY_BYTES = 2 * 2 * TOKENS * HEADS * DIM
TARGETS = {"lossless_encode": 0.10, "lossless_decode": 0.15}
"""Issue 38's floors for each ratio to memcpy (recorded for reading, not gated)."""
OPTIONS = {"scope": "per_page_head", "page_size": PAGE}


@pytest.fixture(scope="module")
def layer() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(1, HEADS, DIM, generator=g) * 1.5)
    t = torch.arange(TOKENS, dtype=torch.float32)[:, None, None]
    k = scale * (
        torch.sin(t / 11 + torch.randn(1, HEADS, DIM, generator=g) * 3)
        + 0.3 * torch.randn(TOKENS, HEADS, DIM, generator=g)
    )
    v = torch.randn(TOKENS, HEADS, DIM, generator=g)
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


def _blobs(k: torch.Tensor, v: torch.Tensor, **kw) -> list:
    return [kvcodec.encode(k[s : s + BLOB], v[s : s + BLOB], **OPTIONS, **kw) for s in range(0, TOKENS, BLOB)]


def _decode_job(blobs: list):
    out_k = torch.empty(BLOB, HEADS, DIM, dtype=torch.bfloat16)
    out_v = torch.empty_like(out_k)
    return lambda: [kvcodec.decode(b, out_k=out_k, out_v=out_v) for b in blobs]


def _memcpy():
    src = np.random.default_rng(0).integers(0, 256, COPY_BYTES, dtype=np.uint8)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def test_lossless_copy_limit(benchmark, layer):
    """Lossless encode and decode (and plain, for reading) as fractions of the same-run memcpy."""
    k, v = layer
    plain, coded = _blobs(k, v), _blobs(k, v, compression="lossless")
    back = kvcodec.decode(coded[0], out_v_dtype=torch.bfloat16)
    assert torch.equal(back.k, k[:BLOB])  # the jobs below do the real work
    jobs = {
        "kvcodec_lossless_encode": lambda: _blobs(k, v, compression="lossless"),
        "kvcodec_lossless_decode": _decode_job(coded),
        "plain_encode": lambda: _blobs(k, v),
        "plain_decode": _decode_job(plain),
    }
    benchmark(jobs["kvcodec_lossless_decode"])
    ratios = cpu_speedups(jobs, _memcpy(), blocks=5, rounds=7)
    benchmark.extra_info.update({f"speedup_{n}_vs_yardstick": r for n, r in ratios.items()})
    benchmark.extra_info.update({f"target_kvcodec_{n}_vs_memcpy": t for n, t in TARGETS.items()})
    raw = 2 * k.numel() * k.element_size()
    benchmark.extra_info.update(
        yardstick="numpy.copyto of 8 MiB (the layer's raw K+V)",
        copy_bytes=COPY_BYTES,
        plain_blob_ratio=sum(map(len, plain)) / raw,
        lossless_blob_ratio=sum(map(len, coded)) / raw,
        coder=kvcodec.codec.lossless.CODER,
    )
