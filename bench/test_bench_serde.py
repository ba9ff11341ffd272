"""LMCache serdes side by side: kvcodec's vs LMCache 0.5.6's built-in ``fp8``, through LMCache's processor.

Each round submits a batch of objects to LMCache's own ``AsyncSerdeProcessor``
(built by ``create_serde_processor`` from the JSON a user writes) and waits for
its completion, as LMCache's storage controllers do. Object: one 256-token
chunk of 8 layers, 8 KV heads x 128, bf16 (``[2, 8, 256, 1024]``, 8 MiB).

GB/s is over the KV bytes (the object in L1) for both directions; ``stored``
is what the L2 adapter writes per object. kvcodec keeps K bit-exact (16 bits)
and V in FP8 with per-page-head scales; ``fp8`` casts K and V both to FP8
without scales (lossy K, and values beyond ±448 saturate).
Skipped without LMCache (``make lmcache-full``).
"""

from __future__ import annotations

import time

import pytest
import torch

serde_mod = pytest.importorskip(
    "lmcache.v1.distributed.serde",
    reason="LMCache 0.5.6 distributed storage not installed (make lmcache-full)",
)
from lmcache.v1.distributed.api import MemoryLayoutDesc  # noqa: E402
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj  # noqa: E402

import kvcodec.integrations.lmcache.serde  # noqa: E402,F401 - registers "kvcodec"

SHAPE = (2, 8, 256, 8 * 128)
BATCH = 4
KV_BYTES = torch.Size(SHAPE).numel() * 2
SERDES = {
    "kvcodec": {"head_dim": 128, "page_size": 16, "model": "bench"},
    "fp8": {"fp8_dtype": "float8_e4m3fn"},
}


def _obj(shape, dtype, data=None):
    size = torch.Size(shape)
    raw = torch.zeros(size.numel() * dtype.itemsize, dtype=torch.uint8)
    meta = MemoryObjMetadata(
        shape=size, dtype=dtype, address=0, phy_size=raw.numel(), ref_count=1, shapes=[size], dtypes=[dtype]
    )
    obj = TensorMemoryObj(raw, meta, None)
    if data is not None:
        obj.tensor.copy_(data)
    return obj


def _wait(query, task):
    while (res := query(task)) is None:
        time.sleep(0.0002)
    assert res is True


@pytest.fixture(scope="module", params=sorted(SERDES))
def setup(request):
    name = request.param
    proc = serde_mod.create_serde_processor(serde_mod.SerdeConfig(type=name, kwargs=SERDES[name]))
    n = proc.estimate_serialized_size(MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.bfloat16]))
    g = torch.Generator().manual_seed(0)
    srcs = [_obj(SHAPE, torch.bfloat16, torch.randn(SHAPE, generator=g).bfloat16()) for _ in range(BATCH)]
    dsts = [_obj((n,), torch.uint8) for _ in range(BATCH)]
    backs = [_obj(SHAPE, torch.bfloat16) for _ in range(BATCH)]
    yield name, proc, n, srcs, dsts, backs
    proc.close()


def _info(benchmark, name, n):
    if benchmark.stats is None:  # --benchmark-disable (plain pytest): the calls ran once, nothing was timed
        return
    mean = benchmark.stats.stats.mean
    benchmark.extra_info.update(
        serde=name,
        stored_bytes=n,
        kv_bytes=KV_BYTES,
        ratio=round(n / KV_BYTES, 4),
        gb_per_s=round(BATCH * KV_BYTES / mean / 1e9, 3),
    )


def test_serialize(benchmark, setup):
    name, proc, n, srcs, dsts, _ = setup
    keys = [None] * BATCH
    benchmark(lambda: _wait(proc.query_serialize_result, proc.submit_serialize(srcs, dsts, keys)))
    _info(benchmark, name, n)


def test_deserialize(benchmark, setup):
    name, proc, n, srcs, dsts, backs = setup
    keys = [None] * BATCH
    _wait(proc.query_serialize_result, proc.submit_serialize(srcs, dsts, keys))
    benchmark(lambda: _wait(proc.query_deserialize_result, proc.submit_deserialize(dsts, backs, keys)))
    _info(benchmark, name, n)
    err = (backs[0].tensor[1].float() - srcs[0].tensor[1].float()).abs().max()
    benchmark.extra_info["v_max_abs_err"] = round(float(err), 4)
    benchmark.extra_info["k_exact"] = bool(torch.equal(backs[0].tensor[0], srcs[0].tensor[0]))
