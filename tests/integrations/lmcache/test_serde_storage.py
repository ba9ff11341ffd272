"""The kvcodec serde inside LMCache 0.5.6's own storage: its processor, StorageManager and fs L2 adapter.

Every object goes through LMCache's real code paths (``create_serde_processor``,
``AsyncSerdeProcessor``, ``StorageManager`` built from the same CLI JSON a user
writes, the ``fs`` adapter); the blobs on disk are read back by LMCache's own
``lmcache.v1.kv_codec`` reader.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor, get_registered_serde_types
from lmcache.v1.distributed.storage_manager import StorageManager

import kvcodec
from kvcodec.integrations.lmcache import serde
from tests.integrations.lmcache._objs import memory_obj

SHAPE = (2, 3, 64, 4 * 32)  # [2, layers, chunk tokens, heads * head_dim]
HEAD_DIM = 32


def _kv(seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(SHAPE, generator=g) * (1 + torch.rand(1, 1, 1, SHAPE[3], generator=g) * 8)).to(dtype)


POLL_S = 0.02


def _wait(pred: Callable[[], object], polls: int = 1000) -> object:
    """``pred()`` once it is truthy, polled every ``POLL_S`` (a liveness bound, not a speed check)."""
    for _ in range(polls):
        got = pred()
        if got is not None and got is not False and got != (None,):
            return got
        time.sleep(POLL_S)
    raise AssertionError(f"still nothing after {polls} polls")


def _check_quality(got: torch.Tensor, orig: torch.Tensor) -> None:
    """K bit-exact; V within FP8 e4m3's half-ulp (2^-4 relative) of each page-head group's amax."""
    assert torch.equal(got[0].view(torch.int16), orig[0].view(torch.int16))
    err = (got[1].float() - orig[1].float()).abs()
    amax = orig[1].float().abs().amax()
    assert float(err.max()) <= float(amax) * 2**-4
    assert float(err.max()) > 0  # V really went through FP8


def _processor(**opts):
    return create_serde_processor(SerdeConfig(type="kvcodec", kwargs={"head_dim": HEAD_DIM, **opts}))


def _run(proc, submit: str, srcs, dsts) -> bool:
    task = getattr(proc, f"submit_{submit}")(srcs, dsts, [None] * len(srcs))
    query = getattr(proc, f"query_{submit}_result")
    return _wait(lambda: (query(task),))[0] is True  # (result,): pending while None


def test_registered_idempotently():
    assert "kvcodec" in get_registered_serde_types()
    serde.register()
    serde.register()
    assert get_registered_serde_types().count("kvcodec") == 1


def test_processor_round_trip_and_exact_estimate():
    proc = _processor(model="tiny-llama", max_workers=2)
    try:
        layout = MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.bfloat16])
        n = proc.estimate_serialized_size(layout)
        origs = [_kv(i) for i in range(4)]
        srcs = [memory_obj(SHAPE, torch.bfloat16, x) for x in origs]
        dsts = [memory_obj((n,), torch.uint8) for _ in origs]
        assert _run(proc, "serialize", srcs, dsts)
        for d in dsts:
            assert d.get_size() == n  # AsyncSerdeProcessor narrowed to what serialize returned
            blob = d.tensor.numpy()
            p = kvcodec.parse(blob, strict=True)  # the estimate is the blob, byte for byte
            assert p.header.version == 1 and p.header.hashes.model_id == "tiny-llama"
            assert (p.header.kv_head_count, p.header.head_dim, p.header.chunk_size) == (4, 32, 3 * 64)
        backs = [memory_obj(SHAPE, torch.bfloat16) for _ in origs]
        assert _run(proc, "deserialize", dsts, backs)
        for b, x in zip(backs, origs):
            _check_quality(b.tensor, x)
        assert n < 0.76 * torch.Size(SHAPE).numel() * 2  # K 16-bit + V 8-bit + scales
    finally:
        proc.close()


def test_other_model_refused_on_load():
    writer, reader = _processor(model="model-a"), _processor(model="model-b")
    try:
        layout = MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.bfloat16])
        n = writer.estimate_serialized_size(layout)
        src, dst = memory_obj(SHAPE, torch.bfloat16, _kv(1)), memory_obj((n,), torch.uint8)
        assert _run(writer, "serialize", [src], [dst])
        des = serde.KvcodecDeserializer(
            serde.KvcodecSerdeConfig.from_kwargs({"head_dim": HEAD_DIM, "model": "model-b"})
        )
        with pytest.raises(kvcodec.CodecMismatchError, match="model_id"):
            des.deserialize(dst, memory_obj(SHAPE, torch.bfloat16))
        assert not _run(reader, "deserialize", [dst], [memory_obj(SHAPE, torch.bfloat16)])
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize(
    "opts,match",
    [
        ({}, "head_dim"),
        ({"head_dim": 128, "mla": True}, "MLA"),
        ({"head_dim": 128, "scope": "external"}, "scope"),
        ({"head_dim": 0}, "head_dim"),
        ({"head_dim": 128, "colour": 1}, "unknown kvcodec serde option"),
    ],
)
def test_bad_config_refused_at_configuration(opts, match):
    with pytest.raises(kvcodec.UnsupportedConfigError, match=match):
        create_serde_processor(SerdeConfig(type="kvcodec", kwargs=opts))


@pytest.mark.parametrize(
    "shape,dtype,match",
    [
        ((3, 64, 512), torch.bfloat16, "MLA"),
        ((2, 3, 64, 100), torch.bfloat16, "head_dim"),
        (SHAPE, torch.int8, "float16"),
    ],
)
def test_unservable_layouts_refused_clearly(shape, dtype, match):
    proc = _processor()
    try:
        with pytest.raises(kvcodec.UnsupportedConfigError, match=match):
            proc.estimate_serialized_size(MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[dtype]))
    finally:
        proc.close()


# ----------------------------------------------------------------------------
# StorageManager + fs L2 adapter, configured from the user's JSON
# ----------------------------------------------------------------------------


def _storage_manager(base: Path, model: str) -> StorageManager:
    adapter = {
        "type": "fs",
        "base_path": str(base),
        "serde": {"type": "kvcodec", "head_dim": HEAD_DIM, "page_size": 16, "model": model},
    }
    parser = argparse.ArgumentParser()
    add_storage_manager_args(parser)
    args = parser.parse_args(
        ["--l1-size-gb", "0.25", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(adapter)]
    )
    return StorageManager(parse_args_to_config(args))


def _keys(model: str, n: int) -> list[ObjectKey]:
    return [ObjectKey(chunk_hash=bytes([i + 1]) * 32, model_name=model, kv_rank=0) for i in range(n)]


def test_storage_manager_fs_round_trip(tmp_path):
    model = "tiny-llama"
    layout = MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.bfloat16])
    keys = _keys(model, 3)
    origs = [_kv(10 + i) for i in range(len(keys))]
    sm = _storage_manager(tmp_path, model)
    try:
        reserved = sm.reserve_write(keys, layout)
        for key, x in zip(keys, origs):
            reserved[key].tensor.view(torch.bfloat16).view(SHAPE).copy_(x)
        sm.finish_write(keys)
        # the fs adapter writes NAME.tmp, then renames it NAME.data: wait for the finished files
        files = _wait(
            lambda: (
                sorted(tmp_path.rglob("*.data")) if len(list(tmp_path.rglob("*.data"))) == len(keys) else None
            )
        )
        _wait(lambda: sm.report_status()["store_controller"]["in_flight_task_count"] == 0)
        sm.clear(force=True)
        spec = PrefetchTaskSpec(
            key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)]
        )
        handle = sm.submit_prefetch_task(spec)
        result = _wait(lambda: sm.query_prefetch_status(handle))
        assert (result.l2_hit_count, result.l1_hit_count) == (len(keys), 0)  # every key a hit, served from L2
        with sm.read_prefetched_results(keys) as objs:
            assert objs is not None
            for obj, x in zip(objs, origs):
                _check_quality(obj.tensor.view(torch.bfloat16).view(SHAPE), x)
        sm.finish_read_prefetched(keys)
    finally:
        sm.close()
    _check_files_with_lmcache_reader(files, model)


def _check_files_with_lmcache_reader(files: list[Path], model: str) -> None:
    """LMCache's own kv_codec reader parses every blob on disk, and so does kvcodec (strictly)."""
    from lmcache.v1.kv_codec import AsymK16V8Codec, CodecHashes

    reader = AsymK16V8Codec()
    for f in files:
        data = f.read_bytes()
        enc = reader.from_bytes(data, expected_hashes=CodecHashes(model_id=model))
        assert enc.kv_head_count == 4 and enc.head_dim == HEAD_DIM
        k, _, scales = reader.decode(enc)
        assert k.numel() == SHAPE[1] * SHAPE[2] * SHAPE[3] and tuple(scales.shape) == (
            SHAPE[1] * SHAPE[2] // 16,
            4,
        )
        kvcodec.parse(data, strict=True)
        assert os.path.getsize(f) == len(data)
