"""The bridge between the format's pure-Python dtypes and torch's."""

from __future__ import annotations

import torch

from ..errors import Reason, UnsupportedConfigError
from ..format import DType, as_dtype

__all__ = ["KDTYPES", "SCALE_DTYPES", "VDTYPES", "from_torch", "to_torch"]

KDTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""K dtypes copied bit-exact (fp16/bf16 are the point; fp32 is accepted as LMCache does)."""
VDTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""V dtypes that encode quantizes and decode dequantizes to."""
SCALE_DTYPES = (torch.float32, torch.float16)

_TO_TORCH: dict[DType, torch.dtype] = {
    as_dtype(t): t
    for t in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


def to_torch(dtype: DType) -> torch.dtype:
    """The torch dtype of a header dtype."""
    return _TO_TORCH[dtype]


def from_torch(dtype: torch.dtype) -> DType:
    """The header dtype of a torch dtype; :class:`UnsupportedConfigError` if LMCKV has none."""
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedConfigError(
            f"expected a torch.dtype, got {type(dtype).__name__}", reason=Reason.BAD_TYPE
        )
    return as_dtype(dtype)
