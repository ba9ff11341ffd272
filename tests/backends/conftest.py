"""Fixtures of the backend suites: the C level a test runs at, as a level-bound ``kvcodec._cpu.Level``.

:func:`cpu_level` binds the ``cpu`` backend to one ``Level`` object for a test (the library's own
default level, chosen once at import, is never switched); :func:`encode_pass` picks which of the C
encode's two ways over V a test runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from kvcodec.backends import cpu

_LEVEL_FIELDS = ("simd", "crc", "paged")


@contextlib.contextmanager
def cpu_level(**levels: int) -> Iterator[Any]:
    """The ``cpu`` backend bound to ``kvcodec._cpu.Level(**levels)`` while inside, each level not
    given kept from the Level it is bound to already (or the default): the Level, which the test may
    call directly too. Nothing is switched in the library: every other Level and its default keep theirs."""
    from kvcodec import _cpu

    before = cpu._cpu
    now = {f: getattr(before, f) for f in _LEVEL_FIELDS} if isinstance(before, _cpu.Level) else {}
    bound = _cpu.Level(**{**now, **levels})
    cpu._cpu = bound
    try:
        yield bound
    finally:
        cpu._cpu = before


@pytest.fixture(params=[0, 1], ids=["two_pass", "paged"])
def encode_pass(request: pytest.FixtureRequest) -> Iterator[int]:
    """The C ``encode_v`` of per_page_head 16-bit V in two passes over all of V (every scale, then every
    code), then page by page (a page's scales, then its codes while its rows are in cache: the default)."""
    if not cpu.AVAILABLE:
        yield request.param
        return
    with cpu_level(paged=request.param):
        yield request.param
