"""backend="triton" gives the same blobs and decodes as backend="torch" (interpreter on CPU, or CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, KERNEL_MARKS, require_kernels

require_kernels()

from kvcodec import decode, encode  # noqa: E402

pytestmark = KERNEL_MARKS
DEV = DEVICE


@pytest.mark.parametrize("scope", ["per_tensor", "per_layer_head", "per_page_head", "raw"])
@pytest.mark.parametrize("shape", [(1, 1, 8, 4), (21, 2, 48, 8), (5, 3, 256, 1)], ids=str)
@pytest.mark.parametrize("vd", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_triton_backend_blob_and_decode_equal_torch(scope, shape, vd):
    t, h, d, ps = shape
    g = torch.Generator().manual_seed(t * d)
    k = torch.randn(t, h, d, generator=g).half().to(DEV)
    v = (torch.randn(t, h, d, generator=g) * 7).to(vd).to(DEV)
    a = encode(k, v, scope=scope, page_size=ps, backend="torch")
    b = encode(k, v, scope=scope, page_size=ps, backend="triton")
    assert a == b
    for od in (None, torch.float16, torch.float32):
        ra = decode(a, out_v_dtype=od, device=DEV, backend="torch")
        rb = decode(a, out_v_dtype=od, device=DEV, backend="triton")
        assert torch.equal(ra.v.view(torch.uint8), rb.v.view(torch.uint8))


def test_auto_never_picks_the_interpreter_on_cpu():
    from kvcodec.backends import select
    from kvcodec.env import triton_interpret

    assert select("auto", "cpu").name in ("cpu", "torch")
    if DEVICE == "cpu":
        assert triton_interpret()  # set by the conftests before triton loads


def test_triton_fused_refuses_nan_naming_the_group():
    from kvcodec.errors import UnsupportedConfigError

    k = torch.zeros(32, 2, 8, dtype=torch.float16, device=DEV)
    v = torch.ones(32, 2, 8, dtype=torch.float16, device=DEV)
    v[20, 1, 3] = float("nan")
    with pytest.raises(UnsupportedConfigError, match="page 1, head 1"):
        encode(k, v, scope="per_page_head", page_size=16, backend="triton")


def test_triton_fp16_scales_and_saturate_use_unfused_path():
    k = torch.randn(24, 2, 16, device=DEV).half()
    v = (torch.randn(24, 2, 16, device=DEV) * 9).half()
    v[3, 0, 0] = float("inf")
    kw = dict(scope="per_page_head", page_size=8, scale_dtype=torch.float16, nonfinite="saturate")
    assert encode(k, v, backend="torch", **kw) == encode(k, v, backend="triton", **kw)


@pytest.mark.parametrize("scope", ["per_tensor", "per_layer_head", "per_page_head"])
def test_encode_layers_fused_equals_per_layer(scope):
    from kvcodec import encode_layers

    g = torch.Generator().manual_seed(3)
    ks = torch.randn(4, 3, 8, 2, 16, generator=g).half().to(DEV)  # [L, pages, page_size, H, D]
    vs = (torch.randn(4, 3, 8, 2, 16, generator=g) * 4).half().to(DEV)
    kw = dict(scope=scope, hashes={"model_id": "m"}, chunk_id=5)
    fused = encode_layers(ks, vs, layer_ids=[10, 11, 12, 13], backend="triton", **kw)
    ref = [encode(ks[i], vs[i], layer_id=10 + i, backend="torch", **kw) for i in range(4)]
    assert fused == ref


def test_encode_layers_fused_names_the_nan_layer():
    from kvcodec import encode_layers
    from kvcodec.errors import UnsupportedConfigError

    ks = torch.zeros(3, 16, 2, 8, dtype=torch.float16, device=DEV)
    vs = torch.ones(3, 16, 2, 8, dtype=torch.float16, device=DEV)
    vs[2, 9, 1, 0] = float("inf")
    with pytest.raises(UnsupportedConfigError, match=r"layer 2: .*page 1, head 1"):
        encode_layers(ks, vs, scope="per_page_head", page_size=8, backend="triton")
