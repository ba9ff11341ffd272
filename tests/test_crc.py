"""kvcodec.crc: the fastest CRC-32 installed equals zlib's, and the zlib fallback works."""

from __future__ import annotations

import importlib
import importlib.util
import random
import sys
import zlib

import pytest

import kvcodec.crc as crc_mod

SIZES = [0, 1, 7, 64, 4096 + 3, 1 << 20]


@pytest.fixture(scope="module")
def data() -> bytes:
    return random.Random(20240601).randbytes(max(SIZES))


@pytest.mark.parametrize("size", SIZES)
def test_crc32_equals_zlib(data: bytes, size: int) -> None:
    buf = data[:size]
    assert crc_mod.crc32(buf) == zlib.crc32(buf)
    assert crc_mod.crc32(buf, 0xDEADBEEF) == zlib.crc32(buf, 0xDEADBEEF)
    assert crc_mod.crc32_zlib(buf, 12345) == zlib.crc32(buf, 12345)


def test_crc32_accepts_buffers_and_chains(data: bytes) -> None:
    buf = data[: 4096 + 3]
    whole = zlib.crc32(buf)
    assert crc_mod.crc32(bytearray(buf)) == whole
    assert crc_mod.crc32(memoryview(buf)[:]) == whole
    assert crc_mod.crc32(buf[1000:], crc_mod.crc32(buf[:1000])) == whole
    # Results are unsigned 32-bit whatever the start value.
    assert 0 <= crc_mod.crc32(buf, 0xFFFFFFFF) <= 0xFFFFFFFF


def test_backend_is_isal_when_installed() -> None:
    if importlib.util.find_spec("isal") is None:
        assert crc_mod.CRC_BACKEND == "zlib"
    else:
        assert crc_mod.CRC_BACKEND == "isal"


def test_zlib_fallback_without_isal(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    try:
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "isal", None)  # `import isal` now raises ImportError
            m.delitem(sys.modules, "isal.isal_zlib", raising=False)
            mod = importlib.reload(crc_mod)
            assert mod.CRC_BACKEND == "zlib"
            assert mod.crc32 is mod.crc32_zlib
            for size in SIZES:
                assert mod.crc32(data[:size], 7) == zlib.crc32(data[:size], 7)
    finally:
        importlib.reload(crc_mod)  # back to the real backend for everyone else
    if importlib.util.find_spec("isal") is not None:
        assert crc_mod.CRC_BACKEND == "isal"
