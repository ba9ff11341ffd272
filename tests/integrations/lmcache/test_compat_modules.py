"""The compat package mirrors LMCache's ``kv_codec`` modules; one constructor builds every record.

LMCache's ``lmcache.v1.kv_codec`` is a package of ``errors``, ``encoded_kv`` and
``asym_k16_v8``; code written against it imports from those modules, so each must
exist under its name once ``install()`` has run and hold the names LMCache's does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields

import pytest
import torch

import kvcodec.integrations.lmcache.compat as compat
from tests.paths import REPO_ROOT

_LMCACHE_NAMES: dict[str, tuple[str, ...]] = {
    "errors": ("CodecError", "CodecMismatchError", "CorruptEncodedKVError", "UnsupportedConfigError"),
    "encoded_kv": (
        "ASSERT_MAGIC_BYTES",
        "CODEC_MAGIC",
        "CODEC_MAGIC_LEN",
        "_FIXED_HEADER_LEN",
        "CodecVersion",
        "ScaleScope",
        "ScaleScheme",
        "CodecHashes",
        "EncodedKV",
        "serialize_header",
        "deserialize_header",
        "encoded_kv_header_size",
        "CorruptEncodedKVError",
        "UnsupportedConfigError",
    ),
    "asym_k16_v8": (
        "AsymK16V8Codec",
        "compute_v_scales",
        "quantize_v_fp8",
        "dequantize_v_fp8",
        "_ZERO_SCALE_SENTINEL",
        "CodecHashes",
        "EncodedKV",
        "ScaleScope",
        "ScaleScheme",
    ),
}
"""What LMCache 0.5.6's modules export that its callers use (its classes, functions and constants)."""

_REAL_NAMES = """
import inspect, json, types
import lmcache.v1.kv_codec.errors, lmcache.v1.kv_codec.encoded_kv, lmcache.v1.kv_codec.asym_k16_v8
import lmcache.v1.kv_codec as kc
out = {}
for sub in ("errors", "encoded_kv", "asym_k16_v8"):
    mod = getattr(kc, sub)
    out[sub] = sorted(n for n, v in vars(mod).items() if not n.startswith("__")
                      and not isinstance(v, types.ModuleType) and getattr(v, "__module__", mod.__name__) == mod.__name__)
print(json.dumps(out))
"""


@pytest.mark.parametrize("sub", list(_LMCACHE_NAMES))
def test_each_lmcache_module_holds_lmcaches_names(sub):
    mod = getattr(compat, sub)
    missing = [n for n in _LMCACHE_NAMES[sub] if not hasattr(mod, n)]
    assert not missing, f"{mod.__name__} lacks {missing}"
    for name in _LMCACHE_NAMES[sub]:
        if hasattr(compat, name):
            assert getattr(mod, name) is getattr(compat, name), name  # one object under every name


def test_lmcaches_own_definitions_all_have_a_counterpart():
    """Against the installed LMCache: every name its three modules define (not import) exists here too."""
    got = subprocess.run([sys.executable, "-c", _REAL_NAMES], capture_output=True, text=True, timeout=300)
    if got.returncode != 0:
        pytest.skip(f"LMCache's kv_codec not importable here: {got.stderr.strip().splitlines()[-1:]}")
    real = json.loads(got.stdout.strip().splitlines()[-1])
    ours = {n for sub in _LMCACHE_NAMES for n in dir(getattr(compat, sub))}
    public = {n for names in real.values() for n in names if not n.startswith("_")}
    assert public - ours == set()


def test_install_registers_the_packages_modules():
    saved = {k: v for k, v in sys.modules.items() if k == "lmcache" or k.startswith("lmcache.")}
    try:
        compat.install()
        for sub in _LMCACHE_NAMES:
            assert sys.modules[f"lmcache.v1.kv_codec.{sub}"] is getattr(compat, sub)
    finally:
        for k in [k for k in sys.modules if k == "lmcache" or k.startswith("lmcache.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_no_module_of_the_lmcache_integration_is_over_500_lines():
    folder = REPO_ROOT / "kvcodec" / "integrations" / "lmcache"
    long = {
        str(p.relative_to(folder)): n
        for p in folder.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long


def _record_fields(enc: compat.EncodedKV) -> dict:
    return {f.name: getattr(enc, f.name) for f in fields(enc) if f.compare}


@pytest.mark.parametrize("layout", ["token_major", "caller_layout"])
def test_an_encoded_record_is_the_record_its_bytes_parse_to(layout):
    """Both ways a record is made (encode, parse) build the same fields from the same header."""
    codec = compat.AsymK16V8Codec(scale_scope=compat.ScaleScope.PER_LAYER_HEAD)
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(16, 2, 8, generator=g).half() for _ in range(2))
    if layout == "caller_layout":  # head-major: kept in the caller's layout, LMCache's way
        k, v = k.permute(1, 0, 2).contiguous(), v.permute(1, 0, 2).contiguous()
    hashes = compat.CodecHashes(model_id="m", kv_layout="x")
    enc = codec.encode(
        k, v, hashes=hashes, layer_id=2, chunk_id=5, head_axis=0 if layout != "token_major" else -2
    )
    back = compat.deserialize_header(codec.to_bytes(enc))
    assert enc.hashes is hashes  # the caller's object is kept, as LMCache keeps it
    assert _record_fields(back) == _record_fields(enc)
    assert bytes(back.payload) == bytes(enc.payload) and back.header_bytes == enc.header_bytes
