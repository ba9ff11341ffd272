"""LMCKV format layer: one test per validation rule, zero copy, header v2 (vectors: test_golden_vectors.py)."""

from __future__ import annotations

import array
import ctypes
import mmap
import re
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
import torch

from kvcodec.errors import CorruptEncodedKVError, UnsupportedConfigError
from kvcodec.format import (
    MAGIC,
    MAX_HASH_PAIRS,
    MAX_PAYLOAD_LEN,
    MAX_SCALE_DIMS,
    Hashes,
    Header,
    ScaleScheme,
    ScaleScope,
    as_dtype,
    assemble,
    header_size,
    pack_header_into,
    parse,
    serialize_header,
)
from tests._helpers import DEFAULT_PAIRS, K, S, V, pairs_blob, raw_blob

# ----------------------------------------------------------------------------
# A raw blob builder: any header field, valid or not, packed with struct
# ----------------------------------------------------------------------------


def test_raw_blob_builder_matches_writer() -> None:
    h = Header(
        k_dtype=torch.float16,
        v_dtype=torch.float8_e4m3fn,
        layer_id=3,
        chunk_id=7,
        chunk_size=4,
        page_size=2,
        kv_head_count=2,
        head_dim=4,
        scale_shape=(2, 2),
        hashes=Hashes(**{k.decode(): v.decode() for k, v in DEFAULT_PAIRS}),
    )
    assert raw_blob() == bytes(assemble(h, K, V, S))
    assert raw_blob(version=2) == bytes(assemble(h.replace(version=2), K, V, S))
    p = parse(raw_blob())
    assert p.header == h.replace(k_payload_len=64, v_payload_len=32, scale_payload_len=16)
    assert (bytes(p.k), bytes(p.v), bytes(p.scales)) == (K, V, S)
    assert p.header.num_tokens == 4


SMALL = raw_blob()
SMALL_V2 = raw_blob(version=2)


def _rx(s: str) -> str:
    return re.escape(s)


# ----------------------------------------------------------------------------
# One test per validation rule
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("cut", range(len(SMALL)))
def test_every_prefix_is_truncated(cut: int) -> None:
    with pytest.raises(
        CorruptEncodedKVError,
        match=r"truncated .*(need \d+ bytes at offset \d+|declares \d+ bytes), .*\d+ remain",
    ):
        parse(SMALL[:cut])


def test_every_prefix_is_truncated_v2_and_strict() -> None:
    for blob in (SMALL, SMALL_V2):
        for cut in range(len(blob)):
            for strict in (False, True):
                with pytest.raises(CorruptEncodedKVError, match="truncated"):
                    parse(blob[:cut], strict=strict)


def test_truncated_fixed_header_message() -> None:
    with pytest.raises(
        CorruptEncodedKVError, match=r"truncated fixed header: need 76 bytes at offset 0, 10 remain"
    ):
        parse(SMALL[:10])


@pytest.mark.parametrize("magic", [b"LMCKV\x01\x00\x02", b"\x00" * 8, b"lmckv\x01\x00\x01"])
def test_bad_magic(magic: bytes) -> None:
    with pytest.raises(CorruptEncodedKVError, match=_rx(f"bad magic: expected {MAGIC!r}, found {magic!r}")):
        parse(raw_blob(magic=magic))


@pytest.mark.parametrize("version", [0, 3, 0xFFFF])
def test_unknown_version(version: int) -> None:
    with pytest.raises(
        CorruptEncodedKVError, match=_rx(f"unknown header version {version}; expected one of (1, 2)")
    ):
        parse(raw_blob(version=version))


@pytest.mark.parametrize(("version", "scope"), [(1, 4), (1, 5), (1, 0xFFFF), (2, 5), (2, 0xFFFF)])
def test_unknown_scope(version: int, scope: int) -> None:
    top = 3 if version == 1 else 4
    with pytest.raises(
        CorruptEncodedKVError,
        match=_rx(f"unknown scale_scope id {scope} for header version {version}; expected 0..{top}"),
    ):
        parse(raw_blob(version=version, scope=scope))


@pytest.mark.parametrize("bad_id", [0, 9, 99, 0xFFFF])
@pytest.mark.parametrize(
    ("slot", "name"), [("k_id", "k_dtype"), ("v_id", "v_dtype"), ("s_id", "scale_dtype")]
)
def test_unknown_dtype_id(slot: str, name: str, bad_id: int) -> None:
    with pytest.raises(
        CorruptEncodedKVError,
        match=_rx(f"unknown {name} id {bad_id} in header; expected one of [1, 2, 3, 4, 5, 6, 7, 8]"),
    ):
        parse(raw_blob(**{slot: bad_id}))


def test_dtype_id_1_is_float16_too() -> None:
    p = parse(raw_blob(k_id=1))
    assert p.header.k_dtype == as_dtype(torch.float16)


@pytest.mark.parametrize("reserved", [1, 2, 0xFFFF])
def test_nonzero_reserved_in_v1(reserved: int) -> None:
    with pytest.raises(
        CorruptEncodedKVError, match=_rx(f"reserved field is {reserved}; expected 0 in version 1")
    ):
        parse(raw_blob(reserved=reserved))


@pytest.mark.parametrize("scheme", [9, 10, 0xFFFF])
def test_unknown_scale_scheme_in_v2(scheme: int) -> None:
    with pytest.raises(
        CorruptEncodedKVError,
        match=_rx(f"unknown scale scheme {scheme}; expected one of [0, 1, 2, 3, 4, 5, 6, 7, 8]"),
    ):
        parse(raw_blob(version=2, reserved=scheme))


@pytest.mark.parametrize("n", [-1, 9, 1 << 40, (1 << 63) - 1, -(1 << 63)])
def test_scale_shape_n_out_of_range(n: int) -> None:
    with pytest.raises(
        CorruptEncodedKVError, match=_rx(f"scale_shape_n={n} out of range: expected 0..{MAX_SCALE_DIMS}")
    ):
        parse(raw_blob(scale_shape_n=n))


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 6, 7, 8])
def test_scale_shape_n_disagreeing_with_stored_dims_is_caught(n: int) -> None:
    # In range, but the dims read shift every later field: some later rule must fail.
    with pytest.raises(CorruptEncodedKVError, match=r"(duplicate hash key|out of range)"):
        parse(raw_blob(scale_shape_n=n))


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("head_dim", -5, "-1 (unset) or 1.."),
        ("head_dim", 0, "-1 (unset) or 1.."),
        ("kv_head_count", 2**62, "-1 (unset) or 1.."),
        ("kv_head_count", -(2**63), "-1 (unset) or 1.."),
        ("page_size", 0, "-1 (unset) or 1.."),
        ("page_size", (1 << 63) - 1, "-1 (unset) or 1.."),
        ("chunk_size", -2, "-1 (unset) or 0.."),
        ("chunk_size", 2**41, "-1 (unset) or 0.."),
    ],
)
def test_layout_field_out_of_range(field: str, value: int, expected: str) -> None:
    with pytest.raises(
        CorruptEncodedKVError, match=_rx(f"{field}={value} out of range: expected {expected}")
    ):
        parse(raw_blob(**{field: value}))


@pytest.mark.parametrize(("field", "value"), [("layer_id", -2), ("chunk_id", -(2**63))])
def test_layer_chunk_id_below_unset(field: str, value: int) -> None:
    with pytest.raises(
        CorruptEncodedKVError, match=_rx(f"{field}={value}") + r".*expected -1 \(unset\) or >= 0"
    ):
        parse(raw_blob(**{field: value}))


def test_layout_fields_may_be_unset() -> None:
    p = parse(raw_blob(layer_id=-1, chunk_id=-1, chunk_size=-1, page_size=-1, kv_head_count=-1, head_dim=-1))
    assert p.header.kv_head_count == -1 and p.header.page_size == -1


@pytest.mark.parametrize(
    ("shape", "index", "value"), [((-1, 2), 0, -1), ((2, 2**62), 1, 2**62), ((-(2**63), 2), 0, -(2**63))]
)
def test_scale_dim_out_of_range(shape: tuple[int, ...], index: int, value: int) -> None:
    with pytest.raises(CorruptEncodedKVError, match=_rx(f"scale_shape[{index}]={value} out of range 0..")):
        parse(raw_blob(scale_shape=shape))


def test_huge_scale_shape_product_does_not_allocate() -> None:
    tracemalloc.start()
    try:
        with pytest.raises(CorruptEncodedKVError, match=r"scale_shape .* describes more than \d+ scales"):
            parse(raw_blob(scale_shape=(1 << 40,) * 2))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


_LEN_NAMES = {"k_len": "k_payload_len", "v_len": "v_payload_len", "s_len": "scale_payload_len"}


@pytest.mark.parametrize("value", [-1, -8, -(2**63), 2**62, (1 << 63) - 1, MAX_PAYLOAD_LEN + 1])
@pytest.mark.parametrize("field", list(_LEN_NAMES))
def test_payload_length_negative_or_huge(field: str, value: int) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(
            CorruptEncodedKVError, match=_rx(f"{_LEN_NAMES[field]}={value} out of range 0..{MAX_PAYLOAD_LEN}")
        ):
            parse(raw_blob(**{field: value}))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"parse allocated {peak} bytes for a {value}-byte length"


@pytest.mark.parametrize(
    ("fields", "section", "declared", "remain"),
    [
        ({"k_len": MAX_PAYLOAD_LEN}, "K payload", MAX_PAYLOAD_LEN, 112),
        (
            {"k_len": MAX_PAYLOAD_LEN, "v_len": MAX_PAYLOAD_LEN, "s_len": MAX_PAYLOAD_LEN},
            "K payload",
            MAX_PAYLOAD_LEN,
            112,
        ),
        ({"k_len": 113}, "K payload", 113, 112),
        ({"v_len": 49}, "V payload", 49, 48),
        ({"s_len": 17}, "scale payload", 17, 16),
        ({"v_len": 2**40}, "V payload", 2**40, 48),
    ],
)
def test_payload_lengths_overflow_buffer(fields: dict, section: str, declared: int, remain: int) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(
            CorruptEncodedKVError,
            match=_rx(f"truncated {section}: header declares {declared} bytes, only {remain} remain"),
        ):
            parse(raw_blob(**fields))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    ("kwargs", "needs"),
    [
        ({"s": S[:12]}, "scale_payload_len=12 but scale_shape (2, 2) of float32 needs 16 bytes"),
        ({"s": S + S}, "scale_payload_len=32 but scale_shape (2, 2) of float32 needs 16 bytes"),
        ({"s_id": 2}, "scale_payload_len=16 but scale_shape (2, 2) of float16 needs 8 bytes"),
        ({"s": b""}, "scale_payload_len=0 but scale_shape (2, 2) of float32 needs 16 bytes"),
    ],
)
def test_scale_payload_length_vs_scale_shape(kwargs: dict, needs: str) -> None:
    with pytest.raises(CorruptEncodedKVError, match=_rx(needs)):
        parse(raw_blob(**kwargs))


def test_k_v_element_counts_differ() -> None:
    with pytest.raises(
        CorruptEncodedKVError,
        match=_rx("K holds 32 elements (64 bytes of float16) but V holds 24 (24 bytes of float8_e4m3fn)"),
    ):
        parse(raw_blob(v=V[:24]))


def test_k_not_whole_elements() -> None:
    with pytest.raises(
        CorruptEncodedKVError, match=_rx("K payload of 63 bytes is not a whole number of float16")
    ):
        parse(raw_blob(k=K[:63]))


def test_payload_vs_heads_times_dim() -> None:
    with pytest.raises(
        CorruptEncodedKVError,
        match=_rx("payload holds 32 elements per tensor, not a multiple of kv_head_count*head_dim = 3*4"),
    ):
        parse(raw_blob(kv_head_count=3))


def test_more_tokens_than_chunk_size() -> None:
    with pytest.raises(
        CorruptEncodedKVError, match=_rx("chunk_size=3 but the payload holds 4 tokens of 2 heads x 4")
    ):
        parse(raw_blob(chunk_size=3))


def test_partial_chunk_is_accepted() -> None:
    assert parse(raw_blob(chunk_size=16)).header.num_tokens == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"scale_shape": (3, 2), "s": S + S[:8]},
            "scale_shape (3, 2) has 3 pages; 4 tokens at page_size 2 make 2",
        ),
        ({"page_size": 4}, "scale_shape (2, 2) has 2 pages; 4 tokens at page_size 4 make 1"),
        ({"scale_shape": (1, 4)}, "scale_shape (1, 4) does not end in kv_head_count=2"),
        ({"scale_shape": (4,)}, "scale_shape (4,) has 1 dims; scope PER_PAGE_HEAD needs 2"),
    ],
)
def test_per_page_head_pages_vs_tokens(kwargs: dict, message: str) -> None:
    with pytest.raises(CorruptEncodedKVError, match=_rx(message)):
        parse(raw_blob(**kwargs))


def test_partial_last_page_counts_as_a_page() -> None:
    assert parse(raw_blob(page_size=3)).header.scale_shape == (2, 2)  # ceil(4 / 3) = 2 pages
    assert parse(raw_blob(page_size=-1)).header.page_size == -1  # unset: pages cannot be checked


def test_per_layer_head_shape_checked() -> None:
    parse(raw_blob(scope=1, scale_shape=(2,), s=S[:8]))
    with pytest.raises(CorruptEncodedKVError, match=_rx("scale_shape (3,) does not end in kv_head_count=2")):
        parse(raw_blob(scope=1, scale_shape=(3,), s=S[:12]))
    with pytest.raises(
        CorruptEncodedKVError, match=_rx("scale_shape () has 0 dims; scope PER_LAYER_HEAD needs 1")
    ):
        parse(raw_blob(scope=1, scale_shape=(), s=S[:4]))


def test_blob_without_k_is_accepted() -> None:
    p = parse(raw_blob(k=b""))
    assert p.header.k_payload_len == 0 and len(p.k) == 0
    assert bytes(p.v) == V and bytes(p.scales) == S
    assert p.header.num_tokens == 4


def test_external_scope_without_scales_is_accepted() -> None:
    p = parse(raw_blob(scope=3, scale_shape=(), s=b""))
    assert p.header.scale_scope == ScaleScope.EXTERNAL and len(p.scales) == 0
    # LMCache stores attached external scales: accepted when they fill scale_shape exactly.
    p = parse(raw_blob(scope=3, scale_shape=(), s=S[:4]))
    assert len(p.scales) == 4
    with pytest.raises(
        CorruptEncodedKVError,
        match=_rx("scale_payload_len=8 but an external scope stores either no scales (0) or all of"),
    ):
        parse(raw_blob(scope=3, scale_shape=(), s=S[:8]))


def test_non_utf8_hash_value() -> None:
    pairs = ((b"model_id", b"bad\xff\xfe"), *DEFAULT_PAIRS[1:])
    with pytest.raises(
        CorruptEncodedKVError,
        match=r"hash value #0 \('model_id'\) at offset \d+ is not UTF-8: invalid start byte",
    ):
        parse(raw_blob(pairs=pairs))


def test_non_utf8_hash_key() -> None:
    pairs = ((b"\xc3(", b"x"),)
    with pytest.raises(CorruptEncodedKVError, match=r"hash key #0 at offset \d+ is not UTF-8"):
        parse(raw_blob(pairs=pairs))


def test_truncated_hash_string() -> None:
    # The value claims 65535 bytes; CRC + payload (116 bytes) follow, far fewer.
    section = struct.pack("<H", 1) + struct.pack("<H", 8) + b"model_id" + struct.pack("<H", 0xFFFF) + b"abc"
    with pytest.raises(
        CorruptEncodedKVError,
        match=r"truncated hash value #0 \('model_id'\): need 65535 bytes at offset \d+, 119 remain",
    ):
        parse(raw_blob(hash_section=section))


def test_hash_count_beyond_limit() -> None:
    section = pairs_blob(DEFAULT_PAIRS, count=MAX_HASH_PAIRS + 1)
    with pytest.raises(
        CorruptEncodedKVError,
        match=_rx(f"hash count {MAX_HASH_PAIRS + 1} exceeds the limit of {MAX_HASH_PAIRS}"),
    ):
        parse(raw_blob(hash_section=section))


def test_hash_count_zero_means_all_unset() -> None:
    p = parse(raw_blob(pairs=()))
    assert p.header.hashes == Hashes()


def test_duplicate_known_key() -> None:
    pairs = (*DEFAULT_PAIRS, (b"model_id", b"other/model"))
    with pytest.raises(
        CorruptEncodedKVError, match=_rx("duplicate hash key 'model_id': pair #6 repeats pair #0")
    ):
        parse(raw_blob(pairs=pairs))


def test_duplicate_unknown_key() -> None:
    pairs = ((b"x_future", b"a"), *DEFAULT_PAIRS, (b"x_future", b"a"))
    with pytest.raises(
        CorruptEncodedKVError, match=_rx("duplicate hash key 'x_future': pair #7 repeats pair #0")
    ):
        parse(raw_blob(pairs=pairs))


def test_unknown_keys_skipped_and_never_overwrite_known() -> None:
    pairs = (
        (b"model_id", b"meta/tiny"),
        (b"x_future", b"z"),
        (b"MODEL_ID", b"evil/one"),
        (b"model_id ", b"evil/two"),
        (b"model_id\x00", b"evil/three"),
        (b"kv_layout", b"NHD"),
    )
    p = parse(raw_blob(pairs=pairs))
    assert p.header.hashes == Hashes(model_id="meta/tiny", kv_layout="NHD")
    assert p.unknown_hashes == (
        ("x_future", "z"),
        ("MODEL_ID", "evil/one"),
        ("model_id ", "evil/two"),
        ("model_id\x00", "evil/three"),
    )
    # Writers emit the six known keys only: unknown ones do not survive a re-serialization.
    assert b"x_future" not in serialize_header(p.header, [p.payload])


def test_trailing_bytes_v1_accepted_and_reported() -> None:
    p = parse(raw_blob(trailing=b"\x00" * 5))
    assert p.trailing == 5
    assert bytes(p.blob) == SMALL and bytes(p.payload) == K + V + S
    assert parse(SMALL).trailing == 0


def test_trailing_bytes_refused_when_strict() -> None:
    blob = raw_blob(trailing=b"xyz")
    with pytest.raises(
        CorruptEncodedKVError,
        match=_rx(
            f"3 trailing bytes after the payload (blob ends at {len(SMALL)}, buffer is {len(blob)} bytes)"
        ),
    ):
        parse(blob, strict=True)
    parse(SMALL, strict=True)


def test_trailing_bytes_refused_in_v2() -> None:
    blob = raw_blob(version=2, trailing=b"\x00")
    with pytest.raises(
        CorruptEncodedKVError, match=_rx(f"1 trailing bytes after the payload (blob ends at {len(SMALL_V2)}")
    ):
        parse(blob)


def test_crc_mismatch() -> None:
    good = zlib.crc32(K + V + S)
    bad = good ^ 0x80
    with pytest.raises(
        CorruptEncodedKVError, match=_rx(f"CRC mismatch: header says {bad:#010x}, payload gives {good:#010x}")
    ):
        parse(raw_blob(crc=bad))
    # verify_crc=False trusts the caller; every other rule still applies.
    assert parse(raw_blob(crc=bad), verify_crc=False).crc == bad
    with pytest.raises(CorruptEncodedKVError, match="scale_payload_len"):
        parse(raw_blob(crc=bad, s=S[:12]), verify_crc=False)


def test_crc_mismatch_v2_names_header() -> None:
    with pytest.raises(
        CorruptEncodedKVError,
        match=r"CRC mismatch: header says 0x[0-9a-f]{8}, header\+payload gives 0x[0-9a-f]{8}",
    ):
        parse(raw_blob(version=2, crc=0))


def test_v1_crc_is_payload_only() -> None:
    # v1 cannot protect header fields: a changed layer_id still parses (v2 seals it).
    assert parse(raw_blob(layer_id=9)).header.layer_id == 9
    v2 = bytearray(SMALL_V2)
    v2[20] ^= 0x01
    with pytest.raises(CorruptEncodedKVError, match="CRC mismatch"):
        parse(v2)


def test_non_buffer_input_refused() -> None:
    with pytest.raises(UnsupportedConfigError, match="expected a bytes-like buffer, got str"):
        parse("LMCKV")  # type: ignore[arg-type]
    strided = np.frombuffer(SMALL * 2, dtype=np.uint8)[::2]
    with pytest.raises(UnsupportedConfigError, match="C-contiguous"):
        parse(strided)


# ----------------------------------------------------------------------------
# Zero copy
# ----------------------------------------------------------------------------


def _addr(buf) -> int:
    """Address of a buffer's first byte (the temporary array is dropped at once)."""
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


@pytest.fixture(params=["bytes", "bytearray", "memoryview", "mmap", "numpy", "array"])
def source(request, tmp_path):
    kind = request.param
    if kind == "bytes":
        yield SMALL
    elif kind == "bytearray":
        yield bytearray(SMALL)
    elif kind == "memoryview":
        yield memoryview(bytearray(SMALL))
    elif kind == "numpy":
        yield np.frombuffer(SMALL, dtype=np.uint8).copy()
    elif kind == "array":
        yield array.array("B", SMALL)
    else:
        path = tmp_path / "blob.lmckv"
        path.write_bytes(SMALL)
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            yield mm


def test_parse_is_zero_copy(source) -> None:
    p = parse(source)
    base = _addr(source)
    hl = p.header_len
    assert _addr(p.buffer) == base
    assert _addr(p.header_bytes) == base
    assert _addr(p.payload) == base + hl
    assert _addr(p.k) == base + hl
    assert _addr(p.v) == base + hl + len(K)
    assert _addr(p.scales) == base + hl + len(K) + len(V)
    assert (bytes(p.k), bytes(p.v), bytes(p.scales)) == (K, V, S)
    assert p.header == parse(SMALL).header
    del p  # release the exports before an mmap closes


def test_parse_views_follow_source_mutation() -> None:
    ba = bytearray(SMALL)
    p = parse(ba, verify_crc=True)
    hl = p.header_len
    # ctypes and torch agree on where the payload lives: inside ba, not a copy.
    base = ctypes.addressof(ctypes.c_char.from_buffer(ba))
    assert torch.frombuffer(p.v, dtype=torch.uint8).data_ptr() == base + hl + len(K)
    assert torch.frombuffer(p.payload, dtype=torch.uint8).data_ptr() == base + hl
    before = p.v[3]
    ba[hl + len(K) + 3] ^= 0xFF
    assert p.v[3] == before ^ 0xFF
    assert p.payload[len(K) + 3] == before ^ 0xFF
    t = torch.frombuffer(p.k, dtype=torch.float16)
    ba[hl] ^= 0x01
    assert t.view(torch.uint8)[0].item() == ba[hl]
    with pytest.raises(CorruptEncodedKVError, match="CRC mismatch"):
        parse(bytes(ba))
    del p, t


# ----------------------------------------------------------------------------
# Header v2 and the writer
# ----------------------------------------------------------------------------


def _header(**kw) -> Header:
    base = dict(
        k_dtype=torch.bfloat16,
        v_dtype=torch.float8_e4m3fn,
        layer_id=5,
        chunk_id=1,
        chunk_size=8,
        page_size=2,
        kv_head_count=2,
        head_dim=4,
        hashes=Hashes(model_id="m", kv_layout="NHD"),
    )
    base.update(kw)
    return Header(**base)


_K4 = bytes(range(64))
_V4 = bytes(range(32))


@pytest.mark.parametrize(
    ("scope", "scheme", "shape", "scales"),
    [
        (ScaleScope.PER_PAGE_HEAD, ScaleScheme.COMPUTED, (2, 2), S),
        (ScaleScope.PER_LAYER_HEAD, ScaleScheme.COMPUTED, (2,), S[:8]),
        (ScaleScope.PER_TENSOR, ScaleScheme.COMPUTED, (), S[:4]),
        (ScaleScope.EXTERNAL, ScaleScheme.COMPUTED, (), b""),
        (ScaleScope.NONE, ScaleScheme.COMPUTED, (), b""),
        (ScaleScope.NONE, ScaleScheme.UNIT, (), b""),
        (ScaleScope.PER_PAGE_HEAD, ScaleScheme.UNIT, (2, 2), b""),
    ],
)
def test_v2_roundtrip(scope, scheme, shape, scales) -> None:
    h = _header(version=2, scale_scope=scope, scale_scheme=scheme, scale_shape=shape)
    blob = assemble(h, _K4, _V4, scales)
    p = parse(blob, strict=True)
    assert p.header == h.replace(k_payload_len=64, v_payload_len=32, scale_payload_len=len(scales))
    assert (bytes(p.k), bytes(p.v), bytes(p.scales)) == (_K4, _V4, scales)
    assert blob[18] == int(scheme)
    assert serialize_header(p.header, [p.payload]) + bytes(p.payload) == blob
    buf = bytearray(p.header_len)
    assert pack_header_into(buf, p.header, p.crc) == p.header_len
    assert bytes(buf) == bytes(p.header_bytes)


def test_v2_unit_scheme_none_scope_has_no_scales() -> None:
    h = _header(version=2, scale_scope=ScaleScope.NONE, scale_scheme=ScaleScheme.UNIT)
    p = parse(assemble(h, _K4, _V4))
    assert p.header.scale_scheme == ScaleScheme.UNIT and p.header.scale_scope == ScaleScope.NONE
    assert len(p.scales) == 0 and p.header.scale_payload_len == 0
    with pytest.raises(
        CorruptEncodedKVError,
        match=_rx("scale_payload_len=4 but scope NONE / scheme UNIT stores no scales; expected 0"),
    ):
        parse(raw_blob(version=2, scope=4, reserved=1, scale_shape=(), s=S[:4]))
    with pytest.raises(
        CorruptEncodedKVError,
        match=_rx("scale_payload_len=16 but scope PER_PAGE_HEAD / scheme UNIT stores no scales"),
    ):
        parse(raw_blob(version=2, scope=2, reserved=1))


@pytest.mark.parametrize(
    "h",
    [
        _header(version=1, scale_scope=ScaleScope.NONE),
        _header(version=1, scale_scheme=ScaleScheme.UNIT),
        _header(version=1, scale_scope=ScaleScope.NONE, scale_scheme=ScaleScheme.UNIT),
    ],
    ids=["none", "unit", "both"],
)
def test_writer_refuses_v2_only_features_in_v1(h: Header) -> None:
    msg = "scale scope NONE and scale scheme UNIT need header version 2; got version 1"
    with pytest.raises(UnsupportedConfigError, match=msg):
        assemble(h, _K4, _V4)
    with pytest.raises(UnsupportedConfigError, match=msg):
        serialize_header(h.replace(k_payload_len=64, v_payload_len=32), [_K4, _V4])
    with pytest.raises(UnsupportedConfigError, match=msg):
        pack_header_into(bytearray(512), h, 0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"version": 3}, "header version 3 unsupported; expected 1 or 2"),
        ({"scale_scope": 9}, "scale_scope 9 unknown"),
        ({"scale_scheme": 9, "version": 2}, "scale_scheme 9 unknown"),
        ({"layer_id": -2}, "layer_id=-2 out of range"),
        ({"chunk_id": 1 << 63}, "chunk_id=9223372036854775808 out of range"),
        ({"head_dim": -5}, "head_dim=-5 out of range: expected -1 (unset) or 1.."),
        ({"kv_head_count": 2**62}, "kv_head_count=4611686018427387904 out of range"),
        ({"page_size": 0}, "page_size=0 out of range"),
        ({"scale_shape": (2, -1)}, "scale_shape[1]=-1 out of range"),
        ({"scale_shape": (1,) * 9}, "scale_shape has 9 dims; at most 8"),
        ({"head_dim": 4.0}, "head_dim is a float; expected an int"),
        ({"hashes": Hashes(model_id="\udc80")}, "hash 'model_id' cannot be encoded as UTF-8"),
        (
            {"hashes": Hashes(model_id="x" * 70000)},
            "hash 'model_id' is 70000 bytes in UTF-8; at most 65535 fit",
        ),
    ],
)
def test_writer_refuses_what_the_reader_refuses(changes: dict, message: str) -> None:
    h = _header(**changes)
    with pytest.raises(UnsupportedConfigError, match=_rx(message)):
        assemble(h, _K4, _V4)
    with pytest.raises(UnsupportedConfigError, match=_rx(message)):
        serialize_header(h, crc=0)


def test_header_coerces_hash_mappings_and_refuses_the_rest() -> None:
    assert _header(hashes={"model_id": "m"}).hashes == Hashes(model_id="m")
    for bad in ({"bogus": "m"}, 5):
        with pytest.raises(UnsupportedConfigError, match="hash"):
            _header(hashes=bad)


def test_writer_dtype_and_payload_checks() -> None:
    with pytest.raises(UnsupportedConfigError, match="has no LMCKV dtype id"):
        assemble(_header(k_dtype=torch.int32), _K4, _V4)
    h = _header().replace(k_payload_len=64, v_payload_len=32)
    with pytest.raises(
        UnsupportedConfigError,
        match=_rx("payload is 95 bytes but the header declares K(64) + V(32) + scales(0) = 96"),
    ):
        serialize_header(h, [_K4, _V4[:31]])
    with pytest.raises(UnsupportedConfigError, match="read-only"):
        pack_header_into(bytes(512), h, 0)
    with pytest.raises(UnsupportedConfigError, match="cannot hold"):
        pack_header_into(bytearray(10), h, 0)


@pytest.mark.parametrize(
    ("scope", "shape", "size"),
    [
        (ScaleScope.PER_TENSOR, (), 213),
        (ScaleScope.PER_LAYER_HEAD, (8,), 221),
        (ScaleScope.PER_PAGE_HEAD, (4, 8), 229),
    ],
)
def test_header_sizes_match_format_md(scope, shape, size) -> None:
    h = Header(k_dtype=torch.float16, v_dtype=torch.float8_e4m3fn, scale_scope=scope, scale_shape=shape)
    assert header_size(h) == size == len(serialize_header(h, crc=0))


def _flip_misses(blob: bytes) -> list[tuple[int, int]]:
    misses = []
    for i in range(len(blob)):
        for x in (0x01, 0xFF):
            m = bytearray(blob)
            m[i] ^= x
            try:
                parse(m)
            except CorruptEncodedKVError:
                continue
            misses.append((i, x))
    return misses


@pytest.mark.parametrize(
    "blob",
    [
        SMALL_V2,
        raw_blob(version=2, k=b""),
        raw_blob(version=2, scope=4, reserved=1, scale_shape=(), s=b""),
        raw_blob(version=2, scope=0, scale_shape=(), s=S[:4], pairs=()),
    ],
    ids=["pph", "no_k", "none_unit", "per_tensor_nohash"],
)
def test_v2_every_single_byte_flip_is_detected(blob: bytes) -> None:
    parse(blob, strict=True)
    assert _flip_misses(blob) == []


def test_v1_every_payload_and_structural_flip_is_detected() -> None:
    # v1's CRC covers the payload only: flips there must be caught; header flips may
    # pass only in the fields v1 cannot protect, and then the payload is intact.
    p0 = parse(SMALL)
    for i, x in _flip_misses(SMALL):
        assert i < p0.header_len - 4, f"payload/CRC flip at byte {i} went undetected"
        p = parse(bytes(SMALL[:i]) + bytes([SMALL[i] ^ x]) + SMALL[i + 1 :])
        assert bytes(p.payload) == K + V + S
        assert p.header_len == p0.header_len


@pytest.mark.parametrize("version", [1, 2])
def test_header_packer_equals_full_serialization(version: int) -> None:
    import os

    from kvcodec.format import HeaderPacker

    k, v, s = os.urandom(2 * 64), os.urandom(64), struct.pack("<2f", 0.5, 3.0)
    tmpl = Header(
        k_dtype=torch.float16,
        v_dtype=torch.float8_e4m3fn,
        scale_scope=ScaleScope.PER_LAYER_HEAD,
        version=version,
        chunk_size=8,
        page_size=4,
        kv_head_count=2,
        head_dim=4,
        scale_shape=(2,),
        k_payload_len=len(k),
        v_payload_len=len(v),
        scale_payload_len=len(s),
        hashes=Hashes(model_id="m"),
    )
    packer = HeaderPacker(tmpl)
    for layer in (0, 5, 31):
        buf = bytearray(packer.size + len(k) + len(v) + len(s))
        buf[packer.size :] = k + v + s
        packer.pack_into(buf, layer_id=layer, chunk_id=3, payload=memoryview(buf)[packer.size :])
        assert bytes(buf) == bytes(assemble(tmpl.replace(layer_id=layer, chunk_id=3), k, v, s))
        assert parse(buf).header.layer_id == layer
    with pytest.raises(UnsupportedConfigError, match="layer_id=-2"):
        packer.pack_into(bytearray(packer.size), layer_id=-2, chunk_id=0, crc=0)


def test_k_without_v_is_refused() -> None:
    with pytest.raises(
        CorruptEncodedKVError, match=r"K holds 32 elements \(64 bytes of float16\) but V is empty"
    ):
        parse(raw_blob(v=b"", s=b""))


def test_parse_accepts_a_cpu_tensor_without_copy() -> None:
    blob = raw_blob()
    t = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    p = parse(t)
    assert bytes(p.payload) == bytes(parse(blob).payload)
    assert torch.frombuffer(p.payload, dtype=torch.uint8).data_ptr() == t.data_ptr() + p.header_len
    with pytest.raises(UnsupportedConfigError, match=r"contiguous|dense CPU tensor"):
        parse(t[::2])


def test_the_scope_and_fp8_tables_agree_with_the_enums() -> None:
    """One source for each table: names cover every scope once; computed scopes are those with a shape."""
    from kvcodec import numerics
    from kvcodec.format import COMPUTED_SCOPES, FLOAT8_DTYPES, ID_TO_DTYPE, SCOPE_NAMES, expected_scale_shape

    assert sorted(SCOPE_NAMES.values()) == sorted(ScaleScope)
    assert all(name == scope.name.lower() for name, scope in SCOPE_NAMES.items() if name != "raw")
    assert COMPUTED_SCOPES == tuple(s for s in ScaleScope if expected_scale_shape(s, 4, 2, 2) is not None)
    assert set(FLOAT8_DTYPES) <= set(ID_TO_DTYPE.values())
    assert [str(d).removeprefix("torch.") for d in numerics.FP8_DTYPES] == [d.name for d in FLOAT8_DTYPES]
    assert numerics.COMPUTED_SCOPES is COMPUTED_SCOPES
