"""LMCKV dtype ids as plain Python values: the format layer knows no framework.

A :class:`DType` names an element type by the name torch and numpy give it
("float16", "float8_e4m3fn", ...) and knows its size. Headers hold these; the
mapping to ``torch.dtype`` lives with the codec (:mod:`kvcodec.codec.dtypes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import CorruptEncodedKVError, Reason, UnsupportedConfigError

__all__ = [
    "BFLOAT16",
    "DTYPE_TO_ID",
    "FLOAT8_DTYPES",
    "FLOAT8_E4M3FN",
    "FLOAT8_E5M2",
    "FLOAT16",
    "FLOAT32",
    "FLOAT64",
    "FLOAT_INF_BITS",
    "ID_TO_DTYPE",
    "UINT8",
    "DType",
    "as_dtype",
    "dtype_to_id",
    "id_to_dtype",
]


@dataclass(frozen=True)
class DType:
    """An element type of an LMCKV payload section."""

    name: str
    itemsize: int

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"DType({self.name})"


FLOAT16 = DType("float16", 2)
BFLOAT16 = DType("bfloat16", 2)
FLOAT32 = DType("float32", 4)
FLOAT64 = DType("float64", 8)
UINT8 = DType("uint8", 1)
FLOAT8_E4M3FN = DType("float8_e4m3fn", 1)
FLOAT8_E5M2 = DType("float8_e5m2", 1)

FLOAT8_DTYPES = (FLOAT8_E4M3FN, FLOAT8_E5M2)
"""The FP8 formats V may be stored in (LMCache 0.5.6 writes e4m3fn only)."""

#: LMCache's protocol table. Ids 1 and 2 both mean float16; writers emit 2.
ID_TO_DTYPE: dict[int, DType] = {
    1: FLOAT16,
    2: FLOAT16,
    3: BFLOAT16,
    4: FLOAT32,
    5: FLOAT64,
    6: UINT8,
    7: FLOAT8_E4M3FN,
    8: FLOAT8_E5M2,
}
DTYPE_TO_ID: dict[DType, int] = {d: i for i, d in sorted(ID_TO_DTYPE.items())}  # float16 -> 2

#: The bits of +Inf of each float dtype a scale may be stored in. A value is finite and
#: greater than zero exactly when ``0 < bits < FLOAT_INF_BITS[dtype]`` (as an unsigned int:
#: a set sign bit, NaN and Inf all land at or above it).
FLOAT_INF_BITS: dict[DType, int] = {
    FLOAT16: 0x7C00,
    BFLOAT16: 0x7F80,
    FLOAT32: 0x7F80_0000,
    FLOAT64: 0x7FF0_0000_0000_0000,
}
_BY_NAME: dict[str, DType] = {d.name: d for d in DTYPE_TO_ID}


def as_dtype(value: Any) -> DType:
    """A :class:`DType` from itself, its name, or any object whose ``str`` is ``torch.<name>``.

    Framework dtypes are recognised by name only, so this module never imports one.
    """
    if isinstance(value, DType):
        return value
    name = value if isinstance(value, str) else str(value).removeprefix("torch.")
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnsupportedConfigError(
            f"dtype {value} has no LMCKV dtype id; expected one of {sorted(_BY_NAME)}",
            reason=Reason.NO_DTYPE_ID,
        ) from None


def dtype_to_id(dtype: Any) -> int:
    """Protocol id of ``dtype``; :class:`UnsupportedConfigError` if it has none."""
    return DTYPE_TO_ID[as_dtype(dtype)]


def id_to_dtype(idx: int, what: str = "dtype") -> DType:
    """DType of protocol id ``idx``; :class:`CorruptEncodedKVError` if unknown (0 too)."""
    try:
        return ID_TO_DTYPE[idx]
    except KeyError:
        raise CorruptEncodedKVError(
            f"unknown {what} id {idx} in header; expected one of {sorted(ID_TO_DTYPE)}",
            reason=Reason.UNKNOWN_DTYPE_ID,
        ) from None
