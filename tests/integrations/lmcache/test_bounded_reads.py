"""Readers of the LMCache layer allocate by the bytes a blob holds, never by the sizes it declares.

Each blob here declares a payload of 2**47 bytes (128 TiB: under the format's
limit, far over any machine) in a buffer of a few hundred bytes. A reader
that sized an allocation by the declaration before comparing it with the
bytes present would fail with torch's or numpy's allocation error instead of
the blob's own ``TRUNCATED_PAYLOAD``.
"""

from __future__ import annotations

import pytest
import torch

import kvcodec.integrations.lmcache.compat as compat
from kvcodec.errors import CorruptEncodedKVError, Reason
from tests._helpers import raw_blob
from tests.raises import raises_reason

_HUGE = 1 << 47


def _record() -> compat.EncodedKV:
    codec = compat.AsymK16V8Codec(scale_scope=compat.ScaleScope.PER_TENSOR)
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(8, 2, 16, generator=g).half() for _ in range(2))
    return compat.deserialize_header(codec.to_bytes(codec.encode(k, v)))


@pytest.mark.parametrize("section", ["k_len", "v_len", "s_len"])
def test_deserialize_header_checks_a_declared_length_against_the_buffer(section):
    with raises_reason(CorruptEncodedKVError, Reason.TRUNCATED_PAYLOAD):
        compat.deserialize_header(raw_blob(**{section: _HUGE}))


@pytest.mark.parametrize("field", ["k_payload_len", "v_payload_len", "scale_payload_len"])
def test_decode_checks_a_records_lengths_against_its_payload(field):
    enc = _record()
    setattr(enc, field, _HUGE)
    with raises_reason(CorruptEncodedKVError, Reason.TRUNCATED_PAYLOAD):
        compat.AsymK16V8Codec().decode(enc, out_v_dtype=torch.float32)


def test_decode_of_a_record_without_its_payload_allocates_nothing():
    enc = _record()
    enc.payload = bytes(enc.payload)[:16]
    with raises_reason(CorruptEncodedKVError, Reason.TRUNCATED_PAYLOAD):
        compat.AsymK16V8Codec().decode(enc)


def test_serde_reads_a_blob_by_the_bytes_it_holds():
    pytest.importorskip("lmcache.v1.distributed.serde", reason="LMCache's serde (make lmcache-full)")
    from kvcodec.integrations.lmcache import serde
    from tests.integrations.lmcache._objs import memory_obj

    des = serde.KvcodecDeserializer(serde.KvcodecSerdeConfig.from_kwargs({"head_dim": 4}))
    blob = raw_blob(k_len=_HUGE)
    src = memory_obj((len(blob),), torch.uint8, torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    with raises_reason(CorruptEncodedKVError, Reason.TRUNCATED_PAYLOAD):
        des.deserialize(src, memory_obj((2, 1, 4, 8), torch.float16))
