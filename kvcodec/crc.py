"""CRC-32 (IEEE, the zlib polynomial) with the fastest implementation installed.

ISA-L's ``isal`` computes the same checksum as ``zlib.crc32`` several times
faster with SIMD; it is optional, and ``zlib`` is the fallback.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

__all__ = ["CRC_BACKEND", "crc32", "crc32_zlib"]

Buffer = "bytes | bytearray | memoryview"


def crc32_zlib(data: object, value: int = 0) -> int:
    """CRC-32 of ``data`` continuing from ``value``, with the stdlib's zlib."""
    return zlib.crc32(data, value) & 0xFFFFFFFF  # type: ignore[arg-type]


def _load() -> tuple[Callable[..., int], str]:
    try:
        from isal import isal_zlib  # type: ignore[import-not-found]
    except ImportError:  # pragma: no cover - depends on the environment
        return crc32_zlib, "zlib"

    def crc32_isal(data: object, value: int = 0) -> int:
        return isal_zlib.crc32(data, value) & 0xFFFFFFFF

    # Refuse an implementation that disagrees with zlib (a broken build).
    probe = bytes(range(256)) * 5
    if crc32_isal(probe, 12345) != crc32_zlib(probe, 12345):  # pragma: no cover
        return crc32_zlib, "zlib"
    return crc32_isal, "isal"


crc32, CRC_BACKEND = _load()
crc32.__doc__ = "CRC-32 (IEEE) of ``data`` continuing from ``value`` (fastest backend)."
