"""CRC-32 (IEEE, the zlib polynomial) with the fastest implementation installed.

In order of preference: kvcodec's own C extension (``kvcodec._cpu``: folds
with VPCLMULQDQ/PCLMULQDQ, GIL released; ~2x ISA-L on this project's CI
machine), ISA-L's ``isal`` (several times ``zlib``), and ``zlib``. Each is
checked against ``zlib`` at import and skipped if it disagrees.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

__all__ = ["CRC_BACKEND", "crc32", "crc32_zlib", "set_threads_source"]

Buffer = "bytes | bytearray | memoryview"


def crc32_zlib(data: object, value: int = 0) -> int:
    """CRC-32 of ``data`` continuing from ``value``, with the stdlib's zlib."""
    return zlib.crc32(data, value) & 0xFFFFFFFF  # type: ignore[arg-type]


_LONG = 1 << 20


def _one_thread() -> int:
    return 1


_threads_source: Callable[[], int] = _one_thread


def set_threads_source(fn: Callable[[], int]) -> None:
    """Where the native CRC asks, per call, how many threads a buffer of >= 1 MiB may use."""
    global _threads_source
    _threads_source = fn


def _agrees(fn: Callable[..., int]) -> bool:
    """Whether ``fn`` gives zlib's CRC on probes of every length class (a broken build does not)."""
    probe = bytes(range(256)) * 40
    return all(fn(probe[:n], 12345) == crc32_zlib(probe[:n], 12345) for n in (0, 5, 63, 64, 200, 10240))


def _load() -> tuple[Callable[..., int], str]:
    try:
        from . import _cpu  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - depends on the install
        _cpu = None
    if _cpu is not None:
        native_crc = _cpu.crc32

        def crc32_native(data: object, value: int = 0) -> int:
            try:
                long = len(data) >= _LONG  # type: ignore[arg-type]
            except TypeError:
                long = False
            return native_crc(data, value & 0xFFFFFFFF, _threads_source() if long else 1)

        if _agrees(crc32_native):
            return crc32_native, "native"
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
crc32.__doc__ = "CRC-32 (IEEE) of ``data`` continuing from ``value`` (fastest backend)."
