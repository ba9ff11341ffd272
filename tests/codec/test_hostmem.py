"""kvcodec.hostmem: single-thread copies, unzeroed buffers, bytes built in place."""

from __future__ import annotations

import pytest
import torch

from kvcodec.hostmem import copy_tensor, filled_bytes, new_buffer, owned_copy


def test_filled_bytes_is_immutable_bytes_and_its_view_does_not_outlive_fill() -> None:
    kept: list[memoryview] = []

    def fill(view: memoryview) -> None:
        view[:] = bytes(range(16))
        kept.append(view)

    out = filled_bytes(16, fill)
    assert type(out) is bytes and out == bytes(range(16)) and hash(out) == hash(bytes(range(16)))
    with pytest.raises(ValueError):
        kept[0][0] = 1  # released: nothing can write into the bytes any more


def test_copies_are_bit_exact_for_every_item_size_and_stride() -> None:
    for dt in (torch.uint8, torch.bfloat16, torch.float32, torch.float64):
        src = torch.randn(6, 5, 4).to(dt).transpose(0, 1)
        dst = torch.empty(5, 6, 4, dtype=dt)
        copy_tensor(dst, src)
        assert torch.equal(dst, src)
    buf = memoryview(bytes(range(200)))
    assert bytes(owned_copy(buf)) == bytes(buf) and not owned_copy(buf).readonly
    assert len(new_buffer(1 << 20)) == 1 << 20
