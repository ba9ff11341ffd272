"""Drop-in surface of LMCache's ``lmcache.v1.kv_codec`` (0.5.6), backed by kvcodec.

Names, signatures, defaults and error types follow LMCache so connector code
runs unchanged; the work is done by :mod:`kvcodec.format`, :mod:`kvcodec.backends`
and :mod:`kvcodec.codec`. The package mirrors LMCache's: :mod:`.errors`,
:mod:`.encoded_kv` (the blob record and header functions) and
:mod:`.asym_k16_v8` (the codec and its quant primitives), each importable under
LMCache's module name once :func:`install` has run. Differences are deliberate
fixes: decode restores ``[tokens, heads, head_dim]`` shapes when the header
carries the layout and dequantizes every scope; the parser refuses malformed
blobs LMCache accepts; V is quantized by kvcodec's backends (the C loops on
CPU, Triton on CUDA), chosen and fallen back from in :mod:`kvcodec.backends` only.

Errors: everything this package raises on purpose is a :class:`CodecError`
subclass under LMCache's names, with kvcodec's ``reason``. Where LMCache lets a
plain exception escape (``AttributeError`` for a list in place of a tensor,
``RuntimeError`` for a bad ``device`` or a scale count that does not fit,
``ValueError`` for an unknown scope number), this package raises
:class:`UnsupportedConfigError` instead, and it checks the codec's scope and
scale dtype when the codec is built, not at its first encode. One deliberate
difference in what is accepted: a header is never written whose layout fields
would make kvcodec's decoder dequantize V under groups other than those V was
quantized in (a PER_PAGE_HEAD ``page_size`` other than the page axis's length;
``kv_head_count``/``head_dim`` that do not describe a caller layout's bytes),
so those encodes raise UnsupportedConfigError. NaN or Inf in V is refused in
every layout, as kvcodec's own encode does.

``install()`` registers this package as ``lmcache.v1.kv_codec`` (and its
``errors``, ``encoded_kv`` and ``asym_k16_v8`` modules) in ``sys.modules``.
"""

from __future__ import annotations

import importlib.util
import sys
import types

from . import asym_k16_v8, encoded_kv, errors
from .asym_k16_v8 import AsymK16V8Codec, compute_v_scales, dequantize_v_fp8, quantize_v_fp8
from .encoded_kv import (
    CODEC_MAGIC,
    CODEC_MAGIC_LEN,
    CodecHashes,
    CodecVersion,
    EncodedKV,
    ScaleScheme,
    ScaleScope,
    deserialize_header,
    encoded_kv_header_size,
    serialize_header,
)
from .errors import CodecError, CodecMismatchError, CorruptEncodedKVError, UnsupportedConfigError

__all__ = [
    "CODEC_MAGIC",
    "CODEC_MAGIC_LEN",
    "AsymK16V8Codec",
    "CodecError",
    "CodecHashes",
    "CodecMismatchError",
    "CodecVersion",
    "CorruptEncodedKVError",
    "EncodedKV",
    "ScaleScheme",
    "ScaleScope",
    "UnsupportedConfigError",
    "asym_k16_v8",
    "compute_v_scales",
    "dequantize_v_fp8",
    "deserialize_header",
    "encoded_kv",
    "encoded_kv_header_size",
    "errors",
    "install",
    "quantize_v_fp8",
    "serialize_header",
]

_SUBMODULES: dict[str, types.ModuleType] = {
    "errors": errors,
    "encoded_kv": encoded_kv,
    "asym_k16_v8": asym_k16_v8,
}
"""LMCache's ``kv_codec`` modules, each by the module of this package that serves it."""


def _real_lmcache_installed() -> bool:
    """Whether a real LMCache package can be imported (found on the path, or already imported)."""
    mod = sys.modules.get("lmcache")
    if mod is not None:
        return getattr(mod, "__file__", None) is not None
    try:
        return importlib.util.find_spec("lmcache") is not None
    except (ImportError, ValueError):
        return False


def install() -> types.ModuleType:
    """Register this package as ``lmcache.v1.kv_codec`` (+ its modules) in ``sys.modules``.

    With a real LMCache installed, its ``lmcache`` and ``lmcache.v1`` packages
    are imported as they are and only the ``lmcache.v1.kv_codec`` subtree is
    aliased to this package: nothing of LMCache is shadowed but the codec it
    asked for. Without LMCache, minimal ``lmcache``/``lmcache.v1`` namespace
    packages are created to hold it.
    """
    me = sys.modules[__name__]
    if _real_lmcache_installed():
        import lmcache.v1  # noqa: F401 - the real packages, imported before the alias
    else:
        for pkg in ("lmcache", "lmcache.v1"):
            if pkg not in sys.modules:
                mod = types.ModuleType(pkg)
                mod.__path__ = []  # a namespace-like package
                sys.modules[pkg] = mod
        sys.modules["lmcache"].v1 = sys.modules["lmcache.v1"]  # type: ignore[attr-defined]
    for sub, mod in _SUBMODULES.items():
        sys.modules[f"lmcache.v1.kv_codec.{sub}"] = mod
    sys.modules["lmcache.v1.kv_codec"] = me
    sys.modules["lmcache.v1"].kv_codec = me  # type: ignore[attr-defined]
    return me
