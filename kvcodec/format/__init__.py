"""The LMCKV byte format in pure Python: dtype ids, header model and writer, parser, CRC.

The format itself, byte by byte, is ``docs/FORMAT.md`` (its tables are checked
against the layouts, ids and limits named here).

Imports neither torch nor kvcodec's C extension (a test proves it), so tools
that only read headers stay light.
"""

from __future__ import annotations

from .buffer import as_bytes_view
from .coding import Coding, read_coding
from .crc import CRC_BACKEND, crc32
from .dtypes import (
    DTYPE_TO_ID,
    FLOAT8_DTYPES,
    FLOAT_INF_BITS,
    ID_TO_DTYPE,
    DType,
    as_dtype,
    dtype_to_id,
    id_to_dtype,
)
from .geometry import BlobCrc, Geometry, geometry, is_plain
from .header import (
    COMPUTED_SCOPES,
    DEFLATE_OF,
    FIXED_HEADER_LEN,
    HASH_KEYS,
    HUFF_OF,
    HUFFMAN_SCHEMES,
    LOSSLESS_OF,
    MAGIC,
    MAX_DIM,
    MAX_ELEMENTS,
    MAX_HASH_PAIRS,
    MAX_PAYLOAD_LEN,
    MAX_SCALE_DIMS,
    PLAIN_OF,
    SCOPE_NAMES,
    SPLIT_SCHEMES,
    SUPPORTED_VERSIONS,
    Hashes,
    Header,
    HeaderPacker,
    ScaleScheme,
    ScaleScope,
    assemble,
    check_crc,
    header_size,
    pack_header_into,
    payload_crc,
    restamp_header,
    serialize_header,
)
from .parser import (
    ParsedBlob,
    check_consistency,
    check_stored_scales,
    expected_scale_shape,
    header_fields,
    parse,
)

__all__ = [
    "COMPUTED_SCOPES",
    "CRC_BACKEND",
    "DEFLATE_OF",
    "DTYPE_TO_ID",
    "FIXED_HEADER_LEN",
    "FLOAT8_DTYPES",
    "FLOAT_INF_BITS",
    "HASH_KEYS",
    "HUFFMAN_SCHEMES",
    "HUFF_OF",
    "ID_TO_DTYPE",
    "LOSSLESS_OF",
    "MAGIC",
    "MAX_DIM",
    "MAX_ELEMENTS",
    "MAX_HASH_PAIRS",
    "MAX_PAYLOAD_LEN",
    "MAX_SCALE_DIMS",
    "PLAIN_OF",
    "SCOPE_NAMES",
    "SPLIT_SCHEMES",
    "SUPPORTED_VERSIONS",
    "BlobCrc",
    "Coding",
    "DType",
    "Geometry",
    "Hashes",
    "Header",
    "HeaderPacker",
    "ParsedBlob",
    "ScaleScheme",
    "ScaleScope",
    "as_bytes_view",
    "as_dtype",
    "assemble",
    "check_consistency",
    "check_crc",
    "check_stored_scales",
    "crc32",
    "dtype_to_id",
    "expected_scale_shape",
    "geometry",
    "header_fields",
    "header_size",
    "id_to_dtype",
    "is_plain",
    "pack_header_into",
    "parse",
    "payload_crc",
    "read_coding",
    "restamp_header",
    "serialize_header",
]
