"""Bad arguments to encode and decode are UnsupportedConfigError (never a plain exception), and odd
but legal ones (generators, lazily negated tensors, empty chunks) work."""

from __future__ import annotations

import pytest
import torch

import kvcodec
from kvcodec import UnsupportedConfigError, decode, encode
from kvcodec.errors import Reason
from tests.raises import raises_reason


def _kv(t: int = 8, h: int = 2, d: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t * h * d)
    return torch.randn(t, h, d, generator=g).half(), torch.randn(t, h, d, generator=g).half()


def _backends() -> list[str]:
    from kvcodec.backends import cpu

    return ["torch", "cpu"] if cpu.AVAILABLE else ["torch"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"shape": (-32, -2, 16)},
        {"shape": (0.5, 64, 32)},
        {"shape": "abc"},
        {"device": "bogus"},
        {"device": "cuda"} if not torch.cuda.is_available() else {"device": "bogus2"},
        {"out_v_dtype": torch.int32},
        {"backend": "nope"},
    ],
    ids=str,
)
def test_bad_decode_arguments_are_config_errors(kwargs: dict) -> None:
    k, v = _kv()
    blob = encode(k, v, scope="per_tensor")
    with pytest.raises(UnsupportedConfigError):
        decode(blob, out_v_dtype=kwargs.pop("out_v_dtype", torch.float16), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "make"),
    [
        ({"page_size": 2.5, "scope": "per_page_head"}, None),
        ({"page_size": True, "scope": "per_page_head"}, None),
        ({"layer_id": -5}, None),
        ({"bogus_option": 1}, None),
        ({}, lambda k, v: (k.to("meta"), v.to("meta"))),
        ({}, lambda k, v: (k, v.to_sparse())),
        ({}, lambda k, v: (k.numpy(), v)),
    ],
    ids=["page_size-float", "page_size-bool", "layer_id", "unknown-option", "meta", "sparse", "numpy-k"],
)
def test_bad_encode_arguments_are_config_errors(kwargs: dict, make) -> None:
    k, v = _kv()
    if make is not None:
        k, v = make(k, v)
    with pytest.raises(UnsupportedConfigError):
        encode(k, v, **{"scope": "per_tensor", **kwargs})


@pytest.mark.parametrize(
    "call",
    [
        lambda k, v: encode(k, v, scope="per_tensor", version=1.0),
        lambda k, v: encode(k, v, scope="per_tensor", head_axis="1"),
        lambda k, v: encode(k, v, scope="per_tensor", head_axis=1.0),
        lambda k, v: encode(k, v, scope="per_tensor", backend=5),
        lambda k, v: decode(encode(k, v, scope="per_tensor"), backend=3),
        lambda k, v: decode(
            encode(k, v, scope="per_tensor"), out_v_dtype=torch.float16, shape=(0, 2**62, 2**62)
        ),
        lambda k, v: decode(encode(k, v, scope="per_tensor"), shape=(0, 2**70, 1)),
        lambda k, v: kvcodec.backend_info("bogus"),
    ],
    ids=[
        "version-float",
        "head_axis-str",
        "head_axis-float",
        "backend-int",
        "decode-backend-int",
        "shape-overflow",
        "shape-huge",
        "backend_info-bogus",
    ],
)
def test_argument_escapes_are_config_errors(call) -> None:
    k, v = _kv()
    with pytest.raises(UnsupportedConfigError):
        call(k, v)


@pytest.mark.parametrize(
    ("scale", "sdt"),
    [(0.0, torch.float32), (-1.0, torch.float32), (float("nan"), torch.float32), (1e6, torch.float16)],
)
def test_unusable_external_scales_are_refused(scale: float, sdt: torch.dtype) -> None:
    k, v = _kv(4, 1, 4)
    with raises_reason(UnsupportedConfigError, Reason.BAD_SCALES):
        encode(k, v, scope="external", scales=torch.tensor(scale), scale_dtype=sdt)


def test_tiny_fp32_v_is_refused_not_decoded_as_nan() -> None:
    v = torch.tensor([1e-43, 0.0, -1e-44, 0.0]).view(4, 1, 1)
    for backend in _backends():
        with raises_reason(UnsupportedConfigError, Reason.BAD_SCALES):
            encode(v.clone(), v, scope="per_tensor", backend=backend)


def test_encode_layers_takes_any_iterables() -> None:
    k, v = _kv()
    got = kvcodec.encode_layers((x for x in [k, k]), (x for x in [v, v]), scope="per_tensor")
    assert got == [encode(k, v, scope="per_tensor", layer_id=i) for i in range(2)]


def test_lazily_negated_inputs_keep_their_sign() -> None:
    k, v = _kv(16, 2, 8)
    for backend in _backends():
        got = decode(encode(torch._neg_view(k), torch._neg_view(v), scope="per_tensor", backend=backend))
        want = decode(encode(-k, -v, scope="per_tensor", backend=backend))
        assert torch.equal(got.k, -k) and torch.equal(got.v.view(torch.uint8), want.v.view(torch.uint8))


def test_empty_chunks_are_not_counted_as_fallbacks() -> None:
    from kvcodec import backends

    blob = encode(torch.empty(0, 2, 4).half(), torch.empty(0, 2, 4).half(), scope="per_tensor")
    before = sum(f["count"] for f in backends.backend_info()["fallbacks"])
    decode(blob, out_v_dtype=torch.float16)
    assert sum(f["count"] for f in backends.backend_info()["fallbacks"]) == before
