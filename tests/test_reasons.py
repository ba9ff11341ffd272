"""Every ``kvcodec.Reason`` is reachable through the public API, each by the failure it names.

A reason no call can produce would be dead vocabulary; a failure raised with the
wrong reason would mislead callers that branch on it (as the LMCache compat
layer does to choose LMCache's phrases).
"""

from __future__ import annotations

import ast
import math
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import kvcodec
from kvcodec import CodecMismatchError, CorruptEncodedKVError, Reason, UnsupportedConfigError
from kvcodec.format import Header, assemble, serialize_header
from kvcodec.store import StoreOptions, open_store, validate_key
from tests._helpers import DEFAULT_PAIRS, raw_blob
from tests.paths import REPO_ROOT


def _kv() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 2, 4, generator=g).half(), torch.randn(8, 2, 4, generator=g).half()


def _blob(**hashes: str) -> bytearray:
    k, v = _kv()
    return kvcodec.encode(k, v, scope="per_tensor", hashes=hashes or None)


def _flipped_payload() -> bytes:
    b = bytearray(_blob())
    b[-1] ^= 1
    return bytes(b)


def _with_nan_v() -> torch.Tensor:
    v = _kv()[1].clone()
    v[3, 1, 2] = math.nan
    return v


def _shared_out() -> None:
    out = torch.empty(8, 2, 4, dtype=torch.float16)
    kvcodec.decode(_blob(), out_k=out, out_v=out)


def _too_many_elements_per_token() -> bytes:
    fields = {"scope": 0, "kv_head_count": 2**32, "head_dim": 2**32, "chunk_size": -1, "page_size": -1}
    return raw_blob(**fields, scale_shape=(), k=b"", v=b"", s=b"\x00\x00\x80\x3f")


def _garbage_stream() -> object:
    """A lossless blob whose first V stream is no Huffman stream (its table and CRC valid)."""
    p = kvcodec.parse(kvcodec.encode(*_kv(), scope="per_tensor", compression="lossless"))
    v = bytearray(p.v)
    v[20] = 0xFF  # the first stream's first byte (after tokens, count, two lengths): code lengths of 15 bits
    return kvcodec.decode(assemble(p.header, p.k, v, p.scales))


_CORRUPT: dict[Reason, Callable[[], object]] = {
    Reason.BAD_MAGIC: lambda: kvcodec.parse(raw_blob(magic=b"NOTLMCKV")),
    Reason.UNSUPPORTED_VERSION: lambda: kvcodec.parse(raw_blob(version=99)),
    Reason.UNKNOWN_DTYPE_ID: lambda: kvcodec.parse(raw_blob(k_id=99)),
    Reason.UNKNOWN_SCOPE_ID: lambda: kvcodec.parse(raw_blob(scope=99)),
    Reason.UNKNOWN_SCHEME: lambda: kvcodec.parse(raw_blob(version=2, reserved=99)),
    Reason.RESERVED_NONZERO: lambda: kvcodec.parse(raw_blob(reserved=1)),
    Reason.FIELD_OUT_OF_RANGE: lambda: kvcodec.parse(raw_blob(page_size=0)),
    Reason.SCALE_RANK_OUT_OF_RANGE: lambda: kvcodec.parse(raw_blob(scale_shape_n=200)),
    Reason.NEGATIVE_PAYLOAD_LEN: lambda: kvcodec.parse(raw_blob(k_len=-1)),
    Reason.TRUNCATED_HEADER: lambda: kvcodec.parse(raw_blob()[:40]),
    Reason.TRUNCATED_PAYLOAD: lambda: kvcodec.parse(raw_blob()[:-1]),
    Reason.TRAILING_BYTES: lambda: kvcodec.parse(raw_blob(version=2, trailing=b"x")),
    Reason.BAD_UTF8: lambda: kvcodec.parse(raw_blob(pairs=[(b"model_id", b"\xff\xfe")])),
    Reason.BAD_HASH_TABLE: lambda: kvcodec.parse(raw_blob(pairs=[*DEFAULT_PAIRS, DEFAULT_PAIRS[0]])),
    Reason.CRC_MISMATCH: lambda: kvcodec.parse(_flipped_payload()),
    Reason.INCONSISTENT_PAYLOAD: lambda: kvcodec.parse(raw_blob(v=bytes(31))),
    Reason.BAD_SCALE_SHAPE: lambda: kvcodec.parse(raw_blob(scale_shape=(3, 2), s=bytes(24))),
    Reason.BAD_SCALE: lambda: kvcodec.decode(raw_blob(s=struct.pack("<4f", 0.5, math.nan, 2.0, 0.25))),
    Reason.LIMIT_EXCEEDED: lambda: kvcodec.parse(_too_many_elements_per_token()),
    Reason.BAD_STREAM: _garbage_stream,
}
_MISMATCH: dict[Reason, Callable[[], object]] = {
    Reason.HASH_MISMATCH: lambda: kvcodec.decode(_blob(model_id="a"), expected_hashes={"model_id": "b"}),
    Reason.HASH_MISSING: lambda: kvcodec.decode(
        _blob(), expected_hashes={"model_id": "b"}, strict_hashes=True
    ),
}
_CONFIG: dict[Reason, Callable[[], object]] = {
    Reason.BAD_TYPE: lambda: kvcodec.encode([1.0], _kv()[1]),
    Reason.BAD_VALUE: lambda: kvcodec.encode(*_kv(), layer_id=-5),
    Reason.UNSUPPORTED_DTYPE: lambda: kvcodec.encode(_kv()[0].to(torch.int16), _kv()[1]),
    Reason.NO_DTYPE_ID: lambda: serialize_header(Header(k_dtype=torch.int32, v_dtype="float8_e4m3fn"), crc=0),
    Reason.BAD_SHAPE: lambda: kvcodec.encode(torch.zeros(8).half(), torch.zeros(8).half()),
    Reason.BAD_SCOPE: lambda: kvcodec.encode(*_kv(), scope="bogus"),
    Reason.BAD_SCALES: lambda: kvcodec.encode(*_kv(), scope="external", scales=torch.tensor(-1.0)),
    Reason.MISSING_ARGUMENT: lambda: kvcodec.encode(*_kv(), scope="external"),
    Reason.NONFINITE_V: lambda: kvcodec.encode(_kv()[0], _with_nan_v(), scope="per_tensor"),
    Reason.OVERLAP: _shared_out,
    Reason.BAD_OUTPUT: lambda: kvcodec.encode(*_kv(), scope="per_tensor", out=bytearray(8)),
    Reason.BAD_DEVICE: lambda: kvcodec.decode(_blob(), device="bogus"),
    Reason.BAD_BUFFER: lambda: kvcodec.parse("not a buffer"),
    Reason.BAD_HASH: lambda: kvcodec.encode(*_kv(), hashes={"no_such_key": "x"}),
    Reason.BACKEND_UNAVAILABLE: lambda: kvcodec.backends.select("cpu", "cuda"),
    Reason.BAD_KEY: lambda: validate_key("../escape"),
}
_RAISED_ELSEWHERE = {
    Reason.BAD_CHECKPOINT: "tests/tools (a malformed model folder)",
    Reason.BAD_CODE: "tests/tools (kvcodec verify on a V holding an FP8 NaN code)",
    Reason.STORE_FULL: "tests/store (a put whose own chunk group fills the byte cap)",
    Reason.BAD_MAC: "tests/store (a fleet-keyed store reading an unkeyed blob)",
    Reason.SIZE_MISMATCH: "tests/store (an object longer than its header declares)",
    Reason.STORE_UNAVAILABLE: "tests/store (a Redis store with its server down)",
    Reason.STORE_TIMEOUT: "tests/store (a Redis store whose server does not answer)",
    Reason.STORE_AUTH: "tests/store/test_redis_auth.py (a wrong password, an ACL user without a command)",
    Reason.STORE_READONLY: "tests/store/test_redis_hostile.py (a put to a read-only replica)",
    Reason.STORE_PROTOCOL: "tests/store/test_redis_hostile.py (a server answering GET with an array)",
    Reason.WRONG_TYPE: "tests/store/test_redis_hostile.py (a Redis list under a blob's name)",
}
"""Reasons whose failure needs a server or a model folder: the owning suites assert them; here each
must at least be named by the package's code (see ``test_every_reason_is_raised_somewhere``)."""
_DEFAULTS = {
    Reason.CORRUPT: CorruptEncodedKVError,
    Reason.MISMATCH: CodecMismatchError,
    Reason.UNSUPPORTED: UnsupportedConfigError,
}
_CLASS_OF = {
    **{r: CorruptEncodedKVError for r in _CORRUPT},
    **{r: CodecMismatchError for r in _MISMATCH},
    **{r: UnsupportedConfigError for r in _CONFIG},
}
_TRIGGERS = {**_CORRUPT, **_MISMATCH, **_CONFIG}


def _put_into_a_store(blob: bytes | bytearray) -> None:
    with tempfile.TemporaryDirectory() as root:
        open_store(root, StoreOptions()).put("k", blob)


def test_every_reason_has_a_trigger_or_is_a_class_default() -> None:
    assert set(_TRIGGERS) | set(_DEFAULTS) | set(_RAISED_ELSEWHERE) == set(Reason)


def test_every_reason_is_raised_somewhere() -> None:
    """A member no code names is dead vocabulary (errors.py itself does not count)."""
    named = {
        node.attr
        for path in _sources()
        if path.name != "errors.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Reason"
    }
    dead = sorted(r.name for r in Reason if r.name not in named and r not in _DEFAULTS)
    assert not dead, f"Reason members no code raises: {dead}"


def _crc_damaged() -> bytearray:
    b = _blob()
    b[-1] ^= 0x40
    return b


_KEPT: dict[str, Callable[[], object]] = {
    "decode": lambda: kvcodec.decode(_crc_damaged()),
    "store.put": lambda: _put_into_a_store(_crc_damaged()),
    "lmcache.deserialize_header": lambda: _lmcache_compat().deserialize_header(bytes(_crc_damaged())),
}


def _lmcache_compat() -> Any:
    import kvcodec.integrations.lmcache.compat as compat

    return compat


@pytest.mark.parametrize("call", list(_KEPT))
def test_a_crc_failure_stays_crc_mismatch(call: str) -> None:
    """Each public entry a damaged blob can reach reports the parser's reason, not a generic one."""
    with pytest.raises(CorruptEncodedKVError) as info:
        _KEPT[call]()
    assert info.value.reason is Reason.CRC_MISMATCH, repr(info.value)


@pytest.mark.parametrize("reason", list(_TRIGGERS), ids=str)
def test_each_failure_raises_its_reason(reason: Reason) -> None:
    with pytest.raises(_CLASS_OF[reason]) as info:
        _TRIGGERS[reason]()
    assert info.value.reason is reason, repr(info.value)


@pytest.mark.parametrize("reason", list(_DEFAULTS), ids=str)
def test_class_default_reason(reason: Reason) -> None:
    cls = _DEFAULTS[reason]
    assert cls("message").reason is reason
    assert cls("message", reason=Reason.OVERLAP).reason is Reason.OVERLAP
    assert cls("message").args == ("message",)  # message-first constructors, as before


def test_reasons_are_stable_strings_and_survive_pickling() -> None:
    import pickle

    e = CorruptEncodedKVError("payload CRC mismatch", reason="crc_mismatch")
    assert e.reason is Reason.CRC_MISMATCH and e.reason == "crc_mismatch" and str(e.reason) == "crc_mismatch"
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is CorruptEncodedKVError and back.reason is Reason.CRC_MISMATCH and str(back) == str(e)
    with pytest.raises(ValueError):
        CorruptEncodedKVError("x", reason="no such reason")


# -- every raise site names its reason (found by AST, so a site no test reaches is still checked) --

_GENERIC = {"CORRUPT", "MISMATCH", "UNSUPPORTED"}
_SOURCE_ROOTS = ("kvcodec", "kernels")


def _sources() -> list[Path]:
    return sorted(p for root in _SOURCE_ROOTS for p in (REPO_ROOT / root).rglob("*.py"))


def _base_name(node: ast.expr) -> str | None:
    """``Foo`` for ``Foo`` and for ``errors.Foo``; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _default_reason(cls: ast.ClassDef) -> str | None:
    """The member named by ``default_reason = Reason.X`` in the class body, if any."""
    for stmt in cls.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None
        if isinstance(stmt, ast.AnnAssign):
            target = stmt.target
        value = getattr(stmt, "value", None)
        if (
            isinstance(target, ast.Name)
            and target.id == "default_reason"
            and isinstance(value, ast.Attribute)
        ):
            return value.attr
    return None


def _error_classes(trees: dict[Path, ast.Module]) -> dict[str, bool]:
    """Every CodecError subclass by name -> whether its default reason is specific (inherited if unset)."""
    from kvcodec import errors

    known = {
        c.__name__: c.default_reason.name not in _GENERIC
        for c in vars(errors).values()
        if isinstance(c, type) and issubclass(c, errors.CodecError)
    }
    classes = [n for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)]
    grew = True
    while grew:  # a subclass may be defined before its base is known
        grew = False
        for cls in classes:
            bases = [known[b] for b in map(_base_name, cls.bases) if b in known]
            if cls.name in known or not bases:
                continue
            own = _default_reason(cls)
            known[cls.name] = own not in _GENERIC if own else any(bases)
            grew = True
    return known


def _aliases(tree: ast.Module, classes: dict[str, bool]) -> dict[str, str]:
    """Local name -> class name for ``from ... import Cls as Alias`` (the class names map to themselves)."""
    names = {c: c for c in classes}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.update({a.asname: a.name for a in node.names if a.asname and a.name in classes})
    return names


def _is_remade(exc: ast.expr | None) -> bool:
    """Whether ``exc`` is ``type(e)(...)``: a caught error rebuilt with another message."""
    return (
        isinstance(exc, ast.Call)
        and isinstance(exc.func, ast.Call)
        and isinstance(exc.func.func, ast.Name)
        and exc.func.func.id == "type"
    )


def _sites_without_reason() -> list[str]:
    """``file:line  Class`` for each construction of a CodecError class (or ``raise type(e)(...)``) with no ``reason=``."""
    trees = {p: ast.parse(p.read_text(), filename=str(p)) for p in _sources()}
    classes = _error_classes(trees)
    missing = []
    for path, tree in trees.items():
        names = _aliases(tree, classes)
        for node in ast.walk(tree):
            name = names.get(_base_name(node.func) or "") if isinstance(node, ast.Call) else None
            if name is None and isinstance(node, ast.Raise) and _is_remade(node.exc):
                node, name = node.exc, "type(e)"  # a caught error raised anew: must keep its reason
            elif name is None or classes[name]:
                continue
            if not any(kw.arg in ("reason", None) for kw in node.keywords):
                missing.append((str(path.relative_to(REPO_ROOT)), node.lineno, name))
    return [f"{f}:{line}  {name}" for f, line, name in sorted(missing)]


def test_the_walk_finds_the_error_classes() -> None:
    trees = {p: ast.parse(p.read_text()) for p in _sources()}
    classes = _error_classes(trees)
    assert {"CodecError", "CorruptEncodedKVError", "StoreUnavailableError"} <= set(classes)
    assert classes["StoreUnavailableError"] and not classes["CorruptEncodedKVError"]


def test_every_codec_error_is_constructed_with_a_reason() -> None:
    missing = _sites_without_reason()
    assert not missing, f"{len(missing)} CodecError sites pass no reason=:\n" + "\n".join(missing)
