"""hostmem's address arithmetic: the quick paths give what the general ones give."""

from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvcodec.hostmem import buffer_address, byte_span, overlaps_buffer


def _general_span(t: torch.Tensor) -> tuple[int, int]:
    lo = t.data_ptr()
    return lo, lo + (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(3, 4, 5),
        lambda: torch.empty(3, 4, 5, dtype=torch.float16)[1:],
        lambda: torch.empty(3, 4, 5)[:, ::2],
        lambda: torch.empty(3, 1, 5).expand(3, 4, 5),
        lambda: torch.empty(4, 5).t(),
        lambda: torch.empty(1, 4, 1).transpose(0, 2),
    ],
)
def test_byte_span_matches_the_strided_sum(make: Callable[[], torch.Tensor]) -> None:
    t = make()
    assert byte_span(t) == _general_span(t)


def test_buffer_address_of_writable_and_read_only_views() -> None:
    data = bytearray(64)
    for view in (memoryview(data)[7:], memoryview(bytes(data))[3:]):
        assert buffer_address(view) == np.frombuffer(view, np.uint8).ctypes.data
    mm = mmap.mmap(-1, 4096)
    view = memoryview(mm)[5:]
    assert buffer_address(view) == np.frombuffer(view, np.uint8).ctypes.data
    view.release()
    mm.close()  # no export is left behind


def test_overlaps_buffer_with_a_given_base() -> None:
    t = torch.zeros(16, dtype=torch.uint8)
    inside = memoryview(t.numpy())[4:8]
    apart = memoryview(bytearray(16))
    assert overlaps_buffer(t, inside) and overlaps_buffer(t, inside, buffer_address(inside))
    assert not overlaps_buffer(t, apart, buffer_address(apart))
    assert not overlaps_buffer(None, inside, 0)
