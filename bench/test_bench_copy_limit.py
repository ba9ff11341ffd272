"""The CPU codec against the copy limit: encode and decode as fractions of a same-run memcpy (issue 28).

One layer of 2048 tokens x 8 KV heads x 128 head_dim, fp16, per_page_head with
page_size 16 (the default version-2 blob, CRC over header and payload). Each job
writes into memory it reuses, as a connector does:

- encode: ``encode(k, v, out=buf)`` into one reused buffer (reads K and V, 8 MiB;
  writes the 6 MiB blob);
- decode: ``decode(blob, out_k=, out_v=)`` into reused tensors (reads the 6 MiB
  blob, CRC checked; writes K and V dequantized to fp16, 8 MiB);
- decode into a vLLM CPU block layout: the connector's load of one layer
  (``parse`` with its CRC check, then :func:`kvcodec.backends.cpu.scatter_blob_rows`
  writing K and V dequantized into ``[blocks, heads, 16 slots, K | V]`` by block id,
  the blocks in shuffled order); and the same with the CRC carried by that C pass instead of
  the parser (``decode_vllm_crc_in_pass``: what the connector's load could do, see
  ``scatter_blob_rows(crc=)``).

The yardstick is ``numpy.copyto`` of 8 MiB (the larger side of either job), run
in the same interleaved rounds on the thread's CPU time (bench/_ratio.py):
``speedup_kvcodec_<job>_vs_yardstick`` = memcpy's CPU time / the job's, so 1.0
means "as fast as copying the bytes once". ``make bench-gate`` holds these
ratios to the floors in bench/baseline.json; the issue's targets are recorded
beside them (encode >= 0.60, decode >= 0.85). ``test_encode_page_by_page`` gates
the page-by-page encode against the two passes over V, from cold caches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _ratio import cpu_speedups

from kvcodec.backends import Groups
from kvcodec.backends.cpu import AVAILABLE, BlobRows, scatter_blob_rows
from kvcodec.codec import decode, encode
from kvcodec.format import ScaleScope, parse, payload_crc
from kvcodec.format.crc import crc32

TOKENS, HEADS, DIM, PAGE, BLOCK = 2048, 8, 128, 16, 16
COPY_BYTES = 2 * 2 * TOKENS * HEADS * DIM
"""K and V in fp16: the 8 MiB the yardstick copies."""
L3_EVICT_BYTES = 64 << 20
"""What the page-by-page bench copies before each call: twice this machine's 32 MiB L3."""
TARGETS = {"encode": 0.60, "decode": 0.85, "decode_vllm": 0.85, "decode_vllm_crc_in_pass": 0.85}
"""The issue's floors for each job's ratio to memcpy (recorded for reading, not gated)."""


@pytest.fixture(scope="module")
def layer() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(TOKENS, HEADS, DIM, generator=g).half()
    v = (torch.randn(TOKENS, HEADS, DIM, generator=g) * 2).half()
    return k, v


def _memcpy():
    src = np.random.default_rng(0).integers(0, 256, COPY_BYTES, dtype=np.uint8)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def _encode_job(k: torch.Tensor, v: torch.Tensor):
    out = bytearray(len(encode(k, v, scope="per_page_head", page_size=PAGE)))
    return lambda: encode(k, v, scope="per_page_head", page_size=PAGE, out=out)


def _decode_job(blob: bytearray):
    out_k = torch.empty(TOKENS, HEADS, DIM, dtype=torch.float16)
    out_v = torch.empty_like(out_k)
    return lambda: decode(blob, out_k=out_k, out_v=out_v)


def _vllm_job(blob: bytearray, fused: bool = False):
    """One layer's load as the connector's CPU path does it: parse (CRC), then one C pass into the
    cache; ``fused``: parse without the CRC and let that C pass carry it (``scatter_blob_rows(crc=)``)."""
    blocks = TOKENS // BLOCK
    cache = torch.empty(2 * blocks, HEADS, BLOCK, 2 * DIM, dtype=torch.float16)
    order = np.random.default_rng(2).permutation(2 * blocks)[:blocks]
    runs = np.stack([order, np.zeros(blocks), np.arange(blocks) * BLOCK, np.full(blocks, BLOCK)], 1)
    runs = np.ascontiguousarray(runs.astype(np.int64))
    groups = Groups(ScaleScope.PER_PAGE_HEAD, PAGE, torch.float8_e4m3fn)

    def job() -> None:
        p = parse(blob, verify_crc=not fused)
        h, at, buf = p.header, p.header_len, p.buffer
        k_len, v_len = h.k_payload_len, h.v_payload_len
        k = np.frombuffer(buf, np.uint8, k_len, at).reshape(TOKENS, HEADS, 2 * DIM)
        codes = np.frombuffer(buf, np.uint8, v_len, at + k_len).reshape(TOKENS, HEADS, DIM)
        scales = np.frombuffer(
            buf, np.float32, h.scale_payload_len // 4, at + k_len + v_len
        ).copy()  # as chunks.py
        rows = BlobRows(k, codes, scales.reshape(h.scale_shape), groups)
        got = scatter_blob_rows(  # raises Declined if C declines
            rows, cache, DIM, runs, crc=payload_crc(h, p.crc_prefix, ()) if fused else None
        ).crc
        if fused:
            end = at + k_len + v_len
            crc = crc32(buf[end : end + h.scale_payload_len], got) if got is not None else p.crc
            if crc != p.crc:
                raise RuntimeError("CRC mismatch")

    return job


@pytest.mark.skipif(not AVAILABLE, reason="kvcodec._cpu is not built")
def test_copy_limit(benchmark, layer):
    """Encode, decode and decode into vLLM blocks, each as a fraction of the same-run 8 MiB memcpy."""
    k, v = layer
    blob = encode(k, v, scope="per_page_head", page_size=PAGE)
    back = decode(blob, out_v_dtype=torch.float16)
    assert torch.equal(back.k, k)  # the jobs below do the real work, not a declined shortcut
    jobs = {
        "encode": _encode_job(k, v),
        "decode": _decode_job(blob),
        "decode_vllm": _vllm_job(blob),
        "decode_vllm_crc_in_pass": _vllm_job(blob, fused=True),
    }
    benchmark(jobs["encode"])
    ratios = cpu_speedups({f"kvcodec_{n}": f for n, f in jobs.items()}, _memcpy(), blocks=7, rounds=15)
    benchmark.extra_info.update({f"speedup_{n}_vs_yardstick": r for n, r in ratios.items()})
    benchmark.extra_info.update({f"target_kvcodec_{n}_vs_memcpy": t for n, t in TARGETS.items()})
    from kvcodec import _cpu

    benchmark.extra_info.update(
        yardstick="numpy.copyto of 8 MiB",
        copy_bytes=COPY_BYTES,
        blob_bytes=len(blob),
        c_simd_level=_cpu.simd(-1),
        c_crc_level=_cpu.crc_fast(-1),  # the floors assume 2 and 2
    )


@pytest.mark.skipif(not AVAILABLE, reason="kvcodec._cpu is not built")
def test_encode_page_by_page(benchmark, layer):
    """The same encode page by page (the default) against the two passes over V (``_cpu.paged(0)``),
    in the same interleaved rounds, each call after a copy that pushes the layer out of the caches:
    the yardstick here is the two-pass encode, so the gated ratio says what reading V from memory once
    saves, whatever the machine's phase (1.0: nothing; with the layer still in L3 it is about 1.0)."""
    from kvcodec import _cpu

    k, v = layer
    encode_job = _encode_job(k, v)

    def way(paged: int):
        def job() -> None:
            prev = _cpu.paged(paged)
            try:
                encode_job()
            finally:
                _cpu.paged(prev)

        return job

    if not _cpu.paged(-1):
        pytest.skip("the page-by-page encode is switched off in this process")
    benchmark(encode_job)
    evict = np.zeros(2 * L3_EVICT_BYTES, dtype=np.uint8)  # K and V come from memory, as after a step

    def before() -> None:
        evict[:L3_EVICT_BYTES] = evict[L3_EVICT_BYTES:]

    ratios = cpu_speedups({"kvcodec_encode_paged": way(1)}, way(0), blocks=7, rounds=15, before=before)
    benchmark.extra_info.update({f"speedup_{n}_vs_yardstick": r for n, r in ratios.items()})
    benchmark.extra_info.update(yardstick="the same encode in two passes over V", c_simd_level=_cpu.simd(-1))
