"""kvcodec inside vLLM: a KV connector that keeps prompt chunks as kvcodec blobs.

``KvcodecConnector`` is resolved lazily, so importing this package (or
``kvcodec``) never imports vLLM; vLLM imports it by name through
``kv_connector_module_path="kvcodec.integrations.vllm"``, or through the name
alone once :func:`register` has run (a ``vllm.general_plugins`` entry point).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvcodecConnector", "register"]

CONNECTOR_NAME = "KvcodecConnector"


def register() -> None:
    """Register ``KvcodecConnector`` with vLLM's connector factory (lazily loaded; idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, f"{__name__}.connector", CONNECTOR_NAME)


def __getattr__(name: str) -> Any:
    if name == "KvcodecConnector":
        from .connector import KvcodecConnector

        return KvcodecConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
