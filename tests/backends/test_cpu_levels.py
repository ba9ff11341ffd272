"""The C library's levels: chosen once at import (KVCODEC_CPU_LEVEL caps them), and level-bound objects.

``kvcodec._cpu.Level(simd, crc, paged)`` carries the codec's entry points bound to one level, each capped
at what this CPU and build run; every level writes the same bytes. ``KVCODEC_CPU_LEVEL`` is read once,
when the module is imported (here in child processes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

from kvcodec.backends.cpu import AVAILABLE

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="kvcodec._cpu is not built")


def _cpu():
    from kvcodec import _cpu

    return _cpu


def _levels() -> list:
    """Every level, and each with the AVX-512 folds and tables emulated (their driver paths, any CPU)."""
    m = _cpu()
    grid = [(s, c, p, e) for s in range(3) for c in range(3) for p in (0, 1) for e in (0, 1)]
    return [m.Level(simd=s, crc=c, paged=p, emulate=e) for s, c, p, e in grid]


def test_a_level_is_capped_at_the_best_and_leaves_the_default_alone() -> None:
    m = _cpu()
    before = (m.simd(-1), m.crc_fast(-1), m.paged(-1))
    top = m.Level(simd=9, crc=9)
    assert (top.simd, top.crc, top.paged) == (m.BEST_SIMD, m.BEST_CRC, 1)
    assert m.Level(simd=0, crc=0, paged=0).simd == 0
    assert (m.simd(-1), m.crc_fast(-1), m.paged(-1)) == before


DTYPES = {0: np.float16, 1: "bf16", 2: np.float32}


def _layer(tokens: int, d: int, vdt: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, 4, d)).astype(np.float32) * 3
    if vdt == 1:  # bf16 as its 16-bit patterns (round to nearest even)
        b = x.view(np.uint32)
        v = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    else:
        v = x.astype(DTYPES[vdt])
    k = rng.standard_normal((tokens, 4, d)).astype(np.float16).view(np.uint8).reshape(-1)
    return v, k


def _groups(scope: int, tokens: int, page: int) -> int:
    return {0: 1, 1: 4, 2: -(-tokens // page) * 4}[scope]


def _encode(lv, v: np.ndarray, k: np.ndarray, vdt: int, scope: int, page: int):
    blob = np.empty(k.size + v.size // v.shape[-1] * v.shape[-1], np.uint8)
    q = blob[k.size :].reshape(v.shape)
    scales = np.empty(_groups(scope, v.shape[0], page), np.float32)
    got = lv.encode_v(v, vdt, scope, page, 0, q, scales, k, blob[: k.size], 0)
    return got, blob, q, scales


@pytest.mark.parametrize("d", [128, 64, 17])
@pytest.mark.parametrize("vdt", [0, 1, 2])
@pytest.mark.parametrize("scope,page", [(2, 16), (2, 5), (1, 1), (0, 1)])
def test_every_level_writes_the_same_blob_bytes_and_crc(d: int, vdt: int, scope: int, page: int) -> None:
    v, k = _layer(100, d, vdt)
    results = set()
    for lv in _levels():
        crc, blob, q, scales = _encode(lv, v, k, vdt, scope, page)
        want = zlib.crc32(blob.tobytes())
        assert crc in (None, want), (lv.simd, lv.crc, lv.paged)
        assert (crc is None) == (lv.crc == 0)
        outs = []
        for odt in (0, 1, 2):
            out = np.empty(v.shape, DTYPES[odt] if odt != 1 else np.uint16)
            k_out = np.empty(k.size, np.uint8)
            got = lv.dequantize(q, scales, scope, page, out, odt, blob[: k.size], k_out, 0)
            assert got in (None, want) and (got is None) == (lv.crc == 0)
            assert np.array_equal(k_out, k)
            outs.append(out.tobytes())
        results.add((blob.tobytes(), scales.tobytes(), *outs))
    assert len(results) == 1


@pytest.mark.parametrize("d", [128, 17])
def test_every_level_declines_nan_the_same_way(d: int) -> None:
    v, k = _layer(64, d, 0, seed=3)
    v[40, 2, 5] = np.nan  # page 2 of 4 at page 16: a page-by-page encode has written pages 0-1
    for lv in _levels():
        got, blob, q, _ = _encode(lv, v, k, 0, 2, 16)
        assert isinstance(got, str) and "NaN" in got, (lv.simd, lv.crc, lv.paged)
    good, _ = _layer(64, d, 0, seed=4)
    for lv in _levels():
        _, blob, q, scales = _encode(lv, good, k, 0, 2, 16)
        q[33, 1, 3] = 0x7F  # a NaN code mid-way: the decode stops before its row
        out = np.zeros(good.shape, np.float16)
        got = lv.dequantize(q, scales, 2, 16, out, 0, blob[: k.size], np.empty(k.size, np.uint8), 0)
        assert got == "q holds NaN codes", (lv.simd, lv.crc, lv.paged)
        assert not out[34:].any()  # nothing past the row (rows after it are unwritten)


def test_crc32_at_every_level_is_zlibs() -> None:
    data = np.random.default_rng(1).integers(0, 256, 3000, dtype=np.uint8).tobytes()
    for lv in _levels():
        assert lv.crc32(data, 7) == zlib.crc32(data, 7)


def _child_levels(value: str | None) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k != "KVCODEC_CPU_LEVEL"}
    if value is not None:
        env["KVCODEC_CPU_LEVEL"] = value
    code = "import kvcodec._cpu as m; print(m.BEST_SIMD, m.BEST_CRC, m.simd(-1), m.crc_fast(-1))"
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, check=True
    )
    best_simd, best_crc, simd, crc = map(int, out.stdout.split())
    assert (simd, crc) == (best_simd, best_crc)  # the default is the best the variable allows
    return best_simd, best_crc


def test_the_environment_caps_the_level_at_import() -> None:
    m = _cpu()
    assert _child_levels(None) == (m.BEST_SIMD, m.BEST_CRC) or "KVCODEC_CPU_LEVEL" in os.environ
    assert _child_levels("scalar") == (0, 0)
    assert _child_levels("0") == (0, 0)
    assert _child_levels("AVX2") == (min(1, m.BEST_SIMD), min(1, m.BEST_CRC))
    assert _child_levels("avx512") == _child_levels(None)
    assert _child_levels("bogus") == _child_levels(None)
