"""What an encode is asked to do, as one dataclass instead of a long keyword list."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from operator import attrgetter
from typing import Any

import torch

from ..errors import Reason, UnsupportedConfigError
from ..format import Hashes
from ..numerics import NonFinitePolicy
from .layout import ScopeLike

__all__ = ["DEFAULT_VERSION", "EncodeSpec"]

DEFAULT_VERSION = 2
"""kvcodec's own blobs are sealed (CRC over header and payload); LMCache 0.5.6 reads only version 1."""


@dataclass(frozen=True)
class EncodeSpec:
    """Every option of :func:`kvcodec.encode` (each is also accepted as a keyword there)."""

    scope: ScopeLike = "per_page_head"
    """"per_tensor", "per_layer_head", "per_page_head", "external" (caller's scales) or "raw" (unit scale, v2)."""
    page_size: int | None = None
    """Tokens per page (per_page_head); taken from a paged 4-D input when None."""
    head_axis: int | None = None
    page_axis: int | None = None
    """Axes of K/V when they are not ``[tokens, heads, head_dim]`` / ``[pages, page_size, heads, head_dim]``."""
    hashes: Any = None
    """Identity of the model (a :class:`~kvcodec.format.Hashes`, a mapping, or an object with its fields)."""
    layer_id: int = -1
    chunk_id: int = -1
    chunk_size: int | None = None
    kv_head_count: int | None = None
    head_dim: int | None = None
    """Layout fields; None takes them from the tensors."""
    v_dtype: torch.dtype = torch.float8_e4m3fn
    allow_e5m2: bool = False
    scale_dtype: torch.dtype = torch.float32
    scales: torch.Tensor | float | None = None
    """An external scope's scales."""
    precomputed_v_quant: torch.Tensor | None = None
    precomputed_v_scales: torch.Tensor | None = None
    """FP8 V already quantized (e.g. an FP8 KV cache) and its scales: passed through."""
    nonfinite: NonFinitePolicy = "error"
    version: int = DEFAULT_VERSION
    store_scales: bool | None = None
    """Keep an external scope's scales in the payload too (LMCache does with attached scales)."""
    backend: str | None = None
    compression: str = "none"
    """"none" (the plain payload) or "lossless" (K's exponent plane and V's codes Huffman-coded, v2)."""

    @classmethod
    def of(cls, spec: EncodeSpec | None, options: dict[str, Any]) -> EncodeSpec:
        """``spec`` with ``options`` applied; unknown option names are refused."""
        unknown = sorted(set(options) - _NAMES)
        if unknown:
            raise UnsupportedConfigError(
                f"unknown encode option(s) {unknown}; see kvcodec.EncodeSpec", reason=Reason.BAD_VALUE
            )
        if spec is None:
            return cls(**options)
        if not isinstance(spec, cls):
            raise UnsupportedConfigError(
                f"spec is a {type(spec).__name__}; expected EncodeSpec", reason=Reason.BAD_TYPE
            )
        return spec.replace(**options) if options else spec

    def cache_key(self) -> tuple[Any, ...] | None:
        """The options that shape a blob's layout (all but the ids), or None when they carry data."""
        if (
            self.scales is not None
            or self.precomputed_v_quant is not None
            or self.precomputed_v_scales is not None
        ):
            return None
        key = (
            Hashes.coerce(self.hashes),
            *_LAYOUT_OF(self),
            *map(type, _INTS_OF(self)),
        )  # 1.0, True are not 1
        try:
            hash(key)
        except TypeError:  # e.g. hashes given as a dict
            return None
        return key

    def replace(self, **changes: Any) -> EncodeSpec:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)


_NAMES = frozenset(f.name for f in fields(EncodeSpec))
_INT_NAMES = ("page_size", "chunk_size", "kv_head_count", "head_dim", "version", "head_axis", "page_axis")
_LAYOUT_NAMES = tuple(
    sorted(
        _NAMES - {"layer_id", "chunk_id", "scales", "precomputed_v_quant", "precomputed_v_scales", "hashes"}
    )
)
_LAYOUT_OF, _INTS_OF = attrgetter(*_LAYOUT_NAMES), attrgetter(*_INT_NAMES)
