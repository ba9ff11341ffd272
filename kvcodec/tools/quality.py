"""How much V loses in FP8, per scope, on data shaped like real KV caches.

Metrics: SQNR in dB, max and median relative error (over elements whose
magnitude is at least 1% of the group's absmax, so tiny values don't dominate),
and the relative error of attention outputs ``softmax(QKᵀ/√d)·V̂`` vs ``·V``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..codec import decode, encode
from ..format import COMPUTED_SCOPES, SCOPE_NAMES

__all__ = [
    "QualityRow",
    "attention_error",
    "format_table",
    "make_v",
    "quality_report",
    "sqnr_db",
    "v_metrics",
]

DISTRIBUTIONS = ("gaussian", "student_t3", "outlier_channels")
SCOPES = tuple(name for name, scope in SCOPE_NAMES.items() if scope in COMPUTED_SCOPES)
"""The scopes measured: those whose scales encode computes from V."""


@dataclass(frozen=True)
class QualityRow:
    """One (distribution, scope) measurement."""

    distribution: str
    scope: str
    sqnr_db: float
    max_rel_err: float
    median_rel_err: float
    attn_rel_err: float

    def as_dict(self) -> dict[str, float | str]:
        """Plain values (for JSON)."""
        return asdict(self)


def make_v(dist: str, tokens: int, heads: int, dim: int, *, seed: int = 0) -> torch.Tensor:
    """Synthetic V ``[tokens, heads, dim]`` in fp32.

    ``gaussian``: N(0, 1) with per-head scale spread over 2 decades.
    ``student_t3``: heavy tails (ν=3). ``outlier_channels``: Gaussian with a
    few channels and a few pages 30-100x larger, like real caches' outliers.
    """
    g = torch.Generator().manual_seed(seed)
    head_scale = torch.logspace(-1, 1, heads).view(1, heads, 1)
    if dist == "gaussian":
        v = torch.randn(tokens, heads, dim, generator=g)
    elif dist == "student_t3":
        z = torch.randn(tokens, heads, dim, generator=g)
        chi2 = torch.randn(3, tokens, heads, dim, generator=g).pow(2).sum(0)
        v = z / torch.sqrt(chi2 / 3)
    elif dist == "outlier_channels":
        v = torch.randn(tokens, heads, dim, generator=g)
        ch = torch.randperm(dim, generator=g)[: max(1, dim // 32)]
        v[:, :, ch] *= 30.0
        if tokens >= 32:
            v[tokens // 3 : tokens // 3 + 16] *= 100.0
    else:
        raise ValueError(f"unknown distribution {dist!r}; expected one of {DISTRIBUTIONS}")
    return v * head_scale


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio, 10·log10(Σref² / Σ(ref-approx)²)."""
    r = ref.double()
    noise = (r - approx.double()).pow(2).sum().item()
    sig = r.pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(sig / noise)


def v_metrics(ref: torch.Tensor, approx: torch.Tensor) -> tuple[float, float, float]:
    """(SQNR dB, max relative error, median relative error)."""
    r, a = ref.double(), approx.double()
    big = r.abs() >= 0.01 * r.abs().amax(dim=(0, 2), keepdim=True)
    rel = ((r - a).abs() / r.abs().clamp_min(1e-30))[big]
    if rel.numel() == 0:
        return sqnr_db(ref, approx), 0.0, 0.0
    return sqnr_db(ref, approx), rel.max().item(), rel.median().item()


def attention_error(v: torch.Tensor, v_hat: torch.Tensor, *, queries: int = 16, seed: int = 1) -> float:
    """Relative L2 error of softmax(QKᵀ/√d)·V̂ against ·V, with random Q and K, per head."""
    t, h, d = v.shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(h, queries, d, generator=g, dtype=torch.float64)
    k = torch.randn(h, t, d, generator=g, dtype=torch.float64)
    p = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d), dim=-1)
    o = p @ v.double().transpose(0, 1)
    o_hat = p @ v_hat.double().transpose(0, 1)
    return ((o - o_hat).norm() / o.norm().clamp_min(1e-30)).item()


def quality_report(
    *, tokens: int = 1024, heads: int = 8, dim: int = 128, page_size: int = 16, seed: int = 0
) -> list[QualityRow]:
    """Encode/decode V for every distribution and scope and measure the error."""
    rows = []
    for dist in DISTRIBUTIONS:
        v = make_v(dist, tokens, heads, dim, seed=seed)
        for scope in SCOPES:
            blob = encode(None, v, scope=scope, page_size=page_size)
            v_hat = decode(blob, out_v_dtype=torch.float32).v
            s, mx, med = v_metrics(v, v_hat)
            rows.append(QualityRow(dist, scope, s, mx, med, attention_error(v, v_hat)))
    return rows


def format_table(rows: list[QualityRow]) -> str:
    """A fixed-width text table of the rows."""
    head = f"{'distribution':<17} {'scope':<15} {'SQNR dB':>8} {'max rel':>8} {'med rel':>8} {'attn rel':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.distribution:<17} {r.scope:<15} {r.sqnr_db:>8.2f} {r.max_rel_err:>8.4f} "
            f"{r.median_rel_err:>8.4f} {r.attn_rel_err:>9.5f}"
        )
    return "\n".join(lines)
