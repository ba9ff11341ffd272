"""CRC-32 (IEEE, the zlib polynomial) from ISA-L when installed, else zlib.

``isal`` is several times faster than ``zlib`` and releases the GIL on long
buffers, so a caller's thread pool scales across blobs. Both are checked
against each other at import; a disagreeing build is skipped.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

__all__ = ["CRC_BACKEND", "crc32", "crc32_zlib"]


def crc32_zlib(data: object, value: int = 0) -> int:
    """CRC-32 of ``data`` continuing from ``value``, with the stdlib's zlib."""
    return zlib.crc32(data, value) & 0xFFFFFFFF  # type: ignore[arg-type]


def _agrees(fn: Callable[..., int]) -> bool:
    """Whether ``fn`` gives zlib's CRC on probes of several length classes."""
    probe = bytes(range(256)) * 40
    return all(fn(probe[:n], 12345) == crc32_zlib(probe[:n], 12345) for n in (0, 5, 63, 64, 200, 10240))


def _load() -> tuple[Callable[..., int], str]:
    try:
        from isal import isal_zlib  # type: ignore[import-not-found]
    except ImportError:  # pragma: no cover - depends on the environment
        return crc32_zlib, "zlib"

    def crc32_isal(data: object, value: int = 0) -> int:
        return isal_zlib.crc32(data, value) & 0xFFFFFFFF

    if not _agrees(crc32_isal):  # pragma: no cover
        return crc32_zlib, "zlib"
    return crc32_isal, "isal"


crc32, CRC_BACKEND = _load()
crc32.__doc__ = "CRC-32 (IEEE) of ``data`` continuing from ``value`` (fastest backend installed)."
