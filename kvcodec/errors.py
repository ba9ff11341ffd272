"""Error classes of the codec: every failure raises exactly one of these."""

from __future__ import annotations

__all__ = [
    "CodecError",
    "CodecMismatchError",
    "CorruptEncodedKVError",
    "UnsupportedConfigError",
]


class CodecError(Exception):
    """Base of every error kvcodec raises on purpose."""


class CodecMismatchError(CodecError):
    """The blob is valid but was written under another config (model, layout, ...)."""


class CorruptEncodedKVError(CodecError):
    """The blob's bytes are malformed, truncated, inconsistent or fail the CRC."""


class UnsupportedConfigError(CodecError):
    """The caller asked for something the codec cannot do (bad shape, dtype, scope...)."""
