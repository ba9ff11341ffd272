"""The optional lanes: declared on the interface, offered per backend, run through ``backends.call``.

A lane returns one typed result or raises ``Declined``; ``call`` then runs the caller's ``fallback``
(or the reference's op) and counts the reason. The integrations reach the C cache lanes only through
``kvcodec.backends`` (an import contract).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec import backends
from kvcodec.backends import LANES, BlobRows, Declined, Groups, Served, reference
from kvcodec.backends.base import Lanes
from kvcodec.numerics import ScaleScope


def _fallbacks(op: str) -> int:
    return sum(f["count"] for f in backends.backend_info()["fallbacks"] if f["op"] == op)


def test_every_backend_names_its_lanes_and_declines_the_rest() -> None:
    ref = reference.BACKEND
    assert isinstance(ref, Lanes) and ref.lanes == frozenset()
    for lane in LANES:
        assert callable(getattr(ref, lane))
    with pytest.raises(Declined, match="no encode_host lane"):
        ref.encode_host(None, None, None, memoryview(b""), scale_dtype=torch.float32, nonfinite="error")
    cpu = backends.select("auto", "cpu")
    if cpu.name == "cpu":
        assert cpu.lanes == {
            "encode_host",
            "decode_host",
            "expand_dequant",
            "scatter_rows",
            "scatter_blob_rows_many",
        }
    assert all(lane in LANES for lane in cpu.lanes)


def test_call_runs_the_callers_fallback_and_counts_it() -> None:
    class Declines(Lanes):
        name = "declines"

    before = _fallbacks("encode_host")
    got = backends.call(
        Declines(), "encode_host", 1, 2, 3, 4, scale_dtype=None, nonfinite="error", fallback=lambda: "own"
    )
    assert got == "own" and _fallbacks("encode_host") == before + 1


T, H, D, N, S = 24, 2, 16, 4, 8
RUNS = np.array([[1, 0, 0, 8], [3, 0, 8, 8], [0, 0, 16, 8]], np.int64)


def _cache(dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.zeros(N, H, S, 2 * D, dtype=dtype)


@pytest.mark.skipif(not backends.cache_lanes_available(), reason="kvcodec._cpu is not built")
def test_scatter_rows_through_the_backend_layer() -> None:
    rows = torch.randn(T, H, D).to(torch.float16)
    cache = _cache()
    called = []
    backends.scatter_rows(rows, cache, D, RUNS, fallback=lambda: called.append(1))
    assert not called and torch.equal(cache[1, :, :8, D:].transpose(0, 1), rows[:8])
    before = _fallbacks("scatter_rows")
    backends.scatter_rows(rows.float(), cache, D, RUNS, fallback=lambda: called.append(1))  # another dtype
    assert called == [1] and _fallbacks("scatter_rows") == before + 1


@pytest.mark.skipif(not backends.cache_lanes_available(), reason="kvcodec._cpu is not built")
def test_scatter_blob_rows_many_types_each_layer() -> None:
    groups = Groups(ScaleScope.PER_LAYER_HEAD, None, torch.float8_e4m3fn)
    codes = (torch.arange(T * H * D, dtype=torch.int32) % 0x70).to(torch.uint8).reshape(T, H, D).numpy()
    bad = codes.copy()
    bad[3, 1, 2] = 0x7F  # a NaN code: that layer declines
    k = np.zeros((T, H, 2 * D), np.uint8)
    scales = np.full(H, 0.5, np.float32)
    writes = [(BlobRows(k, c, scales, groups), _cache(), None) for c in (codes, bad)]
    before = _fallbacks("scatter_blob_rows_many")
    got = backends.scatter_blob_rows_many(writes, D, RUNS)
    assert got == [Served(), None] and _fallbacks("scatter_blob_rows_many") == before + 1
    assert not writes[1][1].any()  # nothing written where it declined
