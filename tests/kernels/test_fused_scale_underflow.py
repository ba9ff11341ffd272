"""Fused paths refuse a V group whose fp32 scale underflows to 0, as the other paths do.

An fp32 V group whose absmax is nonzero but below 448 * 2**-149 has
``amax / 448 == 0`` in fp32: its codes would be V/0 and the blob would decode
to NaN. The torch and cpu backends (and the connector's per-layer path) refuse
it; the fused kernels compute the same scale, so their absmax is checked the
same way on the host (``numerics.check_layers_amax``) before a blob is sealed:
the connector's fused save, ``encode(backend="triton")`` and ``encode_layers``.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, KERNEL_MARKS, require_kernels

require_kernels()
pytestmark = KERNEL_MARKS

from kvcodec import UnsupportedConfigError, encode, encode_layers  # noqa: E402
from kvcodec.integrations.vllm.chunks import ChunkCodec, encode_chunk  # noqa: E402
from kvcodec.integrations.vllm.fused import FusedLayers  # noqa: E402

DEV = DEVICE
MODE = "auto" if DEV == "cuda" else "on"
H, D, BS = 1, 4, 4


def test_tiny_fp32_v_is_refused_like_the_per_layer_path() -> None:
    phys = torch.randn(2, 4, BS, H, 2 * D, generator=torch.Generator().manual_seed(0)).to(DEV)  # LBNHC
    caches = {f"model.layers.{i}.self_attn.attn": phys[i].permute(0, 2, 1, 3) for i in range(2)}
    name = "model.layers.1.self_attn.attn"
    caches[name][0, 0, :, D:] = 0
    caches[name][0, 0, 0, D] = 1e-44  # block 0, head 0: V's only non-zero value is an fp32 subnormal
    cc = ChunkCodec(head_size=D, block_size=BS, scope="per_page_head", page_size=4, hashes={"model_id": "x"})
    ids = {n: int(n.split(".")[2]) for n in caches}

    with pytest.raises(UnsupportedConfigError):  # the per-layer path: nothing saved
        encode_chunk(caches[name], [0, 1], cc, start=0, num_tokens=4, layer_id=1, chunk_id=0)

    fused, why = FusedLayers.build(caches, ids, cc, MODE)
    assert fused is not None, why
    with pytest.raises(UnsupportedConfigError, match=r"layer 1: .*V is too small to scale"):
        fused.save([0, 1], 0, 4)


@pytest.mark.parametrize("layers", [False, True], ids=["encode", "encode_layers"])
def test_generic_fused_encode_fp16_k_fp32_v_refuses_like_torch(layers: bool) -> None:
    """fp16 K + fp32 V is fusable: ``encode_fused`` / ``encode_fused_layers`` refuse as torch does."""
    k = torch.zeros(4, 1, 4, dtype=torch.float16, device=DEV)
    v = torch.zeros(4, 1, 4, dtype=torch.float32, device=DEV)
    v[0, 0, 0] = 1e-44
    opts = {"scope": "per_tensor"}
    with pytest.raises(UnsupportedConfigError):
        encode(k.cpu(), v.cpu(), backend="torch", **opts)
    with pytest.raises(UnsupportedConfigError):
        if layers:
            encode_layers([k, k], [v, v], backend="triton", **opts)
        else:
            encode(k, v, backend="triton", **opts)
