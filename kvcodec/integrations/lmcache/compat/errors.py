"""``lmcache.v1.kv_codec.errors``: LMCache's error names, which are kvcodec's own classes.

A caller catching LMCache's ``CorruptEncodedKVError`` catches kvcodec's, since
they are the same class. LMCache words its messages with fixed phrases some
callers match on; :func:`with_lmcache_phrase` puts the phrase LMCache 0.5.6
uses for a failure in front of kvcodec's message, chosen by the error's
``reason`` (never by parsing the message).
"""

from __future__ import annotations

from ....errors import CodecError, CodecMismatchError, CorruptEncodedKVError, Reason, UnsupportedConfigError

__all__ = ["CodecError", "CodecMismatchError", "CorruptEncodedKVError", "UnsupportedConfigError"]

LMCACHE_PHRASES: dict[Reason, str] = {
    Reason.UNKNOWN_DTYPE_ID: "unknown dtype index",
    Reason.NO_DTYPE_ID: "unknown dtype: not in protocol DTYPE_TO_INT mapping",
    Reason.UNSUPPORTED_VERSION: "unsupported codec version",
    Reason.RESERVED_NONZERO: "nonzero reserved/scale_scheme slot",
    Reason.UNKNOWN_SCHEME: "unknown scale_scheme",
    Reason.UNKNOWN_SCOPE_ID: "unknown scale_scope index",
    Reason.NEGATIVE_PAYLOAD_LEN: "negative payload length",
    Reason.TRUNCATED_PAYLOAD: "buffer truncated mid-payload",
    Reason.SCALE_RANK_OUT_OF_RANGE: "implausible scale_shape_n",
    Reason.CRC_MISMATCH: "payload CRC mismatch",
}
"""The phrase LMCache 0.5.6 raises for the same failure, for callers that match on it."""


def with_lmcache_phrase(e: CodecError) -> CodecError:
    """``e`` (same class and reason) with LMCache's phrase for its reason in front, if LMCache has one."""
    phrase = LMCACHE_PHRASES.get(e.reason)
    return e if phrase is None else type(e)(f"{phrase}: {e}", reason=e.reason)
