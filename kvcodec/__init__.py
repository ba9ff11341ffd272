"""kvcodec: LMCKV KV-cache blobs, K bit-exact at FP16/BF16 and V in FP8.

``import kvcodec`` is light: the format layer (pure Python) loads on first
use of a name, the codec (torch) likewise. It never imports Triton nor
initialises CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import CodecError, CodecMismatchError, CorruptEncodedKVError, Reason, UnsupportedConfigError

__version__ = "0.1.0"

_LAZY = {
    "DecodedKV": "codec",
    "EncodeSpec": "codec",
    "check_hashes": "codec",
    "decode": "codec",
    "encode": "codec",
    "encode_layers": "codec",
    "encoded_size": "codec",
    "backend_info": "backends",
    "Hashes": "format",
    "Header": "format",
    "ParsedBlob": "format",
    "ScaleScheme": "format",
    "ScaleScope": "format",
    "parse": "format",
    "serialize_header": "format",
}

__all__ = [
    "CodecError",
    "CodecMismatchError",
    "CorruptEncodedKVError",
    "Reason",
    "UnsupportedConfigError",
    "__version__",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcodec' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
