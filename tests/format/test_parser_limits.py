"""The format layer's limits: sizes that would overflow later are refused at parse time, anything that
is not a readable byte buffer is a CodecError, and the header writer refuses what it cannot write."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from kvcodec import CodecError, UnsupportedConfigError, decode, parse
from kvcodec.errors import CorruptEncodedKVError, Reason
from tests._helpers import raw_blob
from tests.raises import raises_reason


def test_overflowing_dimensions_are_refused_by_parse() -> None:
    blob = raw_blob(
        scope=0,
        kv_head_count=2**32,
        head_dim=2**32,
        chunk_size=-1,
        page_size=-1,
        scale_shape=(),
        k=b"",
        v=b"",
        s=b"\x00\x00\x80\x3f",
    )
    with raises_reason(CorruptEncodedKVError, Reason.LIMIT_EXCEEDED):
        parse(blob)


def _released() -> memoryview:
    mv = memoryview(b"LMCKV")
    mv.release()
    return mv


def _closed_mmap() -> mmap.mmap:
    m = mmap.mmap(-1, 4096)
    m.close()
    return m


@pytest.mark.parametrize(
    "make",
    [
        _released,
        _closed_mmap,
        lambda: np.zeros(4, dtype="datetime64[s]"),
        lambda: torch.nested.nested_tensor([torch.zeros(3), torch.zeros(2)], layout=torch.jagged),
        lambda: torch.zeros(8, dtype=torch.uint8).to_sparse(),
        lambda: "not a buffer",
    ],
    ids=["released-memoryview", "closed-mmap", "datetime64", "nested-tensor", "sparse-tensor", "str"],
)
def test_odd_buffers_are_codec_errors(make) -> None:
    for fn in (parse, decode):
        with pytest.raises(CodecError):
            fn(make())


def test_format_writer_escapes_are_config_errors() -> None:
    from kvcodec.format import Header, HeaderPacker, header_size, serialize_header

    base = {"k_dtype": "float16", "v_dtype": "float8_e4m3fn", "scale_scope": 0}
    for bad in ({"version": 1.0}, {"scale_shape": None}):
        with pytest.raises(UnsupportedConfigError):
            serialize_header(Header(**base, **bad), crc=0)
    assert header_size(Header(**base, hashes={"model_id": "m"})) > 0
    packer = HeaderPacker(Header(**base))
    for buf, ids in ((bytearray(8), (0, 0)), (bytes(4096), (0, 0)), (bytearray(4096), (None, 0))):
        with pytest.raises(UnsupportedConfigError):
            packer.pack_into(buf, layer_id=ids[0], chunk_id=ids[1], crc=0)
