"""What the kvcodec serde refuses, and the destinations it really fills (issue 18's findings).

Each test here failed on the serde before the fix: a strided destination was "filled" through a
copy, bad shapes escaped as RuntimeError/TypeError, a blob without model_id or of another
[L, T] split loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc

import kvcodec
from kvcodec.errors import Reason
from kvcodec.integrations.lmcache import serde
from tests.integrations.lmcache._objs import memory_obj
from tests.raises import raises_reason

HEAD_DIM = 32
SHAPE = (2, 4, 16, 2 * HEAD_DIM)  # [2, layers, tokens, heads * head_dim]


@dataclass
class FakeObj:
    """A memory object as LMCache's serde sees one: declared shapes/dtypes and a tensor."""

    tensor: torch.Tensor | None
    shapes: list
    dtypes: list

    def get_shapes(self) -> list:
        return self.shapes

    def get_dtypes(self) -> list:
        return self.dtypes


def _kv(shape=SHAPE, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def _pair(**opts) -> tuple[serde.KvcodecSerializer, serde.KvcodecDeserializer]:
    cfg = serde.KvcodecSerdeConfig.from_kwargs({"head_dim": HEAD_DIM, **opts})
    return serde.KvcodecSerializer(cfg), serde.KvcodecDeserializer(cfg)


def _blob(x: torch.Tensor, **opts):
    ser, _ = _pair(**opts)
    n = ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[torch.Size(x.shape)], dtypes=[x.dtype]))
    dst = memory_obj((n,), torch.uint8)
    assert ser.serialize(memory_obj(tuple(x.shape), x.dtype, x), dst) == n
    return dst


# ----------------------------------------------------------------------------
# Strided destinations: filled for real, or refused
# ----------------------------------------------------------------------------


def test_strided_destination_is_really_filled():
    x = _kv()
    strided = torch.zeros(SHAPE[::-1], dtype=torch.bfloat16).permute(3, 2, 1, 0)  # SHAPE, not contiguous
    assert strided.shape == SHAPE and not strided.is_contiguous()
    _, des = _pair()
    des.deserialize(_blob(x), FakeObj(strided, [torch.Size(SHAPE)], [torch.bfloat16]))
    assert torch.equal(
        strided[0].view(torch.int16), x[0].view(torch.int16)
    )  # K bit-exact, in the caller's memory
    assert float((strided[1].float() - x[1].float()).abs().max()) <= float(x[1].float().abs().max()) * 2**-4


def test_strided_serialize_destination_is_refused():
    x = _kv()
    ser, _ = _pair()
    n = ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.bfloat16]))
    strided = torch.zeros(4, -(-n // 4), dtype=torch.uint8).t()  # a reshape(-1) of it is a copy
    dst = FakeObj(strided, [torch.Size(strided.shape)], [torch.uint8])
    with pytest.raises(kvcodec.UnsupportedConfigError, match="contiguous"):
        ser.serialize(memory_obj(SHAPE, torch.bfloat16, x), dst)
    assert not strided.any()


def test_strided_source_is_read_right():
    x = _kv()
    strided = x.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)
    ser, des = _pair()
    n = ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.bfloat16]))
    dst = memory_obj((n,), torch.uint8)
    ser.serialize(FakeObj(strided, [torch.Size(SHAPE)], [torch.bfloat16]), dst)
    back = memory_obj(SHAPE, torch.bfloat16)
    des.deserialize(dst, back)
    assert torch.equal(back.tensor[0].view(torch.int16), x[0].view(torch.int16))


# ----------------------------------------------------------------------------
# Shapes and objects it cannot serve: UnsupportedConfigError, nothing raw
# ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        (2, -4, 16, 64),  # negative
        (2, 4, 0, 64),  # empty
        (2, 2**40, 2**20, 64),  # overflows any sane size
        (2, 4, 16.5, 64),  # not an int
        (2, 4, True, 64),  # a bool is not a dim
        None,
        "2,4,16,64",
    ],
)
def test_bad_declared_shapes_refused(shape):
    ser, _ = _pair()
    with pytest.raises(kvcodec.UnsupportedConfigError):
        ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[shape], dtypes=[torch.bfloat16]))


@pytest.mark.parametrize("shapes,dtypes", [(None, None), ([], []), ([torch.Size(SHAPE)], ["bfloat16"])])
def test_bad_layout_lists_refused(shapes, dtypes):
    ser, _ = _pair()
    with pytest.raises(kvcodec.UnsupportedConfigError):
        ser.estimate_serialized_size(SimpleNamespace(shapes=shapes, dtypes=dtypes))


def test_destination_smaller_than_its_shape_refused():
    _, des = _pair()
    small = torch.zeros(SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3] - 1, dtype=torch.bfloat16)
    with raises_reason(kvcodec.UnsupportedConfigError, Reason.BAD_OUTPUT):
        des.deserialize(_blob(_kv()), FakeObj(small, [torch.Size(SHAPE)], [torch.bfloat16]))


def test_odd_length_uint8_source_refused():
    ser, _ = _pair()
    n = ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.bfloat16]))
    odd = torch.zeros(2 * 4 * 16 * 64 * 2 + 1, dtype=torch.uint8)
    with raises_reason(kvcodec.UnsupportedConfigError, Reason.BAD_SHAPE):
        ser.serialize(FakeObj(odd, [torch.Size(SHAPE)], [torch.bfloat16]), memory_obj((n,), torch.uint8))


@pytest.mark.parametrize("extra", [-64, 64])
def test_source_of_the_wrong_size_refused(extra):
    ser, _ = _pair()
    n = ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.bfloat16]))
    src = torch.zeros(2 * 4 * 16 * 64 + extra, dtype=torch.bfloat16)
    with pytest.raises(kvcodec.UnsupportedConfigError, match="holds"):
        ser.serialize(FakeObj(src, [torch.Size(SHAPE)], [torch.bfloat16]), memory_obj((n,), torch.uint8))


def test_serialize_destination_too_small_refused():
    ser, _ = _pair()
    n = ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.bfloat16]))
    with raises_reason(kvcodec.UnsupportedConfigError, Reason.BAD_OUTPUT):
        ser.serialize(memory_obj(SHAPE, torch.bfloat16, _kv()), memory_obj((n - 1,), torch.uint8))


@pytest.mark.parametrize("what", ["source", "destination"])
def test_missing_tensor_refused(what):
    _, des = _pair()
    blob = _blob(_kv())
    with raises_reason(
        kvcodec.UnsupportedConfigError, Reason.BAD_BUFFER if what == "source" else Reason.BAD_TYPE
    ):
        if what == "source":
            des.deserialize(
                FakeObj(None, blob.get_shapes(), blob.get_dtypes()), memory_obj(SHAPE, torch.bfloat16)
            )
        else:
            des.deserialize(blob, FakeObj(None, [torch.Size(SHAPE)], [torch.bfloat16]))


def test_truncated_blob_is_a_codec_error():
    _, des = _pair()
    blob = _blob(_kv())
    cut = FakeObj(blob.tensor[:-100], [torch.Size((blob.get_size() - 100,))], [torch.uint8])
    with raises_reason(kvcodec.CorruptEncodedKVError, Reason.TRUNCATED_PAYLOAD):
        des.deserialize(cut, memory_obj(SHAPE, torch.bfloat16))


# ----------------------------------------------------------------------------
# Identity: strict model, the object's split and codec settings bound into each blob
# ----------------------------------------------------------------------------


def test_blob_without_model_refused_when_a_model_is_configured():
    _, des = _pair(model="meta-llama/Llama-3.1-8B")
    with pytest.raises(kvcodec.CodecMismatchError, match="model_id"):
        des.deserialize(_blob(_kv()), memory_obj(SHAPE, torch.bfloat16))


def test_blob_of_a_model_loads_into_the_same_model():
    _, des = _pair(model="m")
    back = memory_obj(SHAPE, torch.bfloat16)
    x = _kv()
    des.deserialize(_blob(x, model="m"), back)
    assert torch.equal(back.tensor[0].view(torch.int16), x[0].view(torch.int16))


@pytest.mark.parametrize(
    "other_shape",
    [
        (2, 2, 32, 2 * HEAD_DIM),  # 2 layers x 32 tokens: the same L*T
        (2, 8, 8, 2 * HEAD_DIM),
    ],
)
def test_another_layer_token_split_refused(other_shape):
    _, des = _pair()
    with pytest.raises(kvcodec.CodecMismatchError, match="kv_layout"):
        des.deserialize(_blob(_kv()), memory_obj(other_shape, torch.bfloat16))


def test_blob_names_its_split_and_settings():
    blob = _blob(_kv(), model="m", page_size=8)
    tag = kvcodec.parse(blob.tensor.numpy(), strict=True).header.hashes.kv_layout
    assert tag == "lmcache-mp:[2,4,16,2*32]:bfloat16:per_page_head/8"


@pytest.mark.parametrize("opts", [{"page_size": 8}, {"scope": "per_layer_head"}])
def test_other_codec_settings_refused(opts):
    _, des = _pair()
    with pytest.raises(kvcodec.CodecMismatchError, match="kv_layout"):
        des.deserialize(_blob(_kv(), **opts), memory_obj(SHAPE, torch.bfloat16))


def test_another_head_split_refused():
    x = _kv()
    ser = serde.KvcodecSerializer(serde.KvcodecSerdeConfig.from_kwargs({"head_dim": HEAD_DIM // 2}))
    n = ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.bfloat16]))
    dst = memory_obj((n,), torch.uint8)
    ser.serialize(memory_obj(SHAPE, torch.bfloat16, x), dst)
    _, des = _pair()
    with pytest.raises(kvcodec.CodecError):
        des.deserialize(dst, memory_obj(SHAPE, torch.bfloat16))


@pytest.mark.parametrize(
    "opts,reason",
    [
        ({"head_dim": HEAD_DIM, "use_mla": True}, Reason.BAD_VALUE),
        ({"head_dim": HEAD_DIM, "no_such_option": 1}, Reason.BAD_VALUE),
        ({}, Reason.MISSING_ARGUMENT),
        ({"head_dim": "32"}, Reason.BAD_TYPE),
        ({"head_dim": 0}, Reason.BAD_VALUE),
        ({"head_dim": HEAD_DIM, "scope": "external"}, Reason.BAD_SCOPE),
        ({"head_dim": HEAD_DIM, "model": "a@b"}, Reason.BAD_HASH),
    ],
)
def test_config_refusals_name_their_reason(opts, reason):
    with raises_reason(kvcodec.UnsupportedConfigError, reason):
        serde.KvcodecSerdeConfig.from_kwargs(opts)


def test_an_unsupported_dtype_or_split_names_its_reason():
    ser, _ = _pair()
    with raises_reason(kvcodec.UnsupportedConfigError, Reason.UNSUPPORTED_DTYPE):
        ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[torch.int8]))
    with raises_reason(kvcodec.UnsupportedConfigError, Reason.BAD_SHAPE):
        ser.estimate_serialized_size(
            MemoryLayoutDesc(shapes=[torch.Size((2, 4, 16, 33))], dtypes=[torch.half])
        )
