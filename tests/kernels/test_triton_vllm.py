"""Fused gather+encode / decode+scatter over vLLM 0.33 layer views vs torch gather + kvcodec, byte for byte.

Views are built as vLLM builds them: one physical allocation in a
``KVCacheLayout`` order (L = layer, B = block, N = slot, H = head, C =
channel), each layer's view the ``[B, H, N, C]`` permutation of its slice.
Without a GPU the kernels run in Triton's interpreter (tiny shapes: ~10 ms per
program); ``test_cuda_planning_replayed`` also runs the launches as planned
for a CUDA GPU so the branches CUDA takes are covered here.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, KERNEL_MARKS, require_kernels

require_kernels()

from kvcodec.kernels import operands, vllm_triton  # noqa: E402

import kvcodec  # noqa: E402
from kvcodec import ScaleScope, UnsupportedConfigError  # noqa: E402
from kvcodec.codec.chunk_blobs import ChunkEncoder  # noqa: E402

pytestmark = KERNEL_MARKS

PT = ScaleScope.PER_TENSOR
LH = ScaleScope.PER_LAYER_HEAD
PH = ScaleScope.PER_PAGE_HEAD
LAYOUTS = ("LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC", "LHBNC")


def vllm_views(
    layout: str, layers: int, blocks: int, heads: int, bs: int, c: int, dtype: torch.dtype, seed: int = 0
) -> list[torch.Tensor]:
    """Per-layer ``[B, H, N, C]`` views of one allocation in ``layout``'s physical order, random values."""
    size = {"L": layers, "B": blocks, "N": bs, "H": heads, "C": c}
    g = torch.Generator().manual_seed(seed)
    phys = (torch.randn([size[a] for a in layout], generator=g) * 3).to(dtype).to(DEVICE)
    phys[..., 1] *= 40  # heavy tails: groups saturate differently
    out = []
    for i in range(layers):
        x = phys.select(layout.index("L"), i)
        rest = layout.replace("L", "")
        out.append(x.permute([rest.index(a) for a in "BHNC"]))
    return out


def gather_ref(view: torch.Tensor, ids: list[int], t: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch gather of a chunk: token ``i`` is slot ``i % bs`` of block ``ids[i // bs]``."""
    bs = view.shape[2]
    tok = torch.arange(t)
    blk = torch.tensor(ids, dtype=torch.int64)[tok // bs]
    rows = view[blk.to(view.device), :, (tok % bs).to(view.device)]  # [T, H, C]
    return rows[..., :d].contiguous(), rows[..., d:].contiguous()


def ref_blob(k: torch.Tensor, v: torch.Tensor, scope: ScaleScope, ps: int | None, **kw: object) -> bytes:
    return bytes(
        kvcodec.encode(k.cpu(), v.cpu(), scope=scope, page_size=ps, backend="torch", **{"version": 1, **kw})
    )


def ref_payload(k: torch.Tensor, v: torch.Tensor, scope: ScaleScope, ps: int | None) -> bytes:
    blob = ref_blob(k, v, scope, ps)
    return blob[kvcodec.parse(blob).header_len :]


def payload_bytes(p: torch.Tensor) -> bytes:
    return bytes(p.cpu().contiguous().numpy())


def shuffled(n: int, nb: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(i) for i in torch.randperm(nb, generator=g)[:n]]


def encode_case(
    layout: str,
    dtype: torch.dtype,
    scope: ScaleScope,
    ps: int | None,
    *,
    bs: int,
    t: int,
    layers: int = 2,
    h: int = 2,
    d: int = 16,
    seed: int = 0,
) -> None:
    nb = -(-t // bs) + 2
    views = vllm_views(layout, layers, nb, h, bs, 2 * d, dtype, seed)
    ids = shuffled(-(-t // bs), nb, seed)
    k0, v0 = gather_ref(views[0], ids, t, d)
    nbytes = operands.payload_nbytes(k0, v0, scope, ps)
    pays = operands.empty_payloads(layers, nbytes, DEVICE)
    amax = vllm_triton.gather_encode_layers(
        views, ids, num_tokens=t, head_size=d, scope=scope, page_size=ps, payloads=pays
    )
    assert tuple(amax.shape) == (layers, *kvcodec.numerics.scale_shape(scope, t, h, ps))
    for i, view in enumerate(views):
        k, v = gather_ref(view, ids, t, d)
        assert payload_bytes(pays[i]) == ref_payload(k, v, scope, ps), f"layer {i}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_encode_every_layout(layout: str) -> None:
    """Block size 16, a partial last block (40 tokens), shuffled ids, layers sharing one allocation."""
    encode_case(layout, torch.float16, PH, 16, bs=16, t=40)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "scope,ps", [(PT, None), (LH, None), (PH, 5)], ids=["per_tensor", "per_layer_head", "per_page_head5"]
)
def test_encode_scopes_dtypes_block48(dtype: torch.dtype, scope: ScaleScope, ps: int | None) -> None:
    """Block size 48 (not a power of two) with 100 tokens: 2 full blocks and 4 tokens; pages cross blocks."""
    encode_case("BHLNC", dtype, scope, ps, bs=48, t=100, seed=3)


def test_encode_fp32_cache_and_e5m2() -> None:
    d, t, bs = 16, 20, 16
    views = vllm_views("LBNHC", 2, 4, 2, bs, 2 * d, torch.float32, seed=5)
    ids = [3, 0]
    k0, v0 = gather_ref(views[0], ids, t, d)
    pays = operands.empty_payloads(2, operands.payload_nbytes(k0, v0, LH), DEVICE)
    vllm_triton.gather_encode_layers(
        views, ids, num_tokens=t, head_size=d, scope=LH, payloads=pays, fp8_dtype=torch.float8_e5m2
    )
    for i in range(2):
        k, v = gather_ref(views[i], ids, t, d)
        blob = ref_blob(k, v, LH, None, v_dtype=torch.float8_e5m2, allow_e5m2=True)
        assert payload_bytes(pays[i]) == blob[kvcodec.parse(blob).header_len :]


def test_separate_allocations_and_kernel_blocks() -> None:
    """Layers in separate, unevenly spaced tensors (a layer offset table); scheduler blocks of 2 view blocks."""
    d, h, bs, t = 16, 2, 8, 30
    a = vllm_views("LBNHC", 1, 8, h, bs, 2 * d, torch.float16, seed=7)[0]
    b = vllm_views("LBNHC", 1, 8, h, bs, 2 * d, torch.float16, seed=8)[0]
    views = [a, b]
    sched = [2, 0]  # scheduler blocks of 16 tokens = view blocks (4, 5) and (0, 1)
    view_ids = [4, 5, 0, 1]
    k0, v0 = gather_ref(a, view_ids, t, d)
    pays = operands.empty_payloads(2, operands.payload_nbytes(k0, v0, PH, 4), DEVICE)
    vllm_triton.gather_encode_layers(
        views, sched, num_tokens=t, head_size=d, scope=PH, page_size=4, payloads=pays, block_size=16
    )
    for i, view in enumerate(views):
        k, v = gather_ref(view, view_ids, t, d)
        assert payload_bytes(pays[i]) == ref_payload(k, v, PH, 4)


def decode_case(
    layout: str,
    dtype: torch.dtype,
    scope: ScaleScope,
    ps: int | None,
    *,
    bs: int,
    t: int,
    layers: int = 2,
    h: int = 2,
    d: int = 16,
) -> None:
    nb = -(-t // bs) + 2
    src = vllm_views("LBNHC", layers, nb, h, bs, 2 * d, dtype, seed=11)
    src_ids = list(range(-(-t // bs)))
    blobs = [ref_blob(*gather_ref(s, src_ids, t, d), scope, ps) for s in src]
    hl = kvcodec.parse(blobs[0]).header_len
    pays = torch.stack([torch.frombuffer(bytearray(b[hl:]), dtype=torch.uint8) for b in blobs]).to(DEVICE)
    dst = vllm_views(layout, layers, nb, h, bs, 2 * d, dtype, seed=12)
    before = [x.clone() for x in dst]
    ids = shuffled(-(-t // bs), nb, seed=13)
    vllm_triton.decode_scatter_layers(pays, dst, ids, num_tokens=t, head_size=d, scope=scope, page_size=ps)
    for i in range(layers):
        want = before[i].clone()
        dec = kvcodec.decode(blobs[i], out_v_dtype=dtype)
        tok = torch.arange(t)
        blk = torch.tensor(ids)[tok // bs].to(DEVICE)
        slot = (tok % bs).to(DEVICE)
        want[blk, :, slot, :d] = dec.k.to(DEVICE)
        want[blk, :, slot, d:] = dec.v.to(DEVICE)
        assert payload_bytes(dst[i].contiguous().view(torch.uint8)) == payload_bytes(want.view(torch.uint8))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_every_layout(layout: str) -> None:
    decode_case(layout, torch.float16, PH, 16, bs=16, t=40)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "scope,ps", [(PT, None), (LH, None), (PH, 5)], ids=["per_tensor", "per_layer_head", "ph5"]
)
def test_decode_scopes_dtypes_block48(dtype: torch.dtype, scope: ScaleScope, ps: int | None) -> None:
    decode_case("BLNHC", dtype, scope, ps, bs=48, t=100)


def _as_planned_for_cuda(fn: object) -> list[object]:
    """Run ``fn``'s launches as planned for an sm_80-class CUDA GPU (132 SMs), executed here."""
    from kvcodec.kernels import launch

    with launch.recording(launch.Target(False, 132, (8, 0), "planned sm_80")) as launches:
        fn()  # type: ignore[operator]
    for ln in launches:
        launch.launch(ln.kernel, ln.grid, ln.kwargs)
    return launches  # type: ignore[return-value]


@pytest.mark.skipif(DEVICE == "cuda", reason="replays CUDA planning in the interpreter")
@pytest.mark.parametrize("scope,ps", [(PT, None), (PH, 16)], ids=["per_tensor", "per_page_head"])
def test_cuda_planning_replayed(scope: ScaleScope, ps: int | None) -> None:
    """CUDA's branches: aligned K, several warps, CUDA tiles, two stages over several stage-1 tiles, layer tables."""
    d, h, bs, t, layers = 64, 2, 16, 40, 3
    buf = torch.zeros(layers * 8 * h * bs * 2 * d + 64 * layers, dtype=torch.float16)
    n = 8 * h * bs * 2 * d
    src = vllm_views("LBNHC", layers, 8, h, bs, 2 * d, torch.float16, seed=21)
    views = []
    for i in range(layers):  # 16-byte aligned, unevenly spaced: an aligned offset table
        x = buf[i * (n + 8 * (i + 1)) :][:n].view(8, bs, h, 2 * d).permute(0, 2, 1, 3)
        x.copy_(src[i])
        views.append(x)
    ids = [5, 2, 7]
    k0, v0 = gather_ref(views[0], ids, t, d)
    pays = operands.empty_payloads(layers, operands.payload_nbytes(k0, v0, scope, ps), DEVICE)
    launches = _as_planned_for_cuda(
        lambda: vllm_triton.gather_encode_layers(
            views, ids, num_tokens=t, head_size=d, scope=scope, page_size=ps, payloads=pays
        )
    )
    kw = launches[0].kwargs  # type: ignore[attr-defined]
    assert kw["K_ALIGNED"] and kw["num_warps"] > 1 and kw["PAGED"]
    assert kw["K_TAB"] == 8 and kw["V_TAB"] == 8
    if scope == PT:
        assert len(launches) == 2 and kw["TT"] == 16 < t
    for i in range(layers):
        assert payload_bytes(pays[i]) == ref_payload(*gather_ref(views[i], ids, t, d), scope, ps)
    # Unevenly spaced in one buffer, as the sources: separate allocations may land evenly spaced (a
    # stride, no table) or not, as the allocator has it.
    out = torch.zeros_like(buf)
    dst = [out[i * (n + 8 * (i + 1)) :][:n].view(8, bs, h, 2 * d).permute(0, 2, 1, 3) for i in range(layers)]
    dec = _as_planned_for_cuda(
        lambda: vllm_triton.decode_scatter_layers(
            pays, dst, ids, num_tokens=t, head_size=d, scope=scope, page_size=ps
        )
    )
    kw = dec[0].kwargs  # type: ignore[attr-defined]
    assert kw["K_ALIGNED"] and kw["num_warps"] > 1 and kw["PAGED"] and kw["VO_TAB"] == 8
    for i in range(layers):
        blob = ref_blob(*gather_ref(views[i], ids, t, d), scope, ps)
        dk = kvcodec.decode(blob, out_v_dtype=torch.float16)
        k, v = gather_ref(dst[i], ids, t, d)
        assert torch.equal(k.cpu(), dk.k) and payload_bytes(v) == payload_bytes(dk.v)


@pytest.mark.parametrize("version", [1, 2])
def test_chunk_encoder_blobs_equal_encode(version: int) -> None:
    """One launch, copy into the host buffer, 32-layer-style header packing: blobs equal kvcodec.encode's."""
    d, h, bs, t, layers = 16, 2, 16, 24, 3
    views = vllm_views("BLHNC", layers, 4, h, bs, 2 * d, torch.bfloat16, seed=31)
    hashes = {"model_id": "tiny", "kv_layout": "BLHNC"}
    enc = ChunkEncoder(
        views, head_size=d, scope=PH, page_size=16, version=version, hashes=hashes, layer_ids=[4, 5, 6]
    )
    out = enc.host_buffer(t)
    assert out.shape[1] % 16 == 0 and enc.geometry(t)[1].payload_offset % 16 == 0
    ids = [2, 0]
    blobs = enc.launch(ids, num_tokens=t, chunk_id=9, out=out).wait()
    for i, b in enumerate(blobs):
        k, v = gather_ref(views[i], ids, t, d)
        want = ref_blob(k, v, PH, 16, version=version, layer_id=4 + i, chunk_id=9, hashes=hashes)
        assert bytes(b) == want


def test_chunk_encoder_refuses_nan() -> None:
    d, h, bs, t = 16, 2, 16, 16
    views = vllm_views("LBNHC", 2, 2, h, bs, 2 * d, torch.float16, seed=41)
    views[1][1, 1, 3, d + 2] = float("nan")
    enc = ChunkEncoder(views, head_size=d, scope=LH)
    with pytest.raises(UnsupportedConfigError, match=r"layer 1.*NaN"):
        enc.launch([1], num_tokens=t, chunk_id=0, out=enc.host_buffer(t)).wait()


def test_validation() -> None:
    d = 16
    views = vllm_views("LBNHC", 2, 4, 2, 16, 2 * d, torch.float16)
    pays = operands.empty_payloads(2, 4096, DEVICE)
    kw = {"num_tokens": 16, "scope": PH, "page_size": 16}
    with pytest.raises(UnsupportedConfigError, match="head_size == head_size_v"):
        vllm_triton.gather_encode_layers(views, [0], head_size=12, payloads=pays, **kw)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedConfigError, match="FP8 cache"):
        vllm_triton.prepare_views([torch.zeros(4, 2, 16, 2 * d, dtype=torch.uint8, device=DEVICE)], d)
    with pytest.raises(UnsupportedConfigError, match="block-aligned"):
        vllm_triton.gather_encode_layers(views, [0, 1], head_size=d, payloads=pays, start=8, **kw)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedConfigError, match="exactly"):
        vllm_triton.gather_encode_layers(views, [0], head_size=d, payloads=pays, **kw)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedConfigError, match="repeat"):
        vllm_triton.decode_scatter_layers(pays, views, [1, 1], head_size=d, **{**kw, "num_tokens": 32})  # type: ignore[arg-type]
    with pytest.raises(UnsupportedConfigError, match="span"):
        vllm_triton.gather_encode_layers(views, [4], head_size=d, payloads=pays, **kw)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedConfigError, match="share shape"):
        vllm_triton.prepare_views([views[0], views[1][:3]], d)


def test_start_and_tensor_ids() -> None:
    """A later chunk of a request (``start`` = one block in) with the request's block table as a tensor."""
    d, h, bs, t = 16, 2, 16, 20
    views = vllm_views("LHBNC", 2, 6, h, bs, 2 * d, torch.float16, seed=51)
    table = torch.tensor([4, 1, 5, 0])
    chunk_ids = [1, 5]
    k0, v0 = gather_ref(views[0], chunk_ids, t, d)
    pays = operands.empty_payloads(2, operands.payload_nbytes(k0, v0, LH), DEVICE)
    vllm_triton.gather_encode_layers(
        views, table, num_tokens=t, head_size=d, scope=LH, payloads=pays, start=bs
    )
    for i in range(2):
        assert payload_bytes(pays[i]) == ref_payload(*gather_ref(views[i], chunk_ids, t, d), LH, None)
    dst = [torch.zeros_like(x) for x in views]
    vllm_triton.decode_scatter_layers(
        pays, vllm_triton.prepare_views(dst, d), table, num_tokens=t, head_size=d, scope=LH, start=bs
    )
    for i in range(2):
        blob = ref_blob(*gather_ref(views[i], chunk_ids, t, d), LH, None)
        dk = kvcodec.decode(blob, out_v_dtype=torch.float16)
        k, v = gather_ref(dst[i], chunk_ids, t, d)
        assert torch.equal(k.cpu(), dk.k) and payload_bytes(v) == payload_bytes(dk.v)
        assert not dst[i][[4, 0, 2, 3]].any()  # blocks outside the chunk untouched
