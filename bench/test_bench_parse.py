"""Parse throughput of a ~6 MiB LMCKV blob (CRC included), against zlib.crc32 and LMCache's from_bytes;
the cost of the stored-scale check beside a decode of the benchmark layer.

`make bench` runs these with --benchmark-enable; under the default --benchmark-disable
they run once each, as plain tests.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kvcodec import decode, encode
from kvcodec.format import Hashes, Header, ScaleScope, assemble, check_stored_scales, parse
from kvcodec.format.crc import CRC_BACKEND, crc32

TOKENS, HEADS, DIM, PAGE = 2048, 8, 128, 16


@pytest.fixture(scope="module")
def blob() -> bytearray:
    rng = np.random.default_rng(0)
    n = TOKENS * HEADS * DIM
    k = rng.integers(0, 256, size=2 * n, dtype=np.uint8)  # fp16 K bytes
    v = rng.integers(0, 256, size=n, dtype=np.uint8)  # fp8 V bytes
    pages = -(-TOKENS // PAGE)
    scales = rng.uniform(1e-3, 1.0, (pages, HEADS)).astype(np.float32)  # as encode writes them: > 0
    h = Header(
        k_dtype=torch.float16,
        v_dtype=torch.float8_e4m3fn,
        scale_scope=ScaleScope.PER_PAGE_HEAD,
        layer_id=0,
        chunk_id=0,
        chunk_size=TOKENS,
        page_size=PAGE,
        kv_head_count=HEADS,
        head_dim=DIM,
        scale_shape=(pages, HEADS),
        hashes=Hashes(model_id="bench/model", kv_layout="NHD"),
    )
    return assemble(h, k, v, scales)


def _record(benchmark, nbytes: int, crc_backend: str) -> None:
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["crc_backend"] = crc_backend
    if benchmark.stats:  # None under --benchmark-disable
        benchmark.extra_info["GB/s"] = round(nbytes / benchmark.stats["mean"] / 1e9, 3)


def test_bench_parse(benchmark, blob: bytearray) -> None:
    assert 6 << 20 <= len(blob) < 7 << 20
    p = benchmark(parse, blob)
    assert p.header.num_tokens == TOKENS and len(p.payload) + p.header_len == len(blob)
    _record(benchmark, len(blob), CRC_BACKEND)


def test_bench_zlib_crc32(benchmark, blob: bytearray) -> None:
    crc = benchmark(zlib.crc32, blob)
    assert crc == crc32(blob)
    p = parse(blob)
    assert zlib.crc32(p.payload) == p.crc
    _record(benchmark, len(blob), "zlib")


def test_bench_parse_vs_lmcache(benchmark, blob: bytearray) -> None:
    """parse + CRC against LMCache 0.5.6's from_bytes of the same bytes (interleaved; target >= 4x)."""
    lm = pytest.importorskip("lmcache.v1.kv_codec", reason="LMCache 0.5.6 not installed (make lmcache)")
    from _ratio import interleaved, ratio_info

    ref = bytes(blob)
    codec = lm.AsymK16V8Codec(scale_scope=lm.ScaleScope.PER_PAGE_HEAD)
    benchmark(parse, ref)
    fns = {"kvcodec_parse": lambda: parse(ref), "lmcache": lambda: codec.from_bytes(ref)}
    benchmark.extra_info.update(ratio_info(interleaved(fns), "lmcache", len(ref)))
    benchmark.extra_info["target_speedup_vs_lmcache"] = 4.0


def test_bench_stored_scale_check(benchmark) -> None:
    """The stored-scale check (part of every parse) against a decode of the codec benchmark's layer.

    Same layer as bench/test_bench_codec.py (2048 x 8 x 128 fp16, per_page_head, page 16:
    1,024 fp32 scales), all timed in one interleaved run. Target: the check costs at most
    2% of a decode (``scale_check_share_of_*`` <= 0.02).
    """
    from _ratio import interleaved, ratio_info

    g = torch.Generator().manual_seed(0)
    k = torch.randn(TOKENS // PAGE, PAGE, HEADS, DIM, generator=g).half()
    v = (torch.randn(TOKENS // PAGE, PAGE, HEADS, DIM, generator=g) * 2).half()
    blob = encode(k, v, scope="per_page_head", version=1)
    ref = bytes(blob)
    p = parse(blob)
    assert p.header.scale_shape == (TOKENS // PAGE, HEADS)
    benchmark(check_stored_scales, p.header, p.scales)

    def check_x100() -> None:  # one call is ~1000x shorter than a decode: timed 100 at a time
        for _ in range(100):
            check_stored_scales(p.header, p.scales)

    fns = {
        "scale_check_x100": check_x100,
        "parse": lambda: parse(ref),
        "decode_raw": lambda: decode(ref),
        "decode_views": lambda: decode(blob),
        "decode_dequant_fp16": lambda: decode(ref, out_v_dtype=torch.float16),
    }
    medians = interleaved(fns, rounds=51)
    check = medians.pop("scale_check_x100") / 100
    benchmark.extra_info["scale_check_us"] = round(check * 1e6, 3)
    benchmark.extra_info.update(ratio_info(medians, (), len(ref)))
    for name, sec in medians.items():
        benchmark.extra_info[f"scale_check_share_of_{name}"] = round(check / sec, 4)
    benchmark.extra_info["target_scale_check_share_of_decode"] = 0.02
