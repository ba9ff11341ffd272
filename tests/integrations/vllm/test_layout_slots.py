"""scatter_kv's precomputed slots (shared by every layer of a chunk) and its C row copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec import UnsupportedConfigError
from kvcodec.integrations.vllm.layout import chunk_slots, gather_kv, scatter_kv

H, D, BLOCK = 2, 8, 4
TABLE = [5, 1, 7, 3, 0]


def _view(seed: int, split: bool = False, dtype=torch.bfloat16) -> torch.Tensor:
    """A strided [N, H, S, C] view ([S, N, H, C] in memory); ``split``: kernel blocks of 2 slots."""
    g = torch.Generator().manual_seed(seed)
    n, s = (16, BLOCK // 2) if split else (8, BLOCK)
    return torch.randn(s, n, H, 2 * D, generator=g).to(dtype).permute(1, 2, 0, 3)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_slots_given_or_not_write_the_same(split, dtype):
    g = torch.Generator().manual_seed(9)
    k = torch.randn(13, H, D, generator=g).to(dtype)
    v = torch.randn(13, H, D, generator=g).to(dtype)
    a, b = _view(1, split).to(dtype), _view(1, split).to(dtype)
    slots = chunk_slots(a, TABLE, block_size=BLOCK, start=3, num_tokens=13)
    scatter_kv(a, TABLE, k, v, head_size=D, block_size=BLOCK, start=3)
    scatter_kv(b, TABLE, k, v, head_size=D, block_size=BLOCK, start=3, slots=slots)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    k2, v2 = gather_kv(b, TABLE, head_size=D, block_size=BLOCK, start=3, num_tokens=13)
    assert torch.equal(k2.view(torch.uint8), k.view(torch.uint8)) and torch.equal(
        v2.view(torch.uint8), v.view(torch.uint8)
    )


def test_slots_of_another_geometry_are_recomputed():
    k = torch.randn(6, H, D).to(torch.bfloat16)
    v = torch.randn(6, H, D).to(torch.bfloat16)
    split_slots = chunk_slots(_view(0, split=True), TABLE, block_size=BLOCK, start=1, num_tokens=6)
    other_len = chunk_slots(_view(0), TABLE, block_size=BLOCK, start=1, num_tokens=5)
    want = _view(2)
    scatter_kv(want, TABLE, k, v, head_size=D, block_size=BLOCK, start=1)
    for slots in (split_slots, other_len):
        got = _view(2)
        scatter_kv(got, TABLE, k, v, head_size=D, block_size=BLOCK, start=1, slots=slots)
        assert torch.equal(got, want)


def test_runs_array():
    s = chunk_slots(_view(0), TABLE, block_size=BLOCK, start=2, num_tokens=7)
    runs = s.runs_array(shift=3)
    assert runs.dtype == np.int64 and runs.shape == (len(s.runs), 4)
    assert runs[:, 2].tolist() == [t + 3 for _, _, t, _ in s.runs]
    assert s.fits(_view(0), 7) and not s.fits(_view(0), 6) and not s.fits(_view(0, split=True), 7)


def test_block_ids_must_be_ints():
    with pytest.raises(UnsupportedConfigError, match="ints"):
        chunk_slots(_view(0), [True, False], block_size=BLOCK, start=0, num_tokens=2)
    with pytest.raises(UnsupportedConfigError, match="ints"):
        chunk_slots(_view(0), [0.0, 1.0], block_size=BLOCK, start=0, num_tokens=2)
    s = chunk_slots(_view(0), torch.tensor(TABLE), block_size=BLOCK, start=0, num_tokens=8)
    assert s.block_ids == (5, 1)
