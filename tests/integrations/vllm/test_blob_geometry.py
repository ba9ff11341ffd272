"""The vLLM load paths take a blob's geometry from the format layer only.

The per-layer C path (:func:`~kvcodec.integrations.vllm.chunks.read_chunk`'s rows) and the fused
path's plan must serve exactly the blobs :func:`kvcodec.format.is_plain` calls plain (the C rows:
those with e4m3 V), and view exactly the sections :class:`~kvcodec.format.ParsedBlob` and
:func:`~kvcodec.format.geometry` name: a rule written again in an integration module would drift
from these.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvcodec import encode
from kvcodec.backends import cache_lanes_available
from kvcodec.format import ParsedBlob, geometry, is_plain, parse
from kvcodec.format.dtypes import FLOAT8_E4M3FN
from kvcodec.integrations.vllm import fused
from kvcodec.integrations.vllm.chunks import ChunkCodec, _Plan, blob_identity

T, H, D, BLOCK = 40, 2, 16, 8
CC = ChunkCodec(head_size=D, block_size=BLOCK, model_dtype=torch.float16, hashes={"model_id": "geo"})

KINDS: dict[str, dict[str, Any]] = {
    "per_tensor": {"scope": "per_tensor"},
    "per_layer_head": {"scope": "per_layer_head"},
    "per_page_head_16": {"scope": "per_page_head", "page_size": 16},
    "per_page_head_3": {"scope": "per_page_head", "page_size": 3},
    "e5m2": {"scope": "per_layer_head", "v_dtype": torch.float8_e5m2, "allow_e5m2": True},
    "fp16_scales": {"scope": "per_page_head", "page_size": 16, "scale_dtype": torch.float16},
    "unit_scales": {"scope": "raw"},
}


def _parsed(kind: str, dtype: torch.dtype = torch.float16) -> ParsedBlob:
    g = torch.Generator().manual_seed(len(kind))
    k = torch.randn(T, H, D, generator=g).to(dtype)
    v = torch.randn(T, H, D, generator=g).to(dtype)
    hashes = blob_identity(CC, D, D, "")
    return parse(encode(k, v, hashes=hashes, layer_id=0, chunk_id=0, **KINDS[kind]))


@pytest.mark.parametrize("kind", KINDS)
def test_the_fused_plan_serves_the_plain_blobs(kind: str) -> None:
    p = _parsed(kind)
    assert (fused._plan(p) is not None) == is_plain(p.header)


def test_the_grid_has_plain_and_other_blobs() -> None:
    plain = {kind: is_plain(_parsed(kind).header) for kind in KINDS}
    assert plain == {**dict.fromkeys(KINDS, True), "fp16_scales": False, "unit_scales": False}


@pytest.mark.skipif(not cache_lanes_available(), reason="kvcodec._cpu is not built")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_the_c_rows_view_the_plain_blobs_sections(kind: str, dtype: torch.dtype) -> None:
    p = _parsed(kind, dtype)
    cache = torch.zeros(T // BLOCK, H, BLOCK, 2 * D, dtype=dtype)
    cc = ChunkCodec(head_size=D, block_size=BLOCK, model_dtype=dtype, hashes=CC.hashes)
    layer = _Plan.of(cache, cc, T, "").rows(p, (0, 0), False)
    h = p.header
    assert (layer is not None) == (is_plain(h) and h.v_dtype == FLOAT8_E4M3FN)
    if layer is None:
        return
    rows, g = layer.rows, geometry(h)
    assert rows is not None and g is not None
    assert rows.k.shape == g.k_shape and rows.codes.shape == g.v_shape
    assert rows.k.tobytes() == bytes(p.k) and rows.codes.tobytes() == bytes(p.v)
    assert rows.scales.shape == tuple(h.scale_shape) and rows.scales.tobytes() == bytes(p.scales)
    assert np.shares_memory(rows.codes, np.frombuffer(p.buffer, np.uint8))  # views, not copies


@pytest.mark.parametrize("kind", ["per_tensor", "per_page_head_16"])
def test_the_fused_geometry_check_takes_the_formats_tokens(kind: str) -> None:
    p = _parsed(kind)
    fused._check_geometry(p, T, H, D, torch.float16)
    with pytest.raises(Exception, match=rf"holds \({T}, {H}, {D}\)"):
        fused._check_geometry(p, T + 1, H, D, torch.float16)
