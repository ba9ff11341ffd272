"""The fleet tests start real Redis and LMCache servers (minutes): they run under ``make test-fleet`` only."""

from __future__ import annotations

import os

import pytest

from tests.integrations.lmcache.fleet.harness import redis_missing


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KVCODEC_FLEET") != "1":
        reason = "real Redis + LMCache servers: run by `make test-fleet` (KVCODEC_FLEET=1)"
    else:
        reason = redis_missing()
    if reason:
        here = os.path.dirname(__file__)
        for item in items:
            if str(item.fspath).startswith(here):
                item.add_marker(pytest.mark.skip(reason=reason))
