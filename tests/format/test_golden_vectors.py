"""Byte compatibility with blobs LMCache 0.5.6 wrote: tests/vectors (committed), and ../shared/vectors when present.

Every vector parses to the fields its manifest lists and re-serializes byte for
byte; kvcodec's encode (and the LMCache compat API) rewrite each codec vector
from its inputs exactly; decode gives K back bit for bit and V's codes and
scales as stored; each corrupt vector is refused with its error (and reason).
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

import pytest
import torch

from kvcodec import decode, encode, errors
from kvcodec.format import assemble, header_size, parse, serialize_header
from tests._helpers import read_vector, vector_manifest
from tests.paths import SHARED_VECTORS, VECTORS

FOLDERS = {"repo": VECTORS, "shared": SHARED_VECTORS}


def _params(kinds: tuple[str, ...]) -> list:
    """One param per vector of these kinds: tests/vectors always, ../shared/vectors only when present."""
    out = [
        pytest.param("repo", e, id=f"repo-{e['name']}")
        for e in vector_manifest(VECTORS)
        if e["kind"] in kinds
    ]
    if (SHARED_VECTORS / "manifest.json").is_file():
        entries = vector_manifest(SHARED_VECTORS)
        out += [pytest.param("shared", e, id=f"shared-{e['name']}") for e in entries if e["kind"] in kinds]
    else:
        out.append(pytest.param("shared", None, marks=pytest.mark.skip(reason=f"no {SHARED_VECTORS}")))
    return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor(folder: Path, name: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    return torch.frombuffer(bytearray(read_vector(folder, name)), dtype=dtype).view(shape)


def test_the_committed_vectors_cover_what_they_claim() -> None:
    entries = vector_manifest(VECTORS)
    kinds = {e["kind"] for e in entries}
    assert kinds == {"codec", "external", "header", "corrupt"}
    codec = [e for e in entries if e["kind"] in ("codec", "external")]
    assert {e["scale_scope"] for e in codec} == {"PER_TENSOR", "PER_LAYER_HEAD", "PER_PAGE_HEAD", "EXTERNAL"}
    assert {e["k_dtype"] for e in codec} == {"float16", "bfloat16"}
    assert {e["scale_dtype"] for e in codec} == {"float32", "float16"}
    assert sum(p.stat().st_size for p in VECTORS.iterdir()) < 200_000


FIELDS = ("layer_id", "chunk_id", "chunk_size", "page_size", "kv_head_count", "head_dim")
LENGTHS = ("k_payload_len", "v_payload_len", "scale_payload_len")


@pytest.mark.parametrize(("where", "entry"), _params(("codec", "external", "header")))
def test_vector_parses_to_its_manifest_and_reserializes(where: str, entry: dict) -> None:
    blob = read_vector(FOLDERS[where], entry["name"])
    assert hashlib.sha256(blob).hexdigest() == entry["blob_sha256"]
    p = parse(blob, strict=True)
    h = p.header
    assert h.version == 1 and h.scale_scope.name == entry["scale_scope"]
    assert [str(d) for d in (h.k_dtype, h.v_dtype, h.scale_dtype)] == [
        entry["k_dtype"],
        entry["v_dtype"],
        entry["scale_dtype"],
    ]
    assert {f: getattr(h, f) for f in FIELDS + LENGTHS} == {f: entry[f] for f in FIELDS + LENGTHS}
    assert list(h.scale_shape) == entry["scale_shape"] and h.hashes.as_dict() == entry["hashes"]
    assert p.crc == entry["payload_crc32"] == zlib.crc32(p.payload)
    assert p.header_len == entry["header_len"] == header_size(h)
    assert p.trailing == 0 and p.unknown_hashes == ()
    assert serialize_header(h, [p.payload]) + bytes(p.payload) == blob
    assert bytes(assemble(h, p.k, p.v, p.scales)) == blob


@pytest.mark.parametrize(("where", "entry"), _params(("codec",)))
def test_encode_rewrites_the_vector_from_its_inputs(where: str, entry: dict) -> None:
    folder = FOLDERS[where]
    dtype = getattr(torch, entry["input_dtype"])
    k = _tensor(folder, entry["name"] + ".k", dtype, entry["input_shape"])
    v = _tensor(folder, entry["name"] + ".v", dtype, entry["input_shape"])
    blob = encode(
        k,
        v,
        scope=entry["scale_scope"].lower(),
        page_size=entry["page_size"],
        scale_dtype=getattr(torch, entry["scale_dtype"]),
        hashes=entry["hashes"],
        layer_id=entry["layer_id"],
        chunk_id=entry["chunk_id"],
        chunk_size=entry["chunk_size"],
        version=1,  # LMCache writes version 1; kvcodec's own default is the sealed version 2
    )
    ref = read_vector(folder, entry["name"])
    assert bytes(blob) == ref
    out = decode(ref)
    assert torch.equal(out.k.reshape(k.shape).view(torch.uint8), k.view(torch.uint8))
    p = parse(ref)
    assert out.v.reshape(-1).view(torch.uint8).numpy().tobytes() == bytes(p.v)
    assert out.scales.reshape(-1).view(torch.uint8).numpy().tobytes() == bytes(p.scales)


@pytest.mark.parametrize(("where", "entry"), _params(("codec",)))
def test_the_lmcache_compat_api_rewrites_the_vector(where: str, entry: dict) -> None:
    from kvcodec.integrations.lmcache import compat

    folder = FOLDERS[where]
    dtype = getattr(torch, entry["input_dtype"])
    k = _tensor(folder, entry["name"] + ".k", dtype, entry["input_shape"])
    v = _tensor(folder, entry["name"] + ".v", dtype, entry["input_shape"])
    scope = compat.ScaleScope[entry["scale_scope"]]
    codec = compat.AsymK16V8Codec(scale_scope=scope, scale_dtype=getattr(torch, entry["scale_dtype"]))
    tokens, heads, dim = entry["input_shape"]
    fields = {f: entry[f] for f in FIELDS}
    if scope == compat.ScaleScope.PER_PAGE_HEAD:
        paged = (tokens // entry["page_size"], entry["page_size"], heads, dim)
        k, v, fields["page_axis"] = k.view(paged), v.view(paged), 0
    enc = codec.encode(k, v, hashes=entry["hashes"], **fields)
    assert codec.to_bytes(enc) == read_vector(folder, entry["name"])


@pytest.mark.parametrize(("where", "entry"), _params(("external",)))
def test_encode_rewrites_an_external_vector_from_its_codes_and_scales(where: str, entry: dict) -> None:
    folder = FOLDERS[where]
    shape, heads = entry["input_shape"], entry["kv_head_count"]
    k = _tensor(folder, entry["name"] + ".k", getattr(torch, entry["input_dtype"]), shape)
    q = _tensor(folder, entry["name"] + ".q", getattr(torch, entry["v_dtype"]), shape)
    s = _tensor(folder, entry["name"] + ".s", getattr(torch, entry["scale_dtype"]), [heads])
    blob = encode(
        k,
        k,
        scope="external",
        precomputed_v_quant=q,
        precomputed_v_scales=s,
        store_scales=True,  # LMCache stores attached external scales
        page_size=entry["page_size"],
        hashes=entry["hashes"],
        layer_id=entry["layer_id"],
        chunk_id=entry["chunk_id"],
        chunk_size=entry["chunk_size"],
        version=1,
    )
    assert bytes(blob) == read_vector(folder, entry["name"])


@pytest.mark.parametrize(("where", "entry"), _params(("corrupt",)))
def test_corrupt_vector_is_refused(where: str, entry: dict) -> None:
    blob = read_vector(FOLDERS[where], entry["name"])
    expected = getattr(errors, entry["expect_error"])
    for read in (parse, decode):
        with pytest.raises(expected) as e:
            read(blob)
        if "expect_reason" in entry:
            assert e.value.reason == errors.Reason(entry["expect_reason"]), (read.__name__, e.value)


def test_corrupt_vectors_differ_from_their_source_only_by_their_defect() -> None:
    """Each corrupt vector is a readable blob but for one edit (so it tests the rule it names)."""
    entries = {e["name"]: e for e in vector_manifest(VECTORS)}
    for e in entries.values():
        if e["kind"] != "corrupt":
            continue
        src, bad = read_vector(VECTORS, e["from"]), read_vector(VECTORS, e["name"])
        changed = sum(a != b for a, b in zip(src, bad)) + abs(len(src) - len(bad))
        assert 0 < changed <= 9, (e["name"], changed)  # one field or one scale (+ its CRC when resealed)
