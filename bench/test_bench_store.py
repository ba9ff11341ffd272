"""DirectoryStore throughput: put and get+parse of a ~6 MiB LMCKV blob, with and without fsync.

Run ``pytest bench/test_bench_store.py --benchmark-enable``; GB/s lands in
``extra_info``. With ``--benchmark-disable`` (the default addopts) each case
runs once as a plain correctness test.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvcodec.format import Hashes, Header, ScaleScope, assemble, parse
from kvcodec.store import DirectoryStore

BLOB_PAYLOAD = 6 << 20


def _blob() -> bytes:
    rng = np.random.default_rng(0)
    half = BLOB_PAYLOAD // 2
    h = Header(
        k_dtype=torch.float16,
        v_dtype=torch.float16,
        scale_scope=ScaleScope.EXTERNAL,
        version=2,
        hashes=Hashes(model_id="bench"),
    )
    return bytes(assemble(h, rng.bytes(half), rng.bytes(half)))


BLOB = _blob()


def _gbps(benchmark: Any, fn: Callable[[], object]) -> None:
    """Run ``fn`` under the benchmark and record GB/s (from its stats, or one timed call)."""
    t0 = time.perf_counter()
    benchmark(fn)
    elapsed = time.perf_counter() - t0
    stats = getattr(benchmark, "stats", None)
    mean = stats.stats.mean if stats is not None else elapsed
    benchmark.extra_info["blob_bytes"] = len(BLOB)
    benchmark.extra_info["GB/s"] = round(len(BLOB) / mean / 1e9, 3) if mean > 0 else None


@pytest.mark.parametrize("fsync", [False, True], ids=["nofsync", "fsync"])
def test_bench_put(benchmark: Any, tmp_path: Path, fsync: bool) -> None:
    st = DirectoryStore(tmp_path, fsync=fsync)

    def put() -> None:
        st.put("k", BLOB)  # overwrite: atomic replace of the same key each round

    _gbps(benchmark, put)
    assert bytes(st.get(st.keys()[0])) == BLOB


@pytest.mark.parametrize("fsync", [False, True], ids=["nofsync", "fsync"])
def test_bench_get_parse(benchmark: Any, tmp_path: Path, fsync: bool) -> None:
    st = DirectoryStore(tmp_path, fsync=fsync)
    st.put("k", BLOB)

    def get_parse() -> int:
        view = st.get("k")  # mmap + parse with CRC
        return parse(view, verify_crc=False).header.payload_len

    _gbps(benchmark, get_parse)
    assert get_parse() == BLOB_PAYLOAD
