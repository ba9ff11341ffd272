"""kvcodec: LMCKV KV-cache blobs, K bit-exact at FP16/BF16 and V in FP8.

Importing this package never imports Triton nor initialises CUDA.
"""

from __future__ import annotations

from .codec import DecodedKV, check_hashes, decode, encode, encode_layers
from .errors import CodecError, CodecMismatchError, CorruptEncodedKVError, UnsupportedConfigError
from .format import Hashes, Header, ParsedBlob, ScaleScheme, ScaleScope, parse, serialize_header

__version__ = "0.1.0"

__all__ = [
    "CodecError",
    "CodecMismatchError",
    "CorruptEncodedKVError",
    "DecodedKV",
    "Hashes",
    "Header",
    "ParsedBlob",
    "ScaleScheme",
    "ScaleScope",
    "UnsupportedConfigError",
    "__version__",
    "check_hashes",
    "decode",
    "encode",
    "encode_layers",
    "parse",
    "serialize_header",
]
