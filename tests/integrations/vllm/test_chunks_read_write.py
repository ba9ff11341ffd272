"""read_chunk / write_chunk: a whole chunk (every layer) read and checked, then written.

They must write exactly what the per-layer path (decode_chunk + scatter_kv) writes, into any view
layout, from any token on, and refuse every blob the per-layer path refuses before anything is
written. Views are built here (no vLLM needed): [N, H, S, C] views over allocations in several memory
orders, two layers sharing one, and a view whose blocks are split into kernel blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec import CodecMismatchError, CorruptEncodedKVError, Reason, UnsupportedConfigError, parse
from kvcodec.format import assemble
from kvcodec.format.parser import clear_header_memo, header_memo_info
from kvcodec.integrations.vllm.chunk_writes import write_chunk
from kvcodec.integrations.vllm.chunks import (
    ChunkCodec,
    FP8Scales,
    PreparedChunk,
    decode_chunk,
    encode_chunk,
    read_chunk,
)
from kvcodec.integrations.vllm.layout import scatter_kv
from kvcodec.store import DirectoryStore

H, D, BLOCK, CHUNK, NUM_BLOCKS = 2, 16, 8, 32, 12
NAMES = ("layer.0", "layer.1", "layer.2")
LAYER_IDS = {n: i for i, n in enumerate(NAMES)}
HASHES = {"model_id": "tiny", "kv_layout": "test"}
TABLE = [9, 3, 7, 0, 11, 5, 2, 8, 1, 10]
"""A request's block table: 10 blocks of 8 tokens = 80 tokens, chunks of 32 (the last one partial)."""


def _views(
    order: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0, dv: int = D
) -> dict[str, torch.Tensor]:
    """Every layer's ``[N, H, S, C]`` view over one allocation laid out in ``order``."""
    g = torch.Generator().manual_seed(seed)
    c = D + dv
    if order == "split":  # each scheduler block is two kernel blocks of BLOCK // 2 slots
        raw = torch.randn(len(NAMES), NUM_BLOCKS * 2, H, BLOCK // 2, c, generator=g).to(dtype)
        return {n: raw[i] for i, n in enumerate(NAMES)}
    dims = {"L": len(NAMES), "N": NUM_BLOCKS, "H": H, "S": BLOCK, "C": c}
    raw = torch.randn(*(dims[a] for a in order), generator=g).to(dtype)
    perm = [order.index(a) for a in "LNHSC"]
    full = raw.permute(*perm)
    return {n: full[i] for i, n in enumerate(NAMES)}


def _codec(**kw) -> ChunkCodec:
    return ChunkCodec(**{"head_size": D, "block_size": BLOCK, "hashes": HASHES, "page_size": 8, **kw})


def _chunk_hash(c: int) -> str:
    return f"prefix{c}"


def _blobs(src: dict[str, torch.Tensor], cc: ChunkCodec, c: int, tokens: int = CHUNK) -> dict[str, bytearray]:
    return {
        n: encode_chunk(
            src[n],
            TABLE,
            cc,
            start=c * CHUNK,
            num_tokens=tokens,
            layer_id=LAYER_IDS[n],
            chunk_id=c,
            chunk_hash=_chunk_hash(c),
        )
        for n in NAMES
    }


def _old_load(blobs, caches, cc, c, tokens, skip) -> None:
    for n in NAMES:
        k, v = decode_chunk(
            blobs[n], caches[n], cc, num_tokens=tokens, chunk_hash=_chunk_hash(c), ids=(LAYER_IDS[n], c)
        )
        scatter_kv(
            caches[n], TABLE, k[skip:], v[skip:], head_size=D, block_size=BLOCK, start=c * CHUNK + skip
        )


def _new_load(blobs, caches, cc, c, tokens, skip, defer=False) -> PreparedChunk:
    """read_chunk + write_chunk; ``defer``: the blobs parsed without their CRC, which write_chunk's C
    pass (or read_chunk, for a layer C does not take) then checks, as the connector's CPU loads do."""
    if defer:
        blobs = {n: parse(b, verify_crc=False, remember=False) for n, b in blobs.items()}
    chunk = read_chunk(
        blobs,
        caches,
        dict.fromkeys(NAMES, cc),
        LAYER_IDS,
        chunk_id=c,
        num_tokens=tokens,
        chunk_hash=_chunk_hash(c),
        crc_checked=not defer,
    )
    if defer:  # the C path keeps every blob for its CRC check
        assert all(layer.unverified is not None for layer in chunk.layers.values() if layer.rows is not None)
    write_chunk(chunk, caches, TABLE, start=c * CHUNK, skip=skip)
    return chunk


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in NAMES)


DEFER = pytest.mark.parametrize("defer", [False, True], ids=["crc_first", "crc_deferred"])


@DEFER
@pytest.mark.parametrize("order", ["LNHSC", "LNSHC", "NLHSC", "HLNSC", "split"])
@pytest.mark.parametrize("skip", [0, 5, 8])
def test_whole_chunk_writes_the_per_layer_paths_bytes(order, skip, defer):
    src = _views(order, seed=1)
    cc = _codec()
    for c, tokens in ((0, CHUNK), (2, 80 - 2 * CHUNK)):  # a whole chunk, then the partial last one
        blobs = _blobs(src, cc, c, tokens)
        old, new = _views(order, seed=2), _views(order, seed=2)
        _old_load(blobs, old, cc, c, tokens, skip)
        chunk = _new_load(blobs, new, cc, c, tokens, skip, defer)
        assert all(layer.rows is not None for layer in chunk.layers.values())  # C's path served it
        assert _same(old, new)
        assert not _same(new, _views(order, seed=2))  # something was written


@DEFER
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("scope", ["per_tensor", "per_layer_head", "per_page_head"])
def test_dtypes_and_scopes(dtype, scope, defer):
    src = _views("LNHSC", dtype, seed=3)
    cc = _codec(scope=scope)
    blobs = _blobs(src, cc, 1)
    old, new = _views("LNHSC", dtype, seed=4), _views("LNHSC", dtype, seed=4)
    _old_load(blobs, old, cc, 1, CHUNK, 3)
    chunk = _new_load(blobs, new, cc, 1, CHUNK, 3, defer)
    assert all(layer.rows is not None for layer in chunk.layers.values())
    assert _same(old, new)


@DEFER
@pytest.mark.parametrize("prefix", ["p", "pp", "ppp", "pppp"])
def test_any_header_length_any_alignment(prefix, defer):
    """K starts wherever the header ends (odd offsets included): C copies its bytes either way."""
    src = _views("LNHSC", seed=5)
    cc = _codec(hashes={**HASHES, "model_id": prefix})
    blobs = _blobs(src, cc, 0)
    assert {parse(b).header_len % 2 for b in blobs.values()} <= {0, 1}
    old, new = _views("LNHSC", seed=6), _views("LNHSC", seed=6)
    _old_load(blobs, old, cc, 0, CHUNK, 0)
    chunk = _new_load(blobs, new, cc, 0, CHUNK, 0, defer)
    assert all(layer.rows is not None for layer in chunk.layers.values())
    assert _same(old, new)


@DEFER
def test_blobs_from_the_store_parsed_once(tmp_path, defer):
    src = _views("LNHSC", seed=7)
    cc = _codec()
    store = DirectoryStore(tmp_path, verify=False, fsync=False)
    for n, b in _blobs(src, cc, 1).items():
        store.put(n, b)
    parsed = {n: store.get_parsed(n, verify_crc=not defer) for n in NAMES}
    old, new = _views("LNHSC", seed=8), _views("LNHSC", seed=8)
    _old_load({n: store.get(n) for n in NAMES}, old, cc, 1, CHUNK, 0)
    chunk = read_chunk(
        parsed,
        new,
        dict.fromkeys(NAMES, cc),
        LAYER_IDS,
        chunk_id=1,
        num_tokens=CHUNK,
        chunk_hash=_chunk_hash(1),
        crc_checked=not defer,
    )
    assert all((layer.unverified is not None) == defer for layer in chunk.layers.values())
    write_chunk(chunk, new, TABLE, start=CHUNK)
    assert _same(old, new)


@DEFER
def test_general_path_for_what_c_does_not_take(defer):
    """Padded V (head_size_v != head_size) and FP8 caches are decoded by decode_chunk, same bytes."""
    src = _views("LNHSC", seed=9, dv=8)
    cc = _codec()
    blobs = _blobs(src, cc, 0)
    old, new = _views("LNHSC", seed=10, dv=8), _views("LNHSC", seed=10, dv=8)
    _old_load(blobs, old, cc, 0, CHUNK, 2)
    chunk = _new_load(blobs, new, cc, 0, CHUNK, 2, defer)
    assert all(layer.rows is None and layer.kv is not None for layer in chunk.layers.values())
    assert _same(old, new)

    fp8 = FP8Scales(torch.float8_e4m3fn, 0.5, 0.25)
    cc8 = _codec(fp8=fp8)
    src8 = {n: v.view(torch.uint8) for n, v in _views("LNHSC", torch.float8_e4m3fn, seed=11).items()}
    for v in src8.values():
        v.copy_(v & 0x7E)  # no NaN codes
    blobs8 = _blobs(src8, cc8, 0)
    old8 = {n: torch.zeros_like(v) for n, v in src8.items()}
    new8 = {n: torch.zeros_like(v) for n, v in src8.items()}
    _old_load(blobs8, old8, cc8, 0, CHUNK, 0)
    chunk8 = _new_load(blobs8, new8, cc8, 0, CHUNK, 0, defer)
    assert all(layer.rows is None for layer in chunk8.layers.values())
    assert _same(old8, new8)
    assert any(v.any() for v in new8.values())


def _nan_codes(blob: bytearray) -> bytearray:
    """The blob with one V code set to NaN (0x7F), sealed again (a valid CRC)."""
    p = parse(blob)
    v = bytearray(p.v)
    v[5] = 0x7F
    return assemble(p.header, p.k, v, p.scales)


@DEFER
def test_nan_codes_take_the_reference_and_match(defer):
    src = _views("LNHSC", seed=12)
    cc = _codec()
    blobs = _blobs(src, cc, 0)
    blobs["layer.1"] = _nan_codes(blobs["layer.1"])
    old, new = _views("LNHSC", seed=13), _views("LNHSC", seed=13)
    _old_load(blobs, old, cc, 0, CHUNK, 0)
    _new_load(blobs, new, cc, 0, CHUNK, 0, defer)
    assert _same(old, new)


def _refused(blobs, caches, cc, error, match, *, c=0, ids=LAYER_IDS, chunk_hash=None, codecs=None):
    before = {n: v.clone() for n, v in caches.items()}
    with pytest.raises(error, match=match):
        read_chunk(
            blobs,
            caches,
            codecs or dict.fromkeys(NAMES, cc),
            ids,
            chunk_id=c,
            num_tokens=CHUNK,
            chunk_hash=_chunk_hash(c) if chunk_hash is None else chunk_hash,
        )
    assert _same(caches, before)


def test_refusals_before_anything_is_written():
    src = _views("LNHSC", seed=14)
    cc = _codec()
    blobs = _blobs(src, cc, 0)
    caches = _views("LNHSC", seed=15)
    # A blob misfiled under another layer's key.
    swapped = {**blobs, "layer.2": blobs["layer.1"]}
    _refused(swapped, caches, cc, CodecMismatchError, "misfiled")
    # Another chunk's blob (its prefix hash is bound into the identity).
    _refused(blobs, caches, cc, CodecMismatchError, "kv_layout", chunk_hash="otherprefix")
    # Another model.
    _refused(
        blobs,
        caches,
        cc,
        CodecMismatchError,
        "model_id",
        codecs={**dict.fromkeys(NAMES, cc), "layer.2": _codec(hashes={**HASHES, "model_id": "x"})},
    )
    # A damaged payload (raw buffers are parsed with their CRC).
    bad = bytearray(blobs["layer.2"])
    bad[-7] ^= 0x40
    _refused({**blobs, "layer.2": bad}, caches, cc, CorruptEncodedKVError, "CRC")
    # K of another dtype: K loads bit-exact or not at all.
    _refused(blobs, _views("LNHSC", torch.float16, seed=15), cc, UnsupportedConfigError, "bit-exact")
    # Other geometry (more heads in the cache than in the blob).
    wide = {n: torch.zeros(NUM_BLOCKS, 2 * H, BLOCK, 2 * D, dtype=torch.bfloat16) for n in NAMES}
    _refused(blobs, wide, cc, UnsupportedConfigError, "cache needs")


def test_store_quarantines_a_damaged_blob(tmp_path):
    src = _views("LNHSC", seed=16)
    cc = _codec()
    store = DirectoryStore(tmp_path, verify=False, fsync=False)
    for n, b in _blobs(src, cc, 0).items():
        store.put(n, b)
    path = tmp_path / "layer.1"
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptEncodedKVError, match="CRC"):
        store.get_parsed("layer.1")
    assert not path.exists() and len(list((tmp_path / ".quarantine").iterdir())) == 1


def test_write_chunk_checks_every_layer_before_writing():
    src = _views("LNHSC", seed=17)
    cc = _codec()
    caches = _views("LNHSC", seed=18)
    chunk = read_chunk(
        _blobs(src, cc, 0),
        caches,
        dict.fromkeys(NAMES, cc),
        LAYER_IDS,
        chunk_id=0,
        num_tokens=CHUNK,
        chunk_hash=_chunk_hash(0),
    )
    before = {n: v.clone() for n, v in caches.items()}
    # The last layer's cache has fewer blocks: its slots fail, and no layer was written first.
    small = {**caches, "layer.2": caches["layer.2"][:4]}
    with pytest.raises(UnsupportedConfigError, match="blocks"):
        write_chunk(chunk, small, TABLE, start=0)
    with pytest.raises(UnsupportedConfigError, match="skip"):
        write_chunk(chunk, caches, TABLE, start=0, skip=CHUNK + 1)
    with pytest.raises(UnsupportedConfigError, match="block ids"):
        write_chunk(chunk, caches, [0, 1, 1, 2], start=0)
    assert _same(caches, before)


def test_decoded_gives_the_per_layer_paths_tensors():
    src = _views("LNHSC", seed=19)
    cc = _codec()
    blobs = _blobs(src, cc, 0)
    caches = _views("LNHSC", seed=20)
    chunk = read_chunk(
        blobs,
        caches,
        dict.fromkeys(NAMES, cc),
        LAYER_IDS,
        chunk_id=0,
        num_tokens=CHUNK,
        chunk_hash=_chunk_hash(0),
    )
    for n in NAMES:
        k, v = chunk.layers[n].decoded(torch.bfloat16)
        k0, v0 = decode_chunk(
            blobs[n], caches[n], cc, num_tokens=CHUNK, chunk_hash=_chunk_hash(0), ids=(LAYER_IDS[n], 0)
        )
        assert torch.equal(k.view(torch.int16), k0.view(torch.int16))
        assert torch.equal(v.view(torch.int16), v0.view(torch.int16))
        assert np.shares_memory(chunk.layers[n].rows.k, np.frombuffer(blobs[n], np.uint8))  # K not copied


def test_a_header_parsed_without_consistency_is_checked_by_the_general_path():
    """A ParsedBlob from parse(consistency=False) whose scale shape contradicts its scope is refused."""
    src = _views("LNHSC", seed=21)
    cc = _codec()
    blobs = _blobs(src, cc, 0)
    p = parse(blobs["layer.1"])
    pages, heads = p.header.scale_shape
    bad = assemble(p.header.replace(scale_shape=(pages * heads, 1)), p.k, p.v, p.scales)
    loose = {**blobs, "layer.1": parse(bad, consistency=False)}
    _refused(loose, _views("LNHSC", seed=22), cc, CorruptEncodedKVError, "scale_shape")


# ----------------------------------------------------------------------------
# The CRC deferred to write_chunk's C pass: damage is found there
# ----------------------------------------------------------------------------


def _flipped(blob: bytearray, part: str) -> bytearray:
    """The blob with one payload byte changed and its CRC left as it was (damage at rest)."""
    p = parse(blob)
    h = p.header
    out = bytearray(blob)
    if part == "k":
        out[p.header_len + 3] ^= 0x01  # token 0: skipped by a load with skip > 0
    elif part in ("v", "v_nan"):
        at = p.header_len + h.k_payload_len + 7
        out[at] = 0x7F if part == "v_nan" else (out[at] ^ 0x01 if out[at] & 0x7F != 0x7E else out[at] ^ 0x02)
    else:  # a scale's lowest mantissa byte: still a valid (positive, finite) scale
        out[p.header_len + h.k_payload_len + h.v_payload_len] ^= 0x01
    return out


@pytest.mark.parametrize("part", ["k", "v", "v_nan", "scale"])
@pytest.mark.parametrize("skip", [0, 5])
def test_deferred_crc_finds_damage_while_writing(part, skip):
    src = _views("LNHSC", seed=23)
    cc = _codec()
    blobs = _blobs(src, cc, 0)
    blobs["layer.1"] = _flipped(blobs["layer.1"], part)
    with pytest.raises(CorruptEncodedKVError, match="CRC"):
        parse(blobs["layer.1"])  # the damage is one the CRC alone finds
    caches = _views("LNHSC", seed=24)
    with pytest.raises(CorruptEncodedKVError) as e:
        _new_load(blobs, caches, cc, 0, CHUNK, skip, defer=True)
    assert e.value.reason == Reason.CRC_MISMATCH


def test_deferred_crc_of_a_layer_c_does_not_take_is_checked_before_writing():
    src = _views("LNHSC", seed=25, dv=8)
    cc = _codec()
    blobs = _blobs(src, cc, 0)
    blobs["layer.2"] = _flipped(blobs["layer.2"], "k")
    parsed = {n: parse(b, verify_crc=False, remember=False) for n, b in blobs.items()}
    caches = _views("LNHSC", seed=26, dv=8)
    before = {n: v.clone() for n, v in caches.items()}
    with pytest.raises(CorruptEncodedKVError) as e:
        read_chunk(
            parsed,
            caches,
            dict.fromkeys(NAMES, cc),
            LAYER_IDS,
            chunk_id=0,
            num_tokens=CHUNK,
            chunk_hash=_chunk_hash(0),
            crc_checked=False,
        )
    assert e.value.reason == Reason.CRC_MISMATCH
    assert _same(caches, before)


def test_the_header_memo_keeps_a_deferred_blob_only_once_its_crc_passed():
    src = _views("LNHSC", seed=27)
    cc = _codec()
    blobs = _blobs(src, cc, 0)
    bad = {**blobs, "layer.0": _flipped(blobs["layer.0"], "v")}
    clear_header_memo()
    try:
        with pytest.raises(CorruptEncodedKVError):
            _new_load(bad, _views("LNHSC", seed=28), cc, 0, CHUNK, 0, defer=True)
        assert header_memo_info().entries == 0  # the failing blob (first written) left nothing
        _new_load(blobs, _views("LNHSC", seed=28), cc, 0, CHUNK, 0, defer=True)
        assert header_memo_info().entries == 1  # the layers share one header (ids aside): kept once passed
    finally:
        clear_header_memo()


@pytest.mark.parametrize("defer", [False, True], ids=["crc-first", "crc-deferred"])
def test_blobs_of_other_layouts_in_one_chunk_each_write_their_own(defer):
    """read_chunk works a layout out once per run of blobs that share it: blobs of one chunk in
    other scopes (and so other scale shapes), one after another, each write what the per-layer path
    writes, through C."""
    src = _views("LNHSC", seed=5)
    scopes = dict(zip(NAMES, ("per_page_head", "per_tensor", "per_page_head")))
    blobs = {n: _blobs(src, _codec(scope=s), 1)[n] for n, s in scopes.items()}
    old, new = _views("LNHSC", seed=6), _views("LNHSC", seed=6)
    _old_load(blobs, old, _codec(), 1, CHUNK, 0)
    chunk = _new_load(blobs, new, _codec(), 1, CHUNK, 0, defer=defer)
    assert all(layer.rows is not None for layer in chunk.layers.values())
    shapes = [tuple(layer.rows.scales.shape) for layer in chunk.layers.values()]
    assert shapes == [(CHUNK // 8, H), (), (CHUNK // 8, H)]
    assert _same(old, new)
