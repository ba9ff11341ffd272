"""The vLLM connector's asynchronous fused save and load, as ``KvcodecConnector`` drives them.

Save: ``_save_job`` takes a caller-owned host buffer (``FusedLayers.host_buffer``,
pinned on CUDA), ``_launch_fused`` orders a side stream after the forward,
calls ``FusedLayers.launch(..., out=buf, stream=side)`` and orders the next
forward after the side stream; the writer thread later calls the pending
chunk's ``wait()`` and writes the blobs. Load: the loader thread checks every
blob once parsed (``FusedLayers.prepare``), the step thread writes them
(``FusedLayers.load``). The connector imports vLLM, which this venv lacks, so
:func:`_launch_like_connector` repeats ``_launch_fused``'s three calls.

Without a GPU the kernels run in Triton's interpreter, where the launch is
synchronous (no stream, no event): those tests check what exists, and the
CUDA-only ordering test is skipped.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.kernels.conftest import CUDA as _CUDA
from tests.kernels.conftest import DEVICE, KERNEL_MARKS, require_kernels

require_kernels()

from kvcodec import CodecMismatchError, UnsupportedConfigError, parse  # noqa: E402
from kvcodec.integrations.vllm.chunks import ChunkCodec, encode_chunk  # noqa: E402
from kvcodec.integrations.vllm.fused import FusedLayers  # noqa: E402
from tests.integrations.vllm.loading import ChunkLoad, load_layers  # noqa: E402

MODE = "auto" if _CUDA else "on"
pytestmark = KERNEL_MARKS

HASHES = {"model_id": "tiny", "kv_layout": "vllm-token-major;test"}
H, D, BS, NB, L, CS = 2, 8, 4, 9, 2, 8
TABLE = [7, 2, 5, 0, 3, 8]
"""Shuffled block ids: chunk c of 8 tokens is blocks TABLE[2c], TABLE[2c + 1]."""
CHUNK_HASHES = ["0123456789abcdef" * 2, "fedcba9876543210" * 2, "00ff" * 8]
"""32-hex prefix hashes, one per chunk, as the connector binds them into its blobs."""
SENTINEL = 0xA5


def _phys(layout: str, *, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    size = {"L": L, "B": NB, "N": BS, "H": H, "C": 2 * D}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn([size[a] for a in layout], generator=g) * 3
    x[..., 1] *= 40
    return x.to(dtype).to(DEVICE)


def _views(phys: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    rest = layout.replace("L", "")
    return {
        f"model.layers.{i}.self_attn.attn": phys.select(layout.index("L"), i).permute(
            [rest.index(a) for a in "BHNC"]
        )
        for i in range(L)
    }


def _ids(caches: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: int(n.split(".")[2]) for n in caches}


def _codec(scope: str = "per_page_head", **kw: Any) -> ChunkCodec:
    return ChunkCodec(
        **{"head_size": D, "block_size": BS, "scope": scope, "page_size": 4, "hashes": HASHES, **kw}
    )


def _fused(caches: dict[str, torch.Tensor], cc: ChunkCodec) -> FusedLayers:
    fused, why = FusedLayers.build(caches, _ids(caches), cc, MODE)
    assert fused is not None, why
    return fused


def _per_layer_blobs(caches: dict[str, torch.Tensor], cc: ChunkCodec, chunk: int, h: str) -> dict[str, bytes]:
    ids = _ids(caches)
    return {
        n: bytes(
            encode_chunk(
                v, TABLE, cc, start=chunk * CS, num_tokens=CS, layer_id=ids[n], chunk_id=chunk, chunk_hash=h
            )
        )
        for n, v in caches.items()
    }


def _launch_like_connector(fused: FusedLayers, chunk: int, h: str, buf: torch.Tensor, side: Any) -> Any:
    """``KvcodecConnector._launch_fused``: the side stream after the forward, the next forward after it."""
    if side is None:
        return fused.launch(TABLE, chunk, CS, h, out=buf)
    side.wait_stream(torch.cuda.current_stream(side.device))
    pending = fused.launch(TABLE, chunk, CS, h, out=buf, stream=side)
    torch.cuda.current_stream(side.device).wait_stream(side)
    return pending


def _side_stream(fused: FusedLayers) -> Any:
    """As ``_build_fused``: a side stream on CUDA caches, none otherwise."""
    return torch.cuda.Stream(fused.device) if fused.device.type == "cuda" else None


def _inside(blob: memoryview, buf: torch.Tensor) -> bool:
    at = np.frombuffer(blob, dtype=np.uint8).__array_interface__["data"][0]
    return buf.data_ptr() <= at and at + len(blob) <= buf.data_ptr() + buf.numel()


# ----------------------------------------------------------------------------
# Saves: the async blobs are the synchronous fused save's and the per-layer path's
# ----------------------------------------------------------------------------


CASES = [
    ("LBNHC", "per_page_head", 2),
    ("BHLNC", "per_tensor", 1),
    ("LHBNC", "per_layer_head", 2),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout,scope,version", CASES, ids=[f"{a}-{b}" for a, b, _ in CASES])
def test_async_save_equals_sync_and_per_layer(
    layout: str, scope: str, version: int, dtype: torch.dtype
) -> None:
    caches = _views(_phys(layout, dtype=dtype, seed=3), layout)
    cc = _codec(scope, version=version)
    fused = _fused(caches, cc)
    h = CHUNK_HASHES[1]
    buf = fused.host_buffer(CS)  # the connector's: bound (prefix hash), pinned on CUDA
    assert buf.is_pinned() == (fused.device.type == "cuda")
    pending = _launch_like_connector(fused, 1, h, buf, _side_stream(fused))
    blobs = list(zip(fused.names, pending.wait()))  # the writer thread's ``blobs()``
    assert all(_inside(b, buf) for _, b in blobs)  # views of the caller's buffer, no copy
    got = {n: bytes(b) for n, b in blobs}
    sync = {n: bytes(b) for n, b in _fused(caches, cc).save(TABLE, 1, CS, h)}
    assert got == sync
    assert got == _per_layer_blobs(caches, cc, 1, h)


def test_unbound_chunk_into_a_caller_buffer() -> None:
    """No prefix hash: the unbound geometry's buffer, the same bytes as the per-layer path."""
    caches = _views(_phys("BLHNC", dtype=torch.bfloat16, seed=5), "BLHNC")
    cc = _codec()
    fused = _fused(caches, cc)
    buf = fused.host_buffer(CS, bound=False)
    got = {n: bytes(b) for n, b in zip(fused.names, _launch_like_connector(fused, 0, "", buf, None).wait())}
    assert got == _per_layer_blobs(caches, cc, 0, "")


def test_chunks_in_flight_in_their_own_buffers_and_a_reused_one() -> None:
    """Two chunks launched before either is waited on (waited in reverse order), then a released
    buffer reused for a third, as the connector's ``_host_bufs`` pool does: every blob is right."""
    caches = _views(_phys("LBNHC", dtype=torch.float16, seed=7), "LBNHC")
    cc = _codec()
    fused = _fused(caches, cc)
    side = _side_stream(fused)
    bufs = [fused.host_buffer(CS), fused.host_buffer(CS)]
    p0 = _launch_like_connector(fused, 0, CHUNK_HASHES[0], bufs[0], side)
    p1 = _launch_like_connector(fused, 1, CHUNK_HASHES[1], bufs[1], side)
    got1 = [bytes(b) for b in p1.wait()]
    got0 = [bytes(b) for b in p0.wait()]
    p2 = _launch_like_connector(fused, 2, CHUNK_HASHES[2], bufs[0], side)
    got2 = [bytes(b) for b in p2.wait()]
    for chunk, got in enumerate((got0, got1, got2)):
        ref = _per_layer_blobs(caches, cc, chunk, CHUNK_HASHES[chunk])
        assert got == [ref[n] for n in fused.names], chunk


def test_nan_is_refused_at_wait_not_at_launch() -> None:
    """The launch (step thread) never raises for the data; the writer's ``wait()`` refuses NaN in V
    with the per-layer path's error, naming the layer (the connector counts it as a save error)."""
    caches = _views(_phys("LBNHC", dtype=torch.float16, seed=1), "LBNHC")
    name1 = "model.layers.1.self_attn.attn"
    caches[name1][5, 1, 2, D + 3] = float("nan")  # V of layer 1, chunk 1
    fused = _fused(caches, _codec())
    pending = _launch_like_connector(fused, 1, CHUNK_HASHES[1], fused.host_buffer(CS), _side_stream(fused))
    with pytest.raises(UnsupportedConfigError, match="layer 1"):
        pending.wait()


def test_bad_buffers_and_hashes_refused_at_launch() -> None:
    caches = _views(_phys("LBNHC", dtype=torch.float16), "LBNHC")
    fused = _fused(caches, _codec())
    good = fused.host_buffer(CS)
    with pytest.raises(UnsupportedConfigError, match="out must be"):
        fused.launch(TABLE, 1, CS, CHUNK_HASHES[1], out=good[:, :-16])
    with pytest.raises(UnsupportedConfigError, match="out must be"):
        fused.launch(TABLE, 1, CS, CHUNK_HASHES[1], out=good.view(torch.int8))
    with pytest.raises(UnsupportedConfigError, match="chunk_hash must be"):
        fused.launch(TABLE, 1, CS, "abc", out=good)


# ----------------------------------------------------------------------------
# Ordering: the host buffer is read only once its bytes are there
# ----------------------------------------------------------------------------


@pytest.mark.skipif(_CUDA, reason="the interpreter's synchronous path (CUDA runs the stream test)")
def test_interpreter_launch_is_synchronous_and_headers_wait_for_wait() -> None:
    """In the interpreter the kernels write ``out`` itself: no event, no stream (one is refused);
    the payloads are there after the launch, the headers are packed only by ``wait()``."""
    caches = _views(_phys("LBNHC", dtype=torch.bfloat16, seed=2), "LBNHC")
    cc = _codec()
    fused = _fused(caches, cc)
    buf = fused.host_buffer(CS)
    buf.fill_(SENTINEL)
    with pytest.raises(UnsupportedConfigError, match="stream needs CUDA"):
        fused.launch(TABLE, 1, CS, CHUNK_HASHES[1], out=buf, stream=object())
    pending = fused.launch(TABLE, 1, CS, CHUNK_HASHES[1], out=buf)
    assert pending.event is None and pending.host is buf
    ref = _per_layer_blobs(caches, cc, 1, CHUNK_HASHES[1])
    g = pending.geom
    rows = buf.numpy()
    for j, name in enumerate(fused.names):
        blob = rows[j, g.offset : g.offset + g.blob_len]
        assert bytes(blob[g.header_len :]) == ref[name][g.header_len :]  # payload: written by the launch
        assert (blob[: g.header_len] == SENTINEL).all()  # header: not yet
    assert [bytes(b) for b in pending.wait()] == [ref[n] for n in fused.names]


@pytest.mark.skipif(not _CUDA, reason="needs CUDA: the side stream and its event")
def test_cuda_side_stream_event_guards_the_host_buffer() -> None:
    """The forward's stream is held busy; the side stream, ordered after it, has not copied into the
    pinned buffer (it still holds the sentinel) and the chunk's event has not fired; ``wait()`` waits
    for the event and returns the right blobs; the next forward's stream is ordered after the side."""
    caches = _views(_phys("LBNHC", dtype=torch.float16, seed=4), "LBNHC")
    cc = _codec()
    fused = _fused(caches, cc)
    side = _side_stream(fused)
    h = CHUNK_HASHES[1]
    ref = _per_layer_blobs(caches, cc, 1, h)
    _launch_like_connector(fused, 1, h, fused.host_buffer(CS), side).wait()  # compile, warm the allocators
    buf = fused.host_buffer(CS)
    buf.fill_(SENTINEL)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # the "forward", on the current stream (about a second)
    pending = _launch_like_connector(fused, 1, h, buf, side)
    assert isinstance(pending.event, torch.cuda.Event)
    assert not pending.event.query()
    assert bool((buf == SENTINEL).all())
    assert [bytes(b) for b in pending.wait()] == [ref[n] for n in fused.names]
    assert pending.event.query()
    nxt = _launch_like_connector(fused, 2, CHUNK_HASHES[2], fused.host_buffer(CS), side)
    torch.cuda.current_stream().synchronize()  # the next forward's stream waited for the side stream
    assert nxt.event.query()


# ----------------------------------------------------------------------------
# Loads: check on the loader thread, then load_layers on the step thread
# ----------------------------------------------------------------------------


def _load_like_connector(
    fused: FusedLayers,
    caches: dict[str, torch.Tensor],
    cc: ChunkCodec,
    blobs: dict[str, bytes],
    req: ChunkLoad,
) -> bool:
    """The load handler's path: each blob parsed once, every layer checked against hash and ids by
    ``FusedLayers.prepare`` (the loader thread), then ``FusedLayers.load`` (the step)."""
    return load_layers(blobs, caches, lambda _: cc, req, fused)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("layout,scope", [("LBNHC", "per_page_head"), ("BHLNC", "per_tensor")])
def test_async_load_equals_sync_and_per_layer(layout: str, scope: str, dtype: torch.dtype) -> None:
    """Two chunks loaded one after the other (on CUDA the second refills the pinned payload buffer
    after the first's upload): the cache bytes equal the synchronous fused load's and the per-layer
    path's, and a block-aligned partial chunk too."""
    cc = _codec(scope)
    src = _views(_phys(layout, dtype=dtype, seed=1), layout)
    blobs = {c: _per_layer_blobs(src, cc, c, CHUNK_HASHES[c]) for c in (0, 1, 2)}
    reqs = [ChunkLoad(TABLE, c, CS, 0, CHUNK_HASHES[c], _ids(src)) for c in (0, 1)]
    reqs.append(ChunkLoad(TABLE, 2, CS, 4, CHUNK_HASHES[2], _ids(src)))
    orig = _phys(layout, dtype=dtype, seed=9)
    a, s, p = orig.clone(), orig.clone(), orig.clone()
    ca, cs_, cp = _views(a, layout), _views(s, layout), _views(p, layout)
    fa, fs = _fused(ca, cc), _fused(cs_, cc)
    for req in reqs:
        assert _load_like_connector(fa, ca, cc, blobs[req.chunk], req)
        parsed = {n: parse(b) for n, b in blobs[req.chunk].items()}
        fc = fs.prepare(parsed, req.chunk, CS, req.skip, req.chunk_hash)
        assert fc is not None
        fs.load(fc, req.block_ids)
        assert not load_layers(blobs[req.chunk], cp, lambda _: cc, req, None)
    raw = [bytes(x.cpu().contiguous().view(torch.uint8).numpy()) for x in (orig, a, s, p)]
    assert raw[1] == raw[2] == raw[3]
    assert raw[1] != raw[0]


def test_async_load_check_refuses_a_blob_of_another_prefix() -> None:
    """The loader's check binds the chunk hash: chunk 1's blobs under chunk 0's hash are refused
    before anything is written."""
    cc = _codec()
    src = _views(_phys("LBNHC", dtype=torch.float16, seed=1), "LBNHC")
    blobs = _per_layer_blobs(src, cc, 1, CHUNK_HASHES[1])
    dst = _phys("LBNHC", dtype=torch.float16, seed=9)
    before = dst.clone()
    cd = _views(dst, "LBNHC")
    with pytest.raises(CodecMismatchError):
        _load_like_connector(_fused(cd, cc), cd, cc, blobs, ChunkLoad(TABLE, 1, CS, 0, CHUNK_HASHES[0]))
    assert torch.equal(dst, before)
