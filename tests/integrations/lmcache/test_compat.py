"""kvcodec.integrations.lmcache.compat: LMCache's kv_codec API, installed under its module names."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

import kvcodec.integrations.lmcache.compat as compat
from kvcodec import errors
from kvcodec.errors import Reason
from kvcodec.format import parse
from tests.raises import raises_reason


@pytest.fixture
def lm():
    """Install the compat layer as lmcache.v1.kv_codec, and undo it afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k == "lmcache" or k.startswith("lmcache.")}
    compat.install()
    import lmcache.v1.kv_codec as mod

    yield mod
    for k in [k for k in sys.modules if k == "lmcache" or k.startswith("lmcache.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_install_registers_modules(lm):
    from lmcache.v1.kv_codec.encoded_kv import _FIXED_HEADER_LEN, CODEC_MAGIC, deserialize_header
    from lmcache.v1.kv_codec.errors import CodecError, CorruptEncodedKVError

    assert lm is compat
    assert CODEC_MAGIC == b"LMCKV\x01\x00\x01" and _FIXED_HEADER_LEN == 76
    assert CorruptEncodedKVError is errors.CorruptEncodedKVError
    assert issubclass(CorruptEncodedKVError, CodecError)
    assert deserialize_header is compat.deserialize_header


def test_lmcache_style_code_runs_unchanged(lm):
    """A connector's calls, written against LMCache's API."""
    codec = lm.AsymK16V8Codec(scale_scope=lm.ScaleScope.PER_PAGE_HEAD)
    k = torch.randn(4, 16, 2, 32).half()
    v = torch.randn(4, 16, 2, 32).half()
    hashes = lm.CodecHashes(model_id="llama", kv_layout="NHD")
    enc = codec.encode(k, v, hashes=hashes, layer_id=3, chunk_id=1, page_axis=0)
    assert isinstance(enc, lm.EncodedKV)
    assert enc.scale_shape == (4, 2) and enc.total_bytes == len(codec.to_bytes(enc))
    blob = codec.to_bytes(enc)
    assert isinstance(blob, bytes)
    back = codec.from_bytes(blob, expected_hashes=lm.CodecHashes(model_id="llama"))
    k2, v2, s2 = codec.decode(back)
    assert torch.equal(k2.view(k.shape), k)  # LMCache callers reshape with .view
    assert v2.dtype == torch.float8_e4m3fn and s2.shape == (4, 2)
    _, v3, _ = codec.decode(back, out_v_dtype=torch.float16)  # LMCache crashes here; we don't
    assert v3.shape == (64, 2, 32)
    with raises_reason(lm.CodecMismatchError, Reason.HASH_MISMATCH):
        codec.from_bytes(blob, expected_hashes=lm.CodecHashes(model_id="mistral"))


def test_defaults_and_e5m2(lm):
    codec = lm.AsymK16V8Codec()
    assert codec.scale_scope == lm.ScaleScope.PER_TENSOR and codec.scale_dtype == torch.float32
    with raises_reason(lm.UnsupportedConfigError, Reason.UNSUPPORTED_DTYPE):
        lm.AsymK16V8Codec(fp8_dtype=torch.float8_e5m2)
    with raises_reason(lm.UnsupportedConfigError, Reason.UNSUPPORTED_DTYPE):
        lm.AsymK16V8Codec(fp8_dtype=torch.float16)


def test_signatures_match_lmcache():
    sig = inspect.signature
    assert list(sig(compat.AsymK16V8Codec.encode).parameters) == [
        "self",
        "k",
        "v",
        "hashes",
        "layer_id",
        "chunk_id",
        "chunk_size",
        "page_size",
        "kv_head_count",
        "head_dim",
        "head_axis",
        "page_axis",
        "precomputed_v_scales",
        "precomputed_v_quant",
    ]
    assert list(sig(compat.AsymK16V8Codec.decode).parameters) == [
        "self",
        "enc",
        "out_k_dtype",
        "out_v_dtype",
        "device",
    ]
    assert list(sig(compat.compute_v_scales).parameters) == [
        "v",
        "scope",
        "fp8_dtype",
        "head_axis",
        "page_axis",
    ]
    assert list(sig(compat.dequantize_v_fp8).parameters) == [
        "q",
        "scales",
        "scope",
        "out_dtype",
        "head_axis",
        "page_axis",
    ]
    assert compat.CodecHashes._CHECK_ORDER[0] == "model_id" and len(compat.CodecHashes._CHECK_ORDER) == 6


def test_primitives_any_layout():
    v = torch.randn(3, 8, 4, 16).half()  # [pages, slots, heads, dim]
    s = compat.compute_v_scales(v, compat.ScaleScope.PER_PAGE_HEAD, page_axis=0)
    assert s.shape == (3, 4)
    assert torch.equal(s, v.float().abs().amax(dim=(1, 3)) / 448.0)
    q = compat.quantize_v_fp8(v, s, compat.ScaleScope.PER_PAGE_HEAD, page_axis=0)
    assert q.shape == v.shape and q.dtype == torch.float8_e4m3fn
    ref = (v.float() / s.view(3, 1, 4, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8))
    dq = compat.dequantize_v_fp8(q, s, compat.ScaleScope.PER_PAGE_HEAD, page_axis=0)
    assert torch.equal(dq, (q.float() * s.view(3, 1, 4, 1)).half())
    # head before page (LMCache's own transposed case)
    vt = v.permute(2, 0, 1, 3)
    st = compat.compute_v_scales(vt, compat.ScaleScope.PER_PAGE_HEAD, head_axis=0, page_axis=1)
    assert torch.equal(st, s)
    sl = compat.compute_v_scales(v, compat.ScaleScope.PER_LAYER_HEAD)
    assert torch.equal(sl, v.float().abs().amax(dim=(0, 1, 3)) / 448.0)
    with raises_reason(errors.UnsupportedConfigError, Reason.MISSING_ARGUMENT):
        compat.compute_v_scales(v, compat.ScaleScope.PER_PAGE_HEAD)
    with raises_reason(errors.UnsupportedConfigError, Reason.BAD_SCOPE):
        compat.compute_v_scales(v, compat.ScaleScope.EXTERNAL)


def test_header_functions():
    codec = compat.AsymK16V8Codec(scale_scope=compat.ScaleScope.PER_LAYER_HEAD)
    enc = codec.encode(torch.randn(8, 2, 16).half(), torch.randn(8, 2, 16).half())
    assert compat.encoded_kv_header_size(enc) == len(enc.header_bytes) == 221
    hdr = compat.serialize_header(enc)
    assert hdr == enc.header_bytes
    enc.payload = bytes(enc.payload)[:-1]
    with raises_reason(errors.UnsupportedConfigError, Reason.INCONSISTENT_PAYLOAD):
        compat.serialize_header(enc)
    blob = codec.to_bytes(codec.encode(torch.randn(8, 2, 16).half(), torch.randn(8, 2, 16).half()))
    with pytest.raises(errors.CorruptEncodedKVError):
        compat.deserialize_header(blob[:-3])
    back = compat.deserialize_header(blob)
    assert isinstance(back.payload, memoryview) and back.kv_head_count == 2 and back.head_dim == 16
    assert parse(blob).header.chunk_size == 8


def test_caller_fields_win():
    codec = compat.AsymK16V8Codec()
    k = torch.randn(8, 2, 16).half()
    enc = codec.encode(k, k, chunk_size=256, page_size=16)
    assert (enc.chunk_size, enc.page_size, enc.kv_head_count, enc.head_dim) == (256, 16, 2, 16)
    parse(codec.to_bytes(enc))  # still a valid blob


def test_head_major_layout_keeps_lmcache_semantics():
    """[H, T, D] input: bytes in the caller's layout, so the caller's reshape restores K exactly."""
    codec = compat.AsymK16V8Codec(scale_scope=compat.ScaleScope.PER_LAYER_HEAD)
    k = torch.randn(4, 32, 8).half()  # [heads, tokens, dim]
    v = torch.randn(4, 32, 8).half()
    enc = codec.encode(k, v, head_axis=0)
    assert enc.kv_head_count == -1  # not token-major: fields only as given, like LMCache
    k2, v2, s2 = codec.decode(codec.from_bytes(codec.to_bytes(enc)))
    assert torch.equal(k2.reshape(k.shape), k)
    q_ref = compat.quantize_v_fp8(v, s2, compat.ScaleScope.PER_LAYER_HEAD, head_axis=0)
    assert torch.equal(v2.reshape(v.shape).view(torch.uint8), q_ref.view(torch.uint8))


def test_unset_layout_decodes_flat_like_lmcache():
    from kvcodec.format import Header, assemble

    h = Header(k_dtype=torch.float16, v_dtype=torch.float8_e4m3fn, scale_scope=compat.ScaleScope.PER_TENSOR)
    blob = bytes(assemble(h, bytes(64), bytes(32), torch.tensor([0.5]).numpy().tobytes()))
    codec = compat.AsymK16V8Codec()
    k, v, s = codec.decode(codec.from_bytes(blob), out_v_dtype=torch.float16)
    assert k.shape == (32,) and v.shape == (32,) and s.shape == ()


def test_to_bytes_follows_a_swapped_payload():
    codec = compat.AsymK16V8Codec()
    x = torch.randn(8, 2, 16).half()
    enc = codec.encode(x, x)
    fresh = bytes(len(enc.payload))
    enc.payload = fresh
    assert codec.to_bytes(enc) == enc.header_bytes + fresh


def test_inconsistent_caller_fields_are_a_config_error():
    codec = compat.AsymK16V8Codec()
    x = torch.randn(8, 2, 16).half()
    with raises_reason(errors.UnsupportedConfigError, Reason.INCONSISTENT_PAYLOAD):
        codec.encode(x, x, chunk_size=4)


# ----------------------------------------------------------------------------
# LMCache's newer kv_codec expectations (names, header-level parse, phrases)
# ----------------------------------------------------------------------------

import struct  # noqa: E402

_V_ONLY = dict(
    k_dtype=torch.bfloat16, v_dtype=torch.float8_e4m3fn, page_size=16, kv_head_count=8, head_dim=128
)


def _v_only(scheme, payload=b"\x11\x22\x33\x44"):
    return compat.EncodedKV(**_V_ONLY, scale_scheme=scheme, v_payload_len=len(payload), payload=payload)


def test_scale_scheme_names_are_lmcaches():
    S = compat.ScaleScheme
    assert S.COMPUTED_PER_TENSOR is S.COMPUTED and S.RAW_UNIT is S.UNIT
    assert S(0).name == "COMPUTED_PER_TENSOR" and S(1).name == "RAW_UNIT"
    assert (
        compat.EncodedKV(k_dtype=torch.bfloat16, v_dtype=torch.bfloat16).scale_scheme is S.COMPUTED_PER_TENSOR
    )


@pytest.mark.parametrize("scheme,version", [("COMPUTED_PER_TENSOR", 1), ("RAW_UNIT", 2)])
def test_header_level_parse_accepts_inconsistent_lengths(scheme, version):
    """4 bytes of V against 8 heads x 128 dims: LMCache's parse takes it; decode refuses it."""
    enc = _v_only(compat.ScaleScheme[scheme])
    blob = compat.serialize_header(enc) + bytes(enc.payload)
    assert struct.unpack_from("<H", blob, 8)[0] == version
    back = compat.deserialize_header(blob)
    assert back.scale_scheme is compat.ScaleScheme[scheme] and back.head_dim == 128
    assert bytes(back.payload) == bytes(enc.payload)
    with pytest.raises(errors.CorruptEncodedKVError):
        parse(blob)  # kvcodec's own parser stays strict
    with pytest.raises(errors.CodecError):
        compat.AsymK16V8Codec().decode(back)


def test_header_level_parse_still_checks_structure_bounds_and_crc():
    enc = _v_only(compat.ScaleScheme.RAW_UNIT)
    blob = bytearray(compat.serialize_header(enc) + bytes(enc.payload))
    flipped = bytearray(blob)
    flipped[44] ^= 1  # page_size: v2 seals the header
    with raises_reason(errors.CorruptEncodedKVError, Reason.CRC_MISMATCH):
        compat.deserialize_header(bytes(flipped))
    with raises_reason(errors.CorruptEncodedKVError, Reason.TRAILING_BYTES):
        compat.deserialize_header(bytes(blob) + b"xx")
    neg = bytearray(blob)
    struct.pack_into("<q", neg, 76, -1)
    with raises_reason(errors.CorruptEncodedKVError, Reason.NEGATIVE_PAYLOAD_LEN):
        compat.deserialize_header(bytes(neg))
    v1 = _v_only(compat.ScaleScheme.COMPUTED_PER_TENSOR)
    assert bytes(
        compat.deserialize_header(compat.serialize_header(v1) + bytes(v1.payload) + b"pad").payload
    ) == bytes(v1.payload)


@pytest.mark.parametrize(
    "offset,fmt,value,reason,phrase",
    [
        (12, "<H", 99, Reason.UNKNOWN_DTYPE_ID, "unknown dtype index"),
        (8, "<H", 99, Reason.UNSUPPORTED_VERSION, "unsupported codec version"),
        (18, "<H", 1, Reason.RESERVED_NONZERO, "nonzero reserved/scale_scheme slot"),
        (10, "<H", 99, Reason.UNKNOWN_SCOPE_ID, "unknown scale_scope index"),
        (68, "<q", 200, Reason.SCALE_RANK_OUT_OF_RANGE, "implausible scale_shape_n"),
    ],
)
def test_corrupt_header_errors_carry_lmcaches_phrase_for_their_reason(offset, fmt, value, reason, phrase):
    """LMCache's phrase (what its callers match on) is chosen by the error's reason, in front of kvcodec's message."""
    enc = _v_only(compat.ScaleScheme.COMPUTED_PER_TENSOR)
    blob = bytearray(compat.serialize_header(enc) + bytes(enc.payload))
    struct.pack_into(fmt, blob, offset, value)
    with raises_reason(errors.CorruptEncodedKVError, reason) as info:
        compat.deserialize_header(bytes(blob))
    assert str(info.value).startswith(phrase + ": ")


def test_payload_level_errors_carry_lmcaches_phrase():
    enc = _v_only(compat.ScaleScheme.COMPUTED_PER_TENSOR)
    blob = compat.serialize_header(enc) + bytes(enc.payload)
    with raises_reason(errors.CorruptEncodedKVError, Reason.TRUNCATED_PAYLOAD) as info:
        compat.deserialize_header(blob[:-1])
    assert str(info.value).startswith("buffer truncated mid-payload: ")
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    with raises_reason(errors.CorruptEncodedKVError, Reason.CRC_MISMATCH) as info:
        compat.deserialize_header(bytes(flipped))
    assert str(info.value).startswith("payload CRC mismatch: ")


def test_dtype_without_an_lmckv_id_gets_lmcaches_phrase():
    enc = _v_only(compat.ScaleScheme.COMPUTED_PER_TENSOR)
    enc.k_dtype = torch.int32
    with raises_reason(errors.UnsupportedConfigError, Reason.NO_DTYPE_ID) as info:
        compat.serialize_header(enc)
    assert str(info.value).startswith("unknown dtype: not in protocol DTYPE_TO_INT mapping")


@pytest.mark.parametrize("lengths", [(-1, 5, 0), (5, -1, 0), (5, 0, -1)])
def test_serialize_refuses_negative_lengths(lengths):
    enc = compat.EncodedKV(k_dtype=torch.bfloat16, v_dtype=torch.float8_e4m3fn, payload=b"1234")
    enc.k_payload_len, enc.v_payload_len, enc.scale_payload_len = lengths
    with raises_reason(errors.UnsupportedConfigError, Reason.NEGATIVE_PAYLOAD_LEN):
        compat.serialize_header(enc)


def test_unknown_scale_scheme_phrase():
    enc = _v_only(compat.ScaleScheme.RAW_UNIT)
    hdr = bytearray(compat.serialize_header(enc))
    struct.pack_into("<H", hdr, 18, 99)
    import zlib

    struct.pack_into("<I", hdr, len(hdr) - 4, zlib.crc32(bytes(enc.payload), zlib.crc32(bytes(hdr[:-4]))))
    with raises_reason(errors.CorruptEncodedKVError, Reason.UNKNOWN_SCHEME):
        compat.deserialize_header(bytes(hdr) + bytes(enc.payload))


# ----------------------------------------------------------------------------
# install() beside a real LMCache, and without one
# ----------------------------------------------------------------------------

_INSTALL_PROBE = """
import importlib.util, sys
real = importlib.util.find_spec("lmcache") is not None
{hide}
import kvcodec.integrations.lmcache.compat as compat
compat.install()
import lmcache, lmcache.v1, lmcache.v1.kv_codec as kc
from lmcache.v1.kv_codec.encoded_kv import deserialize_header
assert kc is compat and deserialize_header is compat.deserialize_header
print(real, getattr(lmcache, "__file__", None) is not None)
"""

_HIDE = """
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "lmcache" or name.startswith("lmcache."):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, _Hide())
"""


def _probe(hide: bool) -> str:
    import subprocess

    code = _INSTALL_PROBE.format(hide=_HIDE if hide else "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_install_without_lmcache_makes_namespace_packages():
    _real, is_real = _probe(hide=True)
    assert is_real == "False"


def test_install_never_shadows_a_real_lmcache():
    real, is_real = _probe(hide=False)
    if real != "True":
        pytest.skip("LMCache not installed here (make lmcache): only the fake-package case can be checked")
    assert is_real == "True"  # the real package, with only lmcache.v1.kv_codec aliased


# ----------------------------------------------------------------------------
# Review B6: a header never describes groups other than those V was quantized in
# ----------------------------------------------------------------------------

_PPH = compat.ScaleScope.PER_PAGE_HEAD
_PLH = compat.ScaleScope.PER_LAYER_HEAD


def _graded(*shape: int, axis: int = 0) -> torch.Tensor:
    """fp16 values whose magnitude grows along ``axis``, so each page/head gets a different scale."""
    g = torch.Generator().manual_seed(11)
    ramp = torch.linspace(0.1, 10, shape[axis]).view([-1 if d == axis else 1 for d in range(len(shape))])
    return (torch.randn(*shape, generator=g) * ramp).half()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within e4m3's rounding of each value (3 mantissa bits), plus its subnormal step here."""
    assert ((got.float() - want.float()).abs() <= want.float().abs() / 16 + 1e-3).all()


def _kvcodec_v(blob: bytes) -> torch.Tensor:
    import kvcodec

    return kvcodec.decode(blob, out_v_dtype=torch.float32).v


def test_per_page_head_page_size_must_be_the_pages_v_was_quantized_in():
    codec = compat.AsymK16V8Codec(scale_scope=_PPH)
    v = _graded(4, 16, 2, 8)  # [pages, page_size, heads, dim]
    for wrong in (17, 15, 8, 32):
        with raises_reason(errors.UnsupportedConfigError, Reason.BAD_VALUE):
            codec.encode(v, v, page_axis=0, page_size=wrong)
    enc = codec.encode(v, v, page_axis=0, page_size=16)
    assert enc.page_size == 16
    _close(_kvcodec_v(codec.to_bytes(enc)), v.reshape(64, 2, 8))


def test_page_size_stays_as_given_where_no_decoder_groups_by_it():
    """PER_TENSOR / PER_LAYER_HEAD never regroup by page_size: LMCache's header, as given."""
    v = _graded(4, 16, 2, 8)
    for scope in (compat.ScaleScope.PER_TENSOR, _PLH):
        enc = compat.AsymK16V8Codec(scale_scope=scope).encode(v, v, page_size=17)
        assert enc.page_size == 17


def test_caller_layout_refuses_layout_fields_that_misgroup_v():
    """Bytes kept in the caller's [H, T, D] layout: kv_head_count=H, head_dim=D would make
    kvcodec's decoder read them as [T, H, D] and dequantize under the wrong heads."""
    v = _graded(4, 32, 8)  # [heads, tokens, dim]
    codec = compat.AsymK16V8Codec(scale_scope=_PLH)
    with raises_reason(errors.UnsupportedConfigError, Reason.BAD_VALUE):
        codec.encode(v, v, head_axis=0, kv_head_count=4, head_dim=8, chunk_size=32)
    # The fields that do describe these bytes ([1 token, 4 heads, 32*8 dims]) are accepted and decode right.
    enc = codec.encode(v, v, head_axis=0, kv_head_count=4, head_dim=256)
    want = compat.dequantize_v_fp8(*codec.decode(enc)[1:], _PLH, out_dtype=torch.float32, head_axis=-2)
    assert torch.equal(_kvcodec_v(codec.to_bytes(enc)), want.reshape(1, 4, 256))
    ok = compat.dequantize_v_fp8(*codec.decode(enc)[1:], _PLH, out_dtype=torch.float32)
    _close(ok.reshape(4, 32, 8), v)


def test_caller_layout_per_page_head_fields_checked():
    codec = compat.AsymK16V8Codec(scale_scope=_PPH)
    v = _graded(4, 2, 16, 8)  # [pages, heads, slots, dim]: head before the slots
    with raises_reason(errors.UnsupportedConfigError, Reason.BAD_VALUE):
        codec.encode(v, v, page_axis=0, head_axis=1, page_size=16, kv_head_count=2, head_dim=8, chunk_size=64)
    # [pages, slots, heads, d1, d2]: token-major bytes with head_dim = d1*d2, so page_size must be the slots.
    v5 = _graded(3, 4, 2, 2, 8)
    with raises_reason(errors.UnsupportedConfigError, Reason.BAD_VALUE):
        codec.encode(
            v5, v5, page_axis=0, head_axis=2, page_size=5, kv_head_count=2, head_dim=16, chunk_size=15
        )
    enc = codec.encode(
        v5, v5, page_axis=0, head_axis=2, page_size=4, kv_head_count=2, head_dim=16, chunk_size=12
    )
    s = codec.decode(enc)[2]
    want = compat.dequantize_v_fp8(
        codec.decode(enc)[1].reshape(v5.shape), s, _PPH, out_dtype=torch.float32, head_axis=2, page_axis=0
    )
    assert torch.equal(_kvcodec_v(codec.to_bytes(enc)), want.reshape(12, 2, 16))
    # Without head fields kvcodec's decoder cannot regroup, so LMCache's header stays as given.
    assert codec.encode(v, v, page_axis=0, head_axis=1, page_size=16).page_size == 16


# ----------------------------------------------------------------------------
# Review B9: only CodecError subclasses escape
# ----------------------------------------------------------------------------


def _escapes():
    k = torch.randn(4, 16, 2, 8, dtype=torch.float16)
    c = compat.AsymK16V8Codec(scale_scope=_PPH)
    enc = c.encode(k, k, page_axis=0)
    S = compat.ScaleScope
    return {
        "decode(device='bogus')": lambda: c.decode(enc, device="bogus"),
        "decode(out_v_dtype='float16')": lambda: c.decode(enc, out_v_dtype="float16"),
        "decode(out_k_dtype='float16')": lambda: c.decode(enc, out_k_dtype="float16"),
        "decode(not an EncodedKV)": lambda: c.decode(b"LMCKV"),
        "AsymK16V8Codec(scale_scope=9)": lambda: compat.AsymK16V8Codec(scale_scope=9).encode(k, k),
        "AsymK16V8Codec(scale_scope='x')": lambda: compat.AsymK16V8Codec(scale_scope="x"),
        "AsymK16V8Codec(scale_dtype='float32')": lambda: compat.AsymK16V8Codec(scale_dtype="float32"),
        "encode(list, list)": lambda: c.encode([1], [1]),
        "encode(head_axis=9)": lambda: compat.AsymK16V8Codec().encode(k, k, head_axis=9),
        "encode(head_axis='1')": lambda: compat.AsymK16V8Codec(scale_scope=_PLH).encode(k, k, head_axis="1"),
        "quantize_v_fp8(scales=[1.0])": lambda: compat.quantize_v_fp8(k, [1.0], S.PER_TENSOR),
        "quantize_v_fp8(3 scales, 2 heads)": lambda: compat.quantize_v_fp8(
            k, torch.ones(3), S.PER_LAYER_HEAD
        ),
        "quantize_v_fp8(page_axis=head_axis)": lambda: compat.quantize_v_fp8(
            k, torch.ones(2, 2), S.PER_PAGE_HEAD, page_axis=2
        ),
        "quantize_v_fp8(list)": lambda: compat.quantize_v_fp8([1.0], torch.ones(()), S.PER_TENSOR),
        "quantize_v_fp8(0-d V)": lambda: compat.quantize_v_fp8(
            torch.tensor(1.0), torch.ones(2), S.PER_LAYER_HEAD
        ),
        "dequantize_v_fp8(out_dtype='float16')": lambda: compat.dequantize_v_fp8(
            k.to(torch.float8_e4m3fn), torch.ones(()), S.PER_TENSOR, out_dtype="float16"
        ),
        "compute_v_scales(list)": lambda: compat.compute_v_scales([1.0], S.PER_TENSOR),
        "compute_v_scales(scope=None)": lambda: compat.compute_v_scales(k, None),
    }


@pytest.mark.parametrize("name", list(_escapes()))
def test_only_codec_errors_escape(name):
    with pytest.raises(errors.CodecError):
        _escapes()[name]()


def test_codec_validates_its_config_at_construction():
    with raises_reason(errors.UnsupportedConfigError, Reason.BAD_SCOPE):
        compat.AsymK16V8Codec(scale_scope=9)
    with raises_reason(errors.UnsupportedConfigError, Reason.BAD_SCOPE):
        compat.AsymK16V8Codec(scale_scope=compat.ScaleScope.NONE)  # not one of LMCache's scopes
    with raises_reason(errors.UnsupportedConfigError, Reason.UNSUPPORTED_DTYPE):
        compat.AsymK16V8Codec(scale_dtype=torch.bfloat16)
    assert compat.AsymK16V8Codec(scale_scope=2).scale_scope == compat.ScaleScope.PER_PAGE_HEAD


# ----------------------------------------------------------------------------
# Review D6: the primitives and the caller-layout encode go through the dispatcher
# ----------------------------------------------------------------------------


def _caller_layout_encode():
    v = _graded(4, 32, 8)
    return compat.AsymK16V8Codec(scale_scope=_PLH).encode(v, v, head_axis=0)


@pytest.mark.parametrize(
    "call",
    [
        lambda: compat.quantize_v_fp8(_graded(8, 2, 4), torch.ones(2), _PLH),
        lambda: compat.dequantize_v_fp8(_graded(8, 2, 4).to(torch.float8_e4m3fn), torch.ones(2), _PLH),
        _caller_layout_encode,
    ],
    ids=["quantize", "dequantize", "caller-layout encode"],
)
def test_primitives_honour_the_backend_choice(call, monkeypatch):
    """KVCODEC_BACKEND is read by kvcodec.backends.select: a bad name shows the dispatcher is asked."""
    monkeypatch.setenv("KVCODEC_BACKEND", "no-such-backend")
    with pytest.raises(errors.UnsupportedConfigError):
        call()
    monkeypatch.setenv("KVCODEC_BACKEND", "torch")
    ref = call()
    monkeypatch.delenv("KVCODEC_BACKEND")
    got = call()
    if isinstance(got, torch.Tensor):
        assert torch.equal(
            got.view(torch.uint8) if got.element_size() == 1 else got,
            ref.view(torch.uint8) if ref.element_size() == 1 else ref,
        )
    else:
        assert compat.AsymK16V8Codec().to_bytes(got) == compat.AsymK16V8Codec().to_bytes(ref)


def test_declined_primitive_falls_back_in_the_dispatcher():
    from kvcodec import backends
    from kvcodec.backends import cpu

    if not cpu.AVAILABLE:
        pytest.skip(f"the C loops are not built: {cpu.REASON}")

    def count() -> int:
        return sum(f["count"] for f in backends.backend_info()["fallbacks"] if f["op"] == "quantize")

    before = count()
    v = _graded(8, 2, 4)
    q = compat.quantize_v_fp8(v, torch.ones(2), _PLH, fp8_dtype=torch.float8_e5m2)  # e5m2: no C loops
    assert count() == before + 1
    assert torch.equal(
        q.view(torch.uint8), v.float().clamp(-57344, 57344).to(torch.float8_e5m2).view(torch.uint8)
    )


def test_nan_in_v_is_refused_in_every_layout():
    """The caller-layout path now quantizes through encode_v, which refuses NaN as the token-major path does."""
    v = _graded(4, 32, 8)
    v[2, 5, 1] = float("nan")
    for kw in ({"head_axis": 0}, {"head_axis": 0, "page_axis": 1}):
        for scope in (_PLH, _PPH) if "page_axis" in kw else (_PLH, compat.ScaleScope.PER_TENSOR):
            with raises_reason(errors.UnsupportedConfigError, Reason.NONFINITE_V):
                compat.AsymK16V8Codec(scale_scope=scope).encode(v, v, **kw)
    with pytest.raises(errors.UnsupportedConfigError):
        compat.AsymK16V8Codec(scale_scope=_PLH).encode(
            v.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
        )


# ----------------------------------------------------------------------------
# Hostile EncodedKV fields: a config error from every entry point, never a plain exception
# ----------------------------------------------------------------------------

_HOSTILE_VALUES = {
    "99": 99,
    "-5": -5,
    "'ab'": "ab",
    "None": None,
    "1.5": 1.5,
    "2**70": 2**70,
    "object()": object(),
    "tensor": torch.ones(3),
    "strided memoryview": memoryview(bytes(range(16)))[::2],
    "True": True,
    "(1, 'a')": (1, "a"),
}
_ENC_FIELDS = [n for n in compat.EncodedKV.__dataclass_fields__ if not n.startswith("_")]
_ENTRY_POINTS = {
    "decode": lambda enc: compat.AsymK16V8Codec().decode(enc),
    "to_bytes": lambda enc: compat.AsymK16V8Codec().to_bytes(enc),
    "serialize_header": compat.serialize_header,
    "encoded_kv_header_size": compat.encoded_kv_header_size,
    "total_bytes": lambda enc: enc.total_bytes,
}


def _encoded() -> compat.EncodedKV:
    x = torch.randn(8, 2, 16).half()
    return compat.AsymK16V8Codec().encode(x, x)


@pytest.mark.parametrize("field", _ENC_FIELDS)
@pytest.mark.parametrize("entry", list(_ENTRY_POINTS))
def test_hostile_encoded_kv_fields_raise_only_codec_errors(field, entry):
    """Every field set to each hostile value: the entry point works or raises a CodecError."""
    for value in _HOSTILE_VALUES.values():
        enc = _encoded()
        setattr(enc, field, value)
        try:
            _ENTRY_POINTS[entry](enc)
        except errors.CodecError:
            pass


@pytest.mark.parametrize("entry", list(_ENTRY_POINTS)[:4])
@pytest.mark.parametrize(
    "field,value,reason",
    [
        ("scale_scope", 99, Reason.BAD_SCOPE),
        ("scale_scope", "ab", Reason.BAD_SCOPE),
        ("scale_shape", "ab", Reason.BAD_SHAPE),
        ("scale_shape", (1, "a"), Reason.BAD_SHAPE),
        ("scale_scheme", 7, Reason.BAD_VALUE),
        ("layer_id", "3", Reason.BAD_TYPE),
        ("version", None, Reason.BAD_TYPE),
        ("k_payload_len", 1.5, Reason.BAD_TYPE),
        ("payload", None, Reason.BAD_BUFFER),
        ("payload", torch.zeros(4, dtype=torch.uint8), Reason.BAD_BUFFER),
        ("header_bytes", 5, Reason.BAD_TYPE),
    ],
)
def test_hostile_encoded_kv_field_is_a_config_error(entry, field, value, reason):
    enc = _encoded()
    setattr(enc, field, value)
    with raises_reason(errors.UnsupportedConfigError, reason):
        _ENTRY_POINTS[entry](enc)


@pytest.mark.parametrize("entry", list(_ENTRY_POINTS))
def test_strided_memoryview_payload_is_a_config_error(entry):
    enc = _encoded()
    enc.payload = memoryview(bytes(2 * len(enc.payload)))[::2]
    with pytest.raises(errors.UnsupportedConfigError):
        _ENTRY_POINTS[entry](enc)
