"""The codec: K/V tensors to LMCKV blobs (:mod:`.encode`) and back (:mod:`.decode`)."""

from __future__ import annotations

from .decode import DecodedKV, DecodeRequest, decode, decode_parsed
from .dtypes import from_torch, to_torch
from .encode import EncodePlan, encode, encode_layers, encoded_size, external_scope, plan_encode
from .layout import Layout, check_hashes, normalize_layout, resolve_scope
from .spec import DEFAULT_VERSION, EncodeSpec

__all__ = [
    "DEFAULT_VERSION",
    "DecodeRequest",
    "DecodedKV",
    "EncodePlan",
    "EncodeSpec",
    "Layout",
    "check_hashes",
    "decode",
    "decode_parsed",
    "encode",
    "encode_layers",
    "encoded_size",
    "external_scope",
    "from_torch",
    "normalize_layout",
    "plan_encode",
    "resolve_scope",
    "to_torch",
]
