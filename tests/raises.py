"""``pytest.raises`` that also checks the error's machine-readable ``reason`` (never its wording)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from kvcodec.errors import CodecError, Reason

__all__ = ["raises_reason"]


@contextlib.contextmanager
def raises_reason(cls: type[CodecError], reason: Reason) -> Iterator[Any]:
    """Expect ``cls`` raised with ``reason``; yields pytest's ExceptionInfo."""
    with pytest.raises(cls) as info:
        yield info
    assert info.value.reason is reason, (
        f"{info.value!r} has reason {info.value.reason!r}, expected {reason!r}"
    )
