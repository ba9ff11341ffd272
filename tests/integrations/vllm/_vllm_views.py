"""Per-layer cache views built by vLLM's own allocator code, and a slot-by-slot oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
    group_kernel_blocks,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

LAYOUTS = [lay.name for lay in KVCacheLayout]


@dataclass
class Views:
    raw: torch.Tensor
    views: list[torch.Tensor]
    num_blocks: int
    block_size: int
    head_size: int


def make_views(
    layout: str,
    *,
    layers: int = 2,
    num_blocks: int = 9,
    heads: int = 2,
    head_size: int = 8,
    head_size_v: int | None = None,
    block_size: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    kernel_block_size: int | None = None,
    seed: int = 0,
) -> Views:
    """All ``layers`` layers' views over one random allocation, as the engine makes them."""
    lay = KVCacheLayout[layout]
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=heads,
        head_size=head_size,
        head_size_v=head_size_v or head_size,
        dtype=dtype,
    )
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, layers, lay)
    size = spec.page_size_bytes * num_blocks * layers
    tensor = KVCacheTensor(
        size=size,
        layers=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=g)
    if dtype.is_floating_point and dtype.itemsize > 1:  # finite values only: byte noise may be NaN
        raw.view(dtype).copy_(torch.randn(size // dtype.itemsize, generator=g).to(dtype))
    views = create_kv_cache_views(raw, spec, num_blocks, lay, tensor, kernel_block_size=kernel_block_size)
    return Views(raw, views, num_blocks, block_size, head_size)


def oracle_slot(
    view: torch.Tensor, num_blocks: int, block_size: int, block_id: int, offset: int
) -> torch.Tensor:
    """The ``[H, C]`` cell of one token, found through vLLM's own kernel-block grouping."""
    grouped = group_kernel_blocks(view, num_blocks)
    if grouped.dim() == 4:
        return grouped[block_id, :, offset]
    kbs = grouped.shape[3]
    return grouped[block_id, offset // kbs, :, offset % kbs]
