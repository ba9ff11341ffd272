"""A parsed blob's geometry and CRC for the code that reads its payload: the one place consumers get
tokens, section offsets and shapes, ask whether a blob is plain, and carry its CRC.

* :class:`Geometry` (:func:`geometry`): tokens, heads, head_dim and where K, V's codes and the scales
  lie in the payload, from the header alone.
* :func:`is_plain`: a blob whose payload is K and FP8 codes of one ``[tokens, heads, head_dim]``
  shape with fp32 scales of a computed scope stored in that scope's shape: what row loops (the C cache
  lanes, the fused kernels) can take as it is, without a decode.
* :func:`sections_from`: a plain blob's K, codes and scales of its tokens from one on (the payload
  of a blob of those tokens), for a load that leaves the first tokens alone.
* :class:`BlobCrc`: a blob's CRC carried through the passes that read its payload: the seed before
  the payload, the rest added after a pass that folded part of it in, checked against the stored
  CRC, and the header then remembered by :func:`~.parser.parse`'s memo.

Pure Python, like the rest of the format layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .crc import crc32
from .dtypes import FLOAT8_DTYPES, FLOAT32
from .header import COMPUTED_SCOPES, PLAIN_OF, Header, ScaleScheme, ScaleScope, check_crc, payload_crc
from .parser import ParsedBlob, expected_scale_shape, remember_header

__all__ = ["BlobCrc", "Geometry", "geometry", "is_plain", "sections_from"]


@dataclass(frozen=True)
class Geometry:
    """Where a blob's sections lie in its payload (offsets from the payload's start) and their shapes."""

    tokens: int
    heads: int
    head_dim: int
    k_row: int
    """Bytes of K per token and head (K's head_dim times its item size; 0 without K)."""
    v_at: int
    """V's codes start here (after K)."""
    scales_at: int
    """The scales start here (after V)."""
    end: int
    """The payload's length."""

    @property
    def k_token(self) -> int:
        """Bytes of K per token (all heads)."""
        return self.heads * self.k_row

    @property
    def v_token(self) -> int:
        """Bytes of V per token (all heads)."""
        return (self.scales_at - self.v_at) // self.tokens

    @property
    def k_shape(self) -> tuple[int, int, int]:
        """K's bytes as ``[tokens, heads, k_row]``."""
        return (self.tokens, self.heads, self.k_row)

    @property
    def v_shape(self) -> tuple[int, int, int]:
        """V's elements as ``[tokens, heads, head_dim]``."""
        return (self.tokens, self.heads, self.head_dim)


def geometry(h: Header) -> Geometry | None:
    """The payload's geometry from the header's layout fields, or None when they cannot tell (no heads
    or head_dim, no tokens, sections that are not whole rows of them, or a lossless payload: coded
    streams, not rows, whatever their lengths happen to be)."""
    heads, dim, tokens = h.kv_head_count, h.head_dim, h.num_tokens
    if heads <= 0 or dim <= 0 or not tokens or h.scale_scheme in PLAIN_OF:
        return None
    k_len, v_len = h.k_payload_len, h.v_payload_len
    if v_len != tokens * heads * dim * h.v_dtype.itemsize or k_len % (tokens * heads):
        return None
    return Geometry(tokens, heads, dim, k_len // (tokens * heads), k_len, k_len + v_len, h.payload_len)


def is_plain(h: Header) -> bool:
    """Whether the payload is plain rows: K present, V FP8 codes (e4m3fn or e5m2) of one ``[tokens,
    heads, head_dim]`` shape, fp32 scales computed per a scope (``page_size >= 1`` for per_page_head) and
    stored in that scope's shape. Such a blob is written into a cache by row loops as it is."""
    g = geometry(h)
    if g is None or not h.k_payload_len or h.v_dtype not in FLOAT8_DTYPES or h.scale_dtype != FLOAT32:
        return False
    if h.scale_scheme != ScaleScheme.COMPUTED or h.scale_scope not in COMPUTED_SCOPES:
        return False
    if h.scale_scope == ScaleScope.PER_PAGE_HEAD and h.page_size < 1:
        return False
    shape = expected_scale_shape(h.scale_scope, g.tokens, g.heads, h.page_size)
    return shape is not None and h.scale_shape == shape and h.scale_payload_len == 4 * math.prod(shape)


def sections_from(p: ParsedBlob, skip: int) -> tuple[memoryview, memoryview, memoryview]:
    """K, V's codes and the scales of a plain blob's (:func:`is_plain`) tokens ``skip ..``: the payload
    of a blob of those tokens. per_page_head: its scale rows from page ``skip / page_size`` on (``skip``
    must be a whole number of pages); the other scopes' scales cover every token and come whole."""
    h, g = p.header, geometry(p.header)
    if g is None or not 0 <= skip <= g.tokens:
        raise ValueError(f"skip {skip} is not a token of this blob")
    scales_skip = 0
    if h.scale_scope == ScaleScope.PER_PAGE_HEAD:
        if skip % h.page_size:
            raise ValueError(f"skip {skip} splits a scale page of {h.page_size} tokens")
        scales_skip = skip // h.page_size * g.heads * h.scale_dtype.itemsize
    return p.k[skip * g.k_token :], p.v[skip * g.v_token :], p.scales[scales_skip:]


class BlobCrc:
    """A parsed blob's CRC, carried by the code that reads its payload (the blob parsed with its CRC
    check left to the caller: ``parse(..., verify_crc=False)``).

    :attr:`seed` is the CRC before the payload (v2: of the header up to its CRC field; v1: 0), which a
    pass that reads the payload in order continues. :meth:`finish` takes that pass's CRC through the
    payload's first ``through`` bytes (None: no pass carried it, the whole payload is read here), adds
    the rest, and raises ``CorruptEncodedKVError`` (``CRC_MISMATCH``) unless it is the stored one; with
    ``remember`` the header then enters :func:`~.parser.parse`'s memo (only once the CRC passed).
    """

    def __init__(self, parsed: ParsedBlob) -> None:
        self.parsed = parsed
        self.seed = payload_crc(parsed.header, parsed.crc_prefix, ())

    @property
    def codes_end(self) -> int:
        """Payload bytes through K and V's codes: where a pass that writes rows stops (the scales follow)."""
        h = self.parsed.header
        return h.k_payload_len + h.v_payload_len

    def finish(self, got: int | None, through: int = 0, *, remember: bool = False) -> None:
        """Check the blob's CRC given ``got``, the CRC continued over the payload's first ``through``
        bytes (None: computed here over the whole payload)."""
        p = self.parsed
        payload = p.payload
        crc = crc32(payload, self.seed) if got is None else crc32(payload[through:], got)
        check_crc(p.header, p.crc, crc)
        if remember:
            remember_header(p)
