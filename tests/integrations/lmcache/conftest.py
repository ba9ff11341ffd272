"""Tests against the real LMCache 0.5.6 (``make lmcache-full``); skipped, with the reason, without it."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "lmcache.v1.distributed.serde",
    reason="LMCache 0.5.6 with its distributed-storage deps is not installed (make lmcache-full)",
)
