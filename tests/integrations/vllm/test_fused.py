"""The vLLM connector's fused path (kvcodec.integrations.vllm.fused) against its per-layer path, byte for byte.

Caches are built as vLLM 0.33 lays them out (one allocation in a
``KVCacheLayout`` order, each layer's view the ``[B, H, N, C]`` permutation of
its slice), without vLLM. Saves must write the very blobs
:func:`~kvcodec.integrations.vllm.chunks.encode_chunk` writes; loads must
leave the caches bit-identical to the per-layer load, and refuse bad blobs
with the same error classes before writing anything. Without a GPU the
kernels run in Triton's interpreter (tiny shapes).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import CUDA as _CUDA
from tests.kernels.conftest import DEVICE, KERNEL_MARKS, require_kernels

require_kernels()

import kvcodec  # noqa: E402
from kvcodec import CodecMismatchError, CorruptEncodedKVError, UnsupportedConfigError  # noqa: E402
from kvcodec.integrations.vllm.chunks import ChunkCodec, encode_chunk  # noqa: E402
from kvcodec.integrations.vllm.config import KvcodecConfig  # noqa: E402
from kvcodec.integrations.vllm.fused import FusedLayers, eligibility  # noqa: E402
from tests.integrations.vllm.loading import ChunkLoad, load_layers, reference_load  # noqa: E402

MODE = "auto" if _CUDA else "on"
pytestmark = KERNEL_MARKS

LAYOUTS = ("LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC", "LHBNC")
HASHES = {"model_id": "tiny", "kv_layout": "vllm-token-major;test"}
H, D, BS, NB, L = 2, 8, 4, 9, 2
TABLE = [7, 2, 5, 0, 3, 8]
"""Odd, shuffled block ids: chunk 1 of 8 tokens is blocks 5 and 0."""


def _phys(
    layout: str, *, dtype: torch.dtype, blocks: int = NB, bs: int = BS, c: int = 2 * D, seed: int = 0
) -> torch.Tensor:
    size = {"L": L, "B": blocks, "N": bs, "H": H, "C": c}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn([size[a] for a in layout], generator=g) * 3
    x[..., 1] *= 40  # heavy tails: groups saturate differently
    return x.to(dtype).to(DEVICE)


def _views(phys: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    """Layer name -> that layer's ``[B, H, N, C]`` view of the allocation."""
    rest = layout.replace("L", "")
    out = {}
    for i in range(L):
        x = phys.select(layout.index("L"), i)
        out[f"model.layers.{i}.self_attn.attn"] = x.permute([rest.index(a) for a in "BHNC"])
    return out


def _ids(caches: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: int(n.split(".")[2]) for n in caches}


def _codec(scope: str = "per_page_head", **kw: object) -> ChunkCodec:
    return ChunkCodec(
        **{"head_size": D, "block_size": BS, "scope": scope, "page_size": 4, "hashes": HASHES, **kw}
    )


def _fused(caches: dict[str, torch.Tensor], cc: ChunkCodec) -> FusedLayers:
    fused, why = FusedLayers.build(caches, _ids(caches), cc, MODE)
    assert fused is not None, why
    return fused


def _ref_blobs(
    caches: dict[str, torch.Tensor], cc: ChunkCodec, chunk: int, cs: int, table: list[int] = TABLE
) -> dict[str, bytes]:
    ids = _ids(caches)
    return {
        n: bytes(encode_chunk(v, table, cc, start=chunk * cs, num_tokens=cs, layer_id=ids[n], chunk_id=chunk))
        for n, v in caches.items()
    }


# ----------------------------------------------------------------------------
# Saves: the per-layer path's bytes
# ----------------------------------------------------------------------------


def _check_save(layout: str, dtype: torch.dtype, cc: ChunkCodec, *, chunk: int = 1, cs: int = 8) -> None:
    caches = _views(_phys(layout, dtype=dtype, seed=3), layout)
    got = _fused(caches, cc).save(TABLE, chunk, cs)
    assert [n for n, _ in got] == sorted(caches, key=_ids(caches).get)
    ref = _ref_blobs(caches, cc, chunk, cs)
    for name, blob in got:
        assert bytes(blob) == ref[name], name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_every_layout(layout: str) -> None:
    _check_save(layout, torch.float16, _codec())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("scope", ["per_page_head", "per_layer_head", "per_tensor"])
def test_save_scopes_dtypes(dtype: torch.dtype, scope: str) -> None:
    """Pages of 4 over blocks of 4, chunk 2 (blocks 3 and 8); version 1 and 2 headers."""
    _check_save("BHLNC", dtype, _codec(scope, version=1 if scope == "per_tensor" else 2), chunk=2)


def test_save_fp32_cache_and_chunk_over_three_blocks() -> None:
    """12 tokens from block 4 on: blocks 3, 8 and the partly used 7 of a longer table."""
    caches = _views(_phys("LBNHC", dtype=torch.float32, blocks=10), "LBNHC")
    cc = _codec("per_layer_head", page_size=5)
    table = [1, 6, 2, 9, 3, 8, 7]
    got = dict(_fused(caches, cc).save(table, 1, 12))
    ref = _ref_blobs(caches, cc, 1, 12, table)
    assert {n: bytes(b) for n, b in got.items()} == ref


def test_save_kernel_blocks_split_from_scheduler_blocks() -> None:
    """Views of 4-slot kernel blocks under 8-token scheduler blocks (vLLM's split): ids are expanded."""
    caches = _views(_phys("BLNHC", dtype=torch.bfloat16, blocks=2 * 5), "BLNHC")
    cc = _codec(block_size=8)
    table = [3, 1, 4, 0]
    got = dict(_fused(caches, cc).save(table, 1, 16))
    assert {n: bytes(b) for n, b in got.items()} == _ref_blobs(caches, cc, 1, 16, table)


def test_save_refuses_nan_like_the_per_layer_path() -> None:
    phys = _phys("LBNHC", dtype=torch.float16)
    caches = _views(phys, "LBNHC")
    name1 = "model.layers.1.self_attn.attn"
    caches[name1][5, 1, 2, D + 3] = float("nan")  # V of layer 1, token 10 (chunk 1)
    cc = _codec()
    with pytest.raises(UnsupportedConfigError) as per_layer:
        encode_chunk(caches[name1], TABLE, cc, start=8, num_tokens=8, layer_id=1, chunk_id=1)
    with pytest.raises(UnsupportedConfigError, match="layer 1") as fused:
        _fused(caches, cc).save(TABLE, 1, 8)
    assert type(fused.value) is type(per_layer.value)
    # Chunk 0 holds no NaN: saved as ever.
    assert len(_fused(caches, cc).save(TABLE, 0, 8)) == L


# ----------------------------------------------------------------------------
# Loads: the per-layer path's cache bytes
# ----------------------------------------------------------------------------


def _load_both(
    layout: str, dtype: torch.dtype, blobs: dict[str, bytes], cc: ChunkCodec, req: ChunkLoad, *, seed: int = 9
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(original, after the fused path, after the per-layer path) of one allocation, and whether it was fused."""
    orig = _phys(layout, dtype=dtype, seed=seed)
    a, b = orig.clone(), orig.clone()
    ca, cb = _views(a, layout), _views(b, layout)
    fused = load_layers(blobs, ca, lambda _: cc, req, _fused(ca, cc))
    for name, blob in blobs.items():
        reference_load(
            blob, cb[name], req.block_ids, cc, start=req.start, num_tokens=req.chunk_size, skip=req.skip
        )
    return orig, a, b, fused


def _raw(x: torch.Tensor) -> bytes:
    return bytes(x.cpu().contiguous().view(torch.uint8).numpy())


def _touched_blocks(orig: torch.Tensor, new: torch.Tensor, layout: str) -> set[int]:
    bits = {2: torch.int16, 4: torch.int32}[orig.element_size()]
    diff = (orig.view(bits) != new.view(bits)).movedim(layout.index("B"), 0)
    return {i for i in range(diff.shape[0]) if bool(diff[i].any())}


@pytest.mark.parametrize("layout", ["LBNHC", "BHLNC", "LHBNC"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("scope", ["per_page_head", "per_layer_head", "per_tensor"])
def test_load_equals_per_layer_load(layout: str, dtype: torch.dtype, scope: str) -> None:
    cc = _codec(scope)
    blobs = _ref_blobs(_views(_phys(layout, dtype=dtype, seed=1), layout), cc, 1, 8)
    orig, a, b, fused = _load_both(layout, dtype, blobs, cc, ChunkLoad(TABLE, 1, 8))
    assert fused
    assert _raw(a) == _raw(b)
    assert _touched_blocks(orig, a, layout) == {5, 0}  # chunk 1's blocks only


def test_load_payload_rows_start_16_bytes_apart() -> None:
    """per_tensor payloads end in 4 scale bytes: the uploaded rows are padded, as the save side's are,
    so the kernels' 128-bit accesses hold in every layer, not only the first."""
    cc = _codec("per_tensor")
    caches = _views(_phys("LBNHC", dtype=torch.float16, seed=1), "LBNHC")
    fused = _fused(caches, cc)
    parsed = [kvcodec.parse(b) for b in _ref_blobs(caches, cc, 1, 8).values()]
    for p in parsed:
        fused.check(p, 8)
    rows = fused._upload(parsed)
    assert rows.shape == (L, parsed[0].header.payload_len) and parsed[0].header.payload_len % 16
    assert rows.stride(0) % 16 == 0 and rows.data_ptr() % 16 == 0
    assert all(bytes(rows[j].cpu().numpy()) == bytes(p.payload) for j, p in enumerate(parsed))


def test_load_blob_of_another_scope_decodes_by_its_header() -> None:
    """Blobs written per tensor load into a per_page_head engine, as the per-layer path loads them."""
    written = _codec("per_tensor")
    blobs = _ref_blobs(_views(_phys("LBNHC", dtype=torch.bfloat16, seed=1), "LBNHC"), written, 0, 8)
    _, a, b, fused = _load_both(
        "LBNHC", torch.bfloat16, blobs, _codec("per_page_head"), ChunkLoad(TABLE, 0, 8)
    )
    assert fused and _raw(a) == _raw(b)


def test_partial_chunk_goes_layer_by_layer_and_keeps_computed_tokens() -> None:
    """skip=3: vLLM computed the chunk's first 3 tokens already; they stay untouched (per-layer path)."""
    cc = _codec()
    blobs = _ref_blobs(_views(_phys("BLHNC", dtype=torch.float16, seed=1), "BLHNC"), cc, 1, 8)
    orig, a, b, fused = _load_both("BLHNC", torch.float16, blobs, cc, ChunkLoad(TABLE, 1, 8, skip=3))
    assert not fused
    assert torch.equal(a, b)
    va, vo = _views(a, "BLHNC"), _views(orig, "BLHNC")
    for name in va:
        assert torch.equal(va[name][5, :, :3], vo[name][5, :, :3])  # tokens 8..10: block 5, slots 0..2
        assert not torch.equal(va[name][5, :, 3], vo[name][5, :, 3])
    assert _touched_blocks(orig, a, "BLHNC") == {5, 0}


@pytest.mark.parametrize("layout", ["BLHNC", "LHBNC"])
@pytest.mark.parametrize("scope", ["per_page_head", "per_layer_head", "per_tensor"])
def test_block_aligned_partial_chunk_is_fused_and_keeps_computed_tokens(layout: str, scope: str) -> None:
    """skip=4 (one block; vLLM's prefix-cache hits end on blocks): the tail of each payload is decoded
    in one launch, the cache equals the per-layer load's, and block 5 (tokens 8..11) is untouched."""
    cc = _codec(scope)
    blobs = _ref_blobs(_views(_phys(layout, dtype=torch.bfloat16, seed=1), layout), cc, 1, 8)
    orig, a, b, fused = _load_both(layout, torch.bfloat16, blobs, cc, ChunkLoad(TABLE, 1, 8, skip=4))
    assert fused
    assert _raw(a) == _raw(b)
    assert _touched_blocks(orig, a, layout) == {0}


def test_partial_chunk_splitting_a_scale_page_goes_layer_by_layer() -> None:
    """Blobs with 8-token scale pages, skip=4: the tail is no whole number of pages, so no fused load."""
    written = _codec(page_size=8)
    blobs = _ref_blobs(_views(_phys("LBNHC", dtype=torch.float16, seed=1), "LBNHC"), written, 1, 8)
    orig, a, b, fused = _load_both("LBNHC", torch.float16, blobs, written, ChunkLoad(TABLE, 1, 8, skip=4))
    assert not fused
    assert _raw(a) == _raw(b) and _touched_blocks(orig, a, "LBNHC") == {0}


def test_unaligned_chunks_are_not_fused() -> None:
    caches = _views(_phys("LBNHC", dtype=torch.float16), "LBNHC")
    fused = _fused(caches, _codec())
    assert fused.serves(8) and fused.serves(8, skip=4)
    assert not fused.serves(6) and not fused.serves(8, skip=1) and not fused.serves(6, skip=2)


def test_mixed_scopes_across_layers_go_layer_by_layer() -> None:
    """Valid blobs the kernels cannot decode together: no fused plan, and the per-layer path loads them."""
    caches = _views(_phys("LBNHC", dtype=torch.float16, seed=1), "LBNHC")
    b0 = _ref_blobs(caches, _codec("per_tensor"), 1, 8)
    b1 = _ref_blobs(caches, _codec("per_layer_head"), 1, 8)
    names = sorted(caches)
    blobs = {names[0]: b0[names[0]], names[1]: b1[names[1]]}
    dst = _phys("LBNHC", dtype=torch.float16, seed=9)
    before = dst.clone()
    cd = _views(dst, "LBNHC")
    parsed = {n: kvcodec.parse(b) for n, b in blobs.items()}
    assert _fused(cd, _codec()).prepare(parsed, 1, 8) is None
    assert torch.equal(dst, before)
    assert not load_layers(blobs, cd, lambda _: _codec(), ChunkLoad(TABLE, 1, 8), _fused(cd, _codec()))
    assert not torch.equal(dst, before)


# ----------------------------------------------------------------------------
# Refused blobs: the same error classes, nothing written
# ----------------------------------------------------------------------------


def _corrupt(blob: bytes) -> bytes:
    b = bytearray(blob)
    b[-5] ^= 0x40
    return bytes(b)


def _foreign(caches: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return _ref_blobs(caches, _codec(hashes={**HASHES, "model_id": "other"}), 1, 8)


def _short(caches: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return _ref_blobs(caches, _codec(), 1, 4)


def _fp16_into_bf16(caches: dict[str, torch.Tensor]) -> dict[str, bytes]:
    src = _views(_phys("LBNHC", dtype=torch.float16), "LBNHC")
    return _ref_blobs(src, _codec(), 1, 8)


@pytest.mark.parametrize(
    "make,err",
    [
        (lambda c: {n: _corrupt(b) for n, b in _ref_blobs(c, _codec(), 1, 8).items()}, CorruptEncodedKVError),
        (_foreign, CodecMismatchError),
        (_short, UnsupportedConfigError),
        (_fp16_into_bf16, UnsupportedConfigError),
    ],
    ids=["crc", "foreign", "geometry", "k-dtype"],
)
def test_bad_blobs_refused_like_the_per_layer_path(make, err) -> None:
    caches = _views(_phys("LBNHC", dtype=torch.bfloat16, seed=1), "LBNHC")
    blobs = make(caches)
    dst = _phys("LBNHC", dtype=torch.bfloat16, seed=9)
    before = dst.clone()
    cd = _views(dst, "LBNHC")
    cc = _codec()
    for name, blob in blobs.items():
        with pytest.raises(err):
            reference_load(blob, cd[name], TABLE, cc, start=8, num_tokens=8)
    with pytest.raises(err):
        load_layers(blobs, cd, lambda _: cc, ChunkLoad(TABLE, 1, 8), _fused(cd, cc))
    assert torch.equal(dst, before)


def test_one_bad_layer_writes_no_layer() -> None:
    caches = _views(_phys("LBNHC", dtype=torch.float16, seed=1), "LBNHC")
    blobs = _ref_blobs(caches, _codec(), 1, 8)
    last = sorted(caches)[-1]
    blobs[last] = _corrupt(blobs[last])
    dst = _phys("LBNHC", dtype=torch.float16, seed=9)
    before = dst.clone()
    cd = _views(dst, "LBNHC")
    with pytest.raises(CorruptEncodedKVError):
        load_layers(blobs, cd, lambda _: _codec(), ChunkLoad(TABLE, 1, 8), _fused(cd, _codec()))
    assert torch.equal(dst, before)


# ----------------------------------------------------------------------------
# Eligibility and the config key
# ----------------------------------------------------------------------------


def test_eligibility_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    caches = _views(_phys("LBNHC", dtype=torch.float16), "LBNHC")
    cc = _codec()
    assert eligibility(caches, cc, MODE).ok
    assert "off" in eligibility(caches, cc, "off").reason
    fp8 = {n: v.view(torch.uint8)[..., : 2 * D] for n, v in caches.items()}
    assert "FP8" in eligibility(fp8, cc, MODE).reason
    wide = _views(_phys("LBNHC", dtype=torch.float16, c=D + 12), "LBNHC")
    assert "head_size == head_size_v" in eligibility(wide, cc, MODE).reason
    mixed = dict(caches)
    mixed[sorted(mixed)[0]] = mixed[sorted(mixed)[0]].contiguous()
    assert "differ" in eligibility(mixed, cc, MODE).reason
    assert "no layer" in eligibility({}, cc, MODE).reason
    assert "multiple" in eligibility(caches, _codec(block_size=6), MODE).reason
    with pytest.raises(UnsupportedConfigError, match="fused must be"):
        eligibility(caches, cc, "yes")
    if not _CUDA:
        assert "CUDA" in eligibility(caches, cc, "auto").reason
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert "TRITON_INTERPRET=1" in eligibility(caches, cc, "on").reason


def test_build_on_refuses_ineligible_caches_auto_falls_back() -> None:
    wide = _views(_phys("LBNHC", dtype=torch.float16, c=D + 12), "LBNHC")
    cc = _codec()
    with pytest.raises(UnsupportedConfigError, match='fused="on"'):
        FusedLayers.build(wide, _ids(wide), cc, "on")
    fused, why = FusedLayers.build(wide, _ids(wide), cc, "auto")
    assert fused is None and "head_size_v" in why


def test_config_key_validated(tmp_path) -> None:
    root = str(tmp_path)
    assert KvcodecConfig.from_extra({"root": root}).fused == "auto"
    for mode in ("auto", "on", "off"):
        assert KvcodecConfig.from_extra({"root": root, "fused": mode}).fused == mode
    for bad in ("yes", True, None, 1):
        with pytest.raises(UnsupportedConfigError, match="fused must be"):
            KvcodecConfig.from_extra({"root": root, "fused": bad})


def test_blob_parses_as_written_by_the_connector() -> None:
    """Sanity: the fused blob carries the layer/chunk ids and the ``|dk=..,dv=..`` identity suffix."""
    caches = _views(_phys("LBNHC", dtype=torch.float16), "LBNHC")
    (_, blob), _ = _fused(caches, _codec()).save(TABLE, 1, 8)
    h = kvcodec.parse(blob).header
    assert (h.layer_id, h.chunk_id, h.chunk_size) == (0, 1, 8)
    assert h.hashes.kv_layout.endswith(f"|dk={D},dv={D}")
