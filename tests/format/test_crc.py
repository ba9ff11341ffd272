"""kvcodec.format.crc: ISA-L's CRC-32 equals zlib's, and the zlib fallback works."""

from __future__ import annotations

import importlib
import importlib.util
import random
import sys
import zlib

import pytest

import kvcodec.format.crc as crc_mod

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


def _expected_backend() -> str:
    return "isal" if importlib.util.find_spec("isal") is not None else "zlib"


def test_backend_is_the_fastest_installed() -> None:
    assert crc_mod.CRC_BACKEND == _expected_backend()


def _reload_without(monkeypatch: pytest.MonkeyPatch, *names: str):
    import kvcodec

    for name in names:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
        if name.startswith("kvcodec."):
            monkeypatch.delattr(kvcodec, name.split(".", 1)[1], raising=False)
    monkeypatch.delitem(sys.modules, "isal.isal_zlib", raising=False)
    return importlib.reload(crc_mod)


@pytest.mark.parametrize(("blocked", "expect"), [(("isal",), "zlib")])
def test_fallbacks(monkeypatch: pytest.MonkeyPatch, data: bytes, blocked, expect) -> None:
    if expect == "isal" and importlib.util.find_spec("isal") is None:
        pytest.skip("isal not installed")
    try:
        with monkeypatch.context() as m:
            mod = _reload_without(m, *blocked)
            assert mod.CRC_BACKEND == expect
            if expect == "zlib":
                assert mod.crc32 is mod.crc32_zlib
            for size in SIZES:
                assert mod.crc32(data[:size], 7) == zlib.crc32(data[:size], 7)
    finally:
        importlib.reload(crc_mod)  # back to the real backend for everyone else
    assert crc_mod.CRC_BACKEND == _expected_backend()
