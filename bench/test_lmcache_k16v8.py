"""kvcodec beside LMCache 0.5.6's own K16/V8 serde (``lmcache/v1/distributed/serde/asym_k16_v8.py``).

The fair comparison: both keep K at 16 bits and put V in FP8 e4m3. LMCache's serde (not registered for
config in 0.5.6) wraps its ``AsymK16V8Codec`` with per-tensor scales; kvcodec is measured at its default
(``per_page_head``, 16-token pages) and at ``per_tensor``. One layer of 2048 tokens x 8 KV heads x 128,
fp16 and bf16, V in two profiles (:data:`V_PROFILES`), each side writing into a caller's buffer and
reading back into a caller's K and V, as a storage tier does:

* ``stored``: bytes per layer / raw K+V bytes;
* V's error: SQNR (dB) over the layer, and over its worst head without the first token (the quietest
  head's ordinary tokens suffer most from one scale for the whole tensor);
* serialize / deserialize: median wall ms per call, interleaved in one run (bench/_ratio.py).

``make bench-k16v8`` (needs LMCache: ``make lmcache-full``). A benchmark, not a test: skipped without
LMCache, nothing asserted about speed.
"""

from __future__ import annotations

import pytest
import torch
from _ratio import interleaved, ratio_info

from kvcodec.codec import decode, encode, encoded_size

serde = pytest.importorskip(
    "lmcache.v1.distributed.serde.asym_k16_v8",
    reason="LMCache 0.5.6 distributed storage not installed (make lmcache-full)",
)
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj  # noqa: E402

TOKENS, HEADS, DIM, PAGE = 2048, 8, 128, 16
KV_BYTES = 2 * TOKENS * HEADS * DIM * 2
KVCODEC_SCOPES = ("per_page_head", "per_tensor")


def _obj(tensor: torch.Tensor) -> TensorMemoryObj:
    """``tensor``'s bytes as an LMCache memory object (its own storage, as LMCache's allocator gives)."""
    raw = torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8)
    size = tensor.shape
    meta = MemoryObjMetadata(
        shape=size,
        dtype=tensor.dtype,
        address=0,
        phy_size=raw.numel(),
        ref_count=1,
        shapes=[size],
        dtypes=[tensor.dtype],
    )
    obj = TensorMemoryObj(raw, meta, None)
    obj.tensor.copy_(tensor)
    return obj


V_PROFILES = ("head_spread", "sink_token")
"""``head_spread``: each KV head at its own magnitude, 0.5 to 50 (FP8 is a float: one scale for all
loses nothing while every head stays in its normal range); ``sink_token``: the same plus one token
(an attention sink) 200x the rest in every head, which sets a per-tensor scale that pushes the other
tokens towards e4m3's subnormals."""


def _layer(dtype: torch.dtype, profile: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(TOKENS, HEADS, DIM, generator=g).to(dtype)
    head_scale = torch.logspace(-0.3, 1.7, HEADS).view(1, HEADS, 1)  # 0.5 .. 50
    v = torch.randn(TOKENS, HEADS, DIM, generator=g) * head_scale
    if profile == "sink_token":
        v[0] *= 200  # still finite in fp16 (|v| < 65504)
    return k, v.to(dtype)


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    ref, got = ref.float(), got.float()
    sig = ref.pow(2).sum(dims) if dims else ref.pow(2).sum()
    err = (got - ref).pow(2).sum(dims) if dims else (got - ref).pow(2).sum()
    return 10 * torch.log10(sig / err.clamp_min(1e-30))


class _Lmcache:
    """LMCache's serde: (K, V) objects -> one buffer -> (K, V) objects."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.ser = serde.AsymK16V8MultiSerializer()
        self.des = serde.AsymK16V8MultiDeserializer()
        self.src = (_obj(k), _obj(v))
        n = KV_BYTES + 4096
        self.buf = _obj(torch.zeros(n, dtype=torch.uint8))
        self.out = (_obj(torch.zeros_like(k)), _obj(torch.zeros_like(v)))
        self.stored = self.serialize()

    def serialize(self) -> int:
        return self.ser.serialize(self.src, self.buf, None)

    def deserialize(self) -> None:
        view = _obj(self.buf.tensor[: self.stored].clone())
        self.des.deserialize(view, self.out, None)

    def v_out(self) -> torch.Tensor:
        return self.out[1].tensor


class _Kvcodec:
    """kvcodec: K, V -> a caller's buffer (``encode(out=)``) -> a caller's K and V (``decode(out_k=, out_v=)``)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, scope: str) -> None:
        self.k, self.v = k, v
        self.opts = dict(scope=scope, page_size=PAGE)
        self.buf = bytearray(encoded_size(k, v, **self.opts))
        self.out_k, self.out_v = torch.empty_like(k), torch.empty_like(v)
        self.stored = len(self.serialize())

    def serialize(self) -> memoryview:
        return encode(self.k, self.v, out=self.buf, **self.opts)

    def deserialize(self) -> None:
        decode(self.buf, out_k=self.out_k, out_v=self.out_v)

    def v_out(self) -> torch.Tensor:
        return self.out_v


@pytest.mark.parametrize("profile", V_PROFILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kvcodec_beside_lmcache_k16v8(benchmark, dtype: torch.dtype, profile: str) -> None:
    k, v = _layer(dtype, profile)
    sides = {"lmcache_k16v8": _Lmcache(k, v)}
    sides.update({f"kvcodec_{s}": _Kvcodec(k, v, s) for s in KVCODEC_SCOPES})
    info: dict[str, float | bool] = {}
    for name, side in sides.items():
        side.deserialize()
        info[f"{name}_stored_ratio"] = round(side.stored / KV_BYTES, 4)
        info[f"{name}_v_sqnr_db"] = round(float(_sqnr_db(v, side.v_out())), 2)
        rest = _sqnr_db(v[1:], side.v_out()[1:], (0, 2))  # every token but the first (a sink in one profile)
        info[f"{name}_v_worst_head_sqnr_db"] = round(float(rest.min()), 2)
    assert torch.equal(sides["kvcodec_per_page_head"].out_k, k)  # K bit-exact (the claim both make)
    assert torch.equal(sides["lmcache_k16v8"].out[0].tensor, k)
    ser = interleaved({name: side.serialize for name, side in sides.items()})
    des = interleaved({name: side.deserialize for name, side in sides.items()})
    info.update({f"serialize_{k_}": v_ for k_, v_ in ratio_info(ser, "lmcache_k16v8", KV_BYTES).items()})
    info.update({f"deserialize_{k_}": v_ for k_, v_ in ratio_info(des, "lmcache_k16v8", KV_BYTES).items()})
    benchmark.extra_info.update(info)
    benchmark(sides["kvcodec_per_page_head"].serialize)
    for key in sorted(info):
        print(f"{dtype} {profile} {key}: {info[key]}")
