"""Fixtures of the backend suites: which of the C encode's two ways over V a test runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvcodec.backends import cpu


@pytest.fixture(params=[0, 1], ids=["two_pass", "paged"])
def encode_pass(request: pytest.FixtureRequest) -> Iterator[int]:
    """The C ``encode_v`` of per_page_head 16-bit V in two passes over all of V (every scale, then every
    code), then page by page (a page's scales, then its codes while its rows are in cache: the default)."""
    if not cpu.AVAILABLE:
        yield request.param
        return
    from kvcodec import _cpu

    prev = _cpu.paged(request.param)
    yield request.param
    _cpu.paged(prev)
