"""Real LMCache memory objects on CPU for the serde tests."""

from __future__ import annotations

import torch
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj


def memory_obj(
    shape: tuple[int, ...], dtype: torch.dtype, data: torch.Tensor | None = None
) -> TensorMemoryObj:
    """A TensorMemoryObj over fresh CPU memory, as LMCache's L1 hands to serdes."""
    size = torch.Size(shape)
    raw = torch.zeros(size.numel() * dtype.itemsize, dtype=torch.uint8)
    meta = MemoryObjMetadata(
        shape=size, dtype=dtype, address=0, phy_size=raw.numel(), ref_count=1, shapes=[size], dtypes=[dtype]
    )
    obj = TensorMemoryObj(raw, meta, None)
    if data is not None:
        obj.tensor.copy_(data)
    return obj
