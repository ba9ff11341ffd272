"""Error classes of the codec: every failure raises exactly one of these.

Each error carries a machine-readable :class:`Reason` as ``e.reason`` so that
callers (and kvcodec's own LMCache compat layer) branch on the kind of failure,
never on the wording of the message. The message stays for humans.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = [
    "CodecError",
    "CodecMismatchError",
    "CorruptEncodedKVError",
    "Reason",
    "StoreUnavailableError",
    "UnsupportedConfigError",
]


class Reason(str, Enum):
    """The kind of a failure; the value is a stable lower-case string (``Reason.BAD_MAGIC == "bad_magic"``)."""

    # -- the blob's bytes (CorruptEncodedKVError) --
    CORRUPT = "corrupt"
    """Malformed in a way no more specific member names."""
    BAD_MAGIC = "bad_magic"
    UNSUPPORTED_VERSION = "unsupported_version"
    """A header version this codec does not read (or write)."""
    UNKNOWN_DTYPE_ID = "unknown_dtype_id"
    UNKNOWN_SCOPE_ID = "unknown_scope_id"
    UNKNOWN_SCHEME = "unknown_scheme"
    RESERVED_NONZERO = "reserved_nonzero"
    """A version-1 header's reserved slot is not 0."""
    FIELD_OUT_OF_RANGE = "field_out_of_range"
    """A header integer (layout field, scale dim, payload length) outside its legal range."""
    SCALE_RANK_OUT_OF_RANGE = "scale_rank_out_of_range"
    """``scale_shape_n`` outside 0..MAX_SCALE_DIMS."""
    NEGATIVE_PAYLOAD_LEN = "negative_payload_len"
    TRUNCATED_HEADER = "truncated_header"
    TRUNCATED_PAYLOAD = "truncated_payload"
    TRAILING_BYTES = "trailing_bytes"
    BAD_UTF8 = "bad_utf8"
    BAD_HASH_TABLE = "bad_hash_table"
    """Duplicate hash keys or more pairs than the limit."""
    CRC_MISMATCH = "crc_mismatch"
    INCONSISTENT_PAYLOAD = "inconsistent_payload"
    """K, V and scale lengths that do not describe one tensor (or contradict the layout fields)."""
    BAD_SCALE_SHAPE = "bad_scale_shape"
    """Stored ``scale_shape`` / scale bytes that do not fit the scope and payload."""
    BAD_SCALE = "bad_scale"
    """A stored scale encode never writes: NaN, Inf, zero or negative."""
    BAD_STREAM = "bad_stream"
    """A lossless blob's coded stream that does not decode to exactly the bytes its geometry gives:
    not deflate, truncated, longer (a decompression bomb), or followed by bytes of its own."""
    BAD_CODE = "bad_code"
    """A V code encode never writes: an FP8 NaN (or e5m2 ±Inf) code, or V that decodes to NaN/Inf."""

    # -- a valid blob written under another config (CodecMismatchError) --
    MISMATCH = "mismatch"
    HASH_MISMATCH = "hash_mismatch"
    HASH_MISSING = "hash_missing"
    """A strict check found the expected hash absent from the blob."""

    # -- what the caller asked for (UnsupportedConfigError) --
    UNSUPPORTED = "unsupported"
    """A request the codec cannot serve that no more specific member names."""
    BAD_TYPE = "bad_type"
    """An argument of the wrong Python type (a list for a tensor, a str for an int, ...)."""
    BAD_VALUE = "bad_value"
    """An argument of the right type but an illegal value (negative count, unknown option)."""
    UNSUPPORTED_DTYPE = "unsupported_dtype"
    NO_DTYPE_ID = "no_dtype_id"
    """A torch/numpy dtype the LMCKV format has no id for."""
    BAD_SHAPE = "bad_shape"
    BAD_SCOPE = "bad_scope"
    """An unknown scale scope, or one that does not apply to the request."""
    BAD_SCALES = "bad_scales"
    """Caller-given scales that do not fit the scope or contradict the blob's."""
    MISSING_ARGUMENT = "missing_argument"
    """A needed input is absent (scales for scope external, page_size, K for a cache, ...)."""
    NONFINITE_V = "nonfinite_v"
    OVERLAP = "overlap"
    """An output shares memory with an input (or with another output)."""
    BAD_OUTPUT = "bad_output"
    """An ``out=`` buffer or tensor that is too small, read-only, or of the wrong dtype."""
    BAD_DEVICE = "bad_device"
    BAD_BUFFER = "bad_buffer"
    """Something that is not a readable, contiguous bytes-like buffer."""
    BAD_HASH = "bad_hash"
    """A caller's hash value that cannot be written (unknown key, not str, too long)."""
    LIMIT_EXCEEDED = "limit_exceeded"
    """A size over one of the codec's limits (elements per token, store max_bytes, ...)."""
    BAD_KEY = "bad_key"
    """A store key that cannot name a blob (empty, too long, unsafe characters)."""
    STORE_FULL = "store_full"
    """A put that found no room under the store's byte cap."""
    BAD_CHECKPOINT = "bad_checkpoint"
    """A model folder or file that could not be loaded (malformed config, weights or header)."""
    BACKEND_UNAVAILABLE = "backend_unavailable"
    """A backend asked for by name that cannot run here (not built, not installed, or not for this device)."""
    STORE_AUTH = "store_auth"
    """A store that refused this client's credentials or permissions (wrong password, ACL): a config error."""
    STORE_READONLY = "store_readonly"
    """A store that refuses every write (a read-only Redis replica named by the URL): a config error."""

    # -- a blob that is not to be trusted (CorruptEncodedKVError) --
    BAD_MAC = "bad_mac"
    """A store with a fleet key found a blob without a valid MAC: written by someone without the key."""
    SIZE_MISMATCH = "size_mismatch"
    """A stored object whose size is not the header + payload its header declares, or larger than the
    blob its reader expects."""
    WRONG_TYPE = "wrong_type"
    """A store key holding another kind of value than a blob (a Redis list or hash under a blob's name)."""

    # -- the store itself (StoreUnavailableError) --
    STORE_UNAVAILABLE = "store_unavailable"
    """The store could not be reached (connection refused, node down)."""
    STORE_TIMEOUT = "store_timeout"
    """A store call ran past its timeout."""
    STORE_PROTOCOL = "store_protocol"
    """A store server answered with a reply its command never gives (not a Redis, or a broken proxy)."""

    def __str__(self) -> str:
        return self.value


class CodecError(Exception):
    """Base of every error kvcodec raises on purpose; ``reason`` says which kind of failure it is.

    ``CodecError(message)`` still works; raise sites pass ``reason=Reason.X``
    and each subclass supplies a default for those that do not.
    """

    default_reason: Reason = Reason.UNSUPPORTED

    def __init__(self, *args: Any, reason: Reason | str | None = None) -> None:
        super().__init__(*args)
        self.reason: Reason = Reason(reason) if reason is not None else type(self).default_reason


class CodecMismatchError(CodecError):
    """The blob is valid but was written under another config (model, layout, ...)."""

    default_reason = Reason.MISMATCH


class CorruptEncodedKVError(CodecError):
    """The blob's bytes are malformed, truncated, inconsistent or fail the CRC."""

    default_reason = Reason.CORRUPT


class UnsupportedConfigError(CodecError):
    """The caller asked for something the codec cannot do (bad shape, dtype, scope...)."""

    default_reason = Reason.UNSUPPORTED


class StoreUnavailableError(CodecError):
    """The store could not be reached or did not answer in time: a miss for lookups, a dropped save."""

    default_reason = Reason.STORE_UNAVAILABLE
