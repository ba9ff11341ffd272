"""What FP8 V does to a real model's outputs: kvcodec's round trip against plain FP8 K+V.

For each text, the model reads a prefix; that prefix's KV cache is then
replaced layer by layer (K asserted bit-exact for kvcodec) and the model
scores the continuation with it, teacher forced, and generates greedily from
it. Every variant is compared with the exact cache in the same run:

* ``kvcodec SCOPE/PAGE``: kvcodec's encode/decode round trip (K exact, V FP8 e4m3).
* ``fp8 K+V per-tensor``: K and V each cast to FP8 e4m3 with one scale per layer
  tensor (amax/448), what an FP8 KV cache stores: the anchor users compare against.
* ``fp8 K only``: the same cast on K alone, V exact (shows what keeping K exact buys).
* ``V < 1 unit``: every V element moved by a random amount below one unit in the
  last place of the model dtype, then rounded back (a noise floor: what the
  dtype's own rounding does).

Reported per variant: ΔPPL (mean and max over texts), top-1 agreement and mean
KL(exact || variant) over the scored positions, greedy agreement over N tokens
with each first divergence and the exact run's top-2 log-prob gap there (a gap
near 0 is a near-tie, not damage), and V's SQNR per layer.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..codec import decode, encode
from ..errors import Reason, UnsupportedConfigError
from ..format import COMPUTED_SCOPES, MAX_DIM, SCOPE_NAMES
from .progress import Progress, progress_enabled
from .quality import sqnr_db
from .realmodel import DTYPES, LoadedModel, forward, make_cache, prefix_cache, read_tokens

__all__ = [
    "ANCHORS",
    "DEFAULT_SCOPES",
    "ModelQualityConfig",
    "Variant",
    "format_model_table",
    "parse_scope",
    "plot_report",
    "run_model_quality",
    "variants_for",
]

KV = list[tuple[torch.Tensor, torch.Tensor]]
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
DEFAULT_SCOPES = ("per_page_head/16", "per_layer_head", "per_tensor")
_KVCODEC_SCOPES = tuple(name for name, scope in SCOPE_NAMES.items() if scope in COMPUTED_SCOPES)


@dataclass(frozen=True)
class Variant:
    """One way of replacing the prefix's KV: ``kind`` is kvcodec, fp8_kv, fp8_k or v_ulp."""

    name: str
    kind: str
    scope: str | None = None
    page_size: int = 16


def parse_scope(spec: str) -> Variant:
    """``per_page_head/16``, ``per_layer_head``, ``per_tensor`` (page size 16 unless given) as a variant."""
    scope, _, page = spec.partition("/")
    if scope not in _KVCODEC_SCOPES:
        raise UnsupportedConfigError(
            f"scope must be one of {list(_KVCODEC_SCOPES)} (optionally /PAGE_SIZE); got {spec!r}",
            reason=Reason.BAD_SCOPE,
        )
    try:
        size = int(page) if page else 16
    except ValueError:
        size = 0
    if not 1 <= size <= MAX_DIM:
        raise UnsupportedConfigError(f"page size in {spec!r} must be 1..{MAX_DIM}", reason=Reason.BAD_VALUE)
    label = f"{scope}/{size}" if scope == "per_page_head" else scope
    return Variant(f"kvcodec {label}", "kvcodec", scope, size)


ANCHORS = {
    "fp8_kv": Variant("fp8 K+V per-tensor", "fp8_kv"),
    "fp8_k": Variant("fp8 K only per-tensor", "fp8_k"),
    "v_ulp": Variant("V < 1 unit (noise floor)", "v_ulp"),
}
"""The comparisons beside kvcodec, by name (fp8_kv is always measured: the KL ratio is against it)."""


def variants_for(scopes: Sequence[str], anchors: Sequence[str] = tuple(ANCHORS)) -> list[Variant]:
    """The kvcodec variants for ``scopes``, then the FP8 K+V anchor and the other ``anchors`` asked for."""
    unknown = sorted(set(anchors) - set(ANCHORS))
    if unknown:
        raise UnsupportedConfigError(
            f"unknown anchors {unknown}; expected some of {list(ANCHORS)}", reason=Reason.BAD_VALUE
        )
    return [parse_scope(s) for s in scopes] + [
        v for name, v in ANCHORS.items() if name == "fp8_kv" or name in anchors
    ]


@dataclass(frozen=True)
class ModelQualityConfig:
    """What :func:`run_model_quality` measures: texts, token counts, variants, the pass bar."""

    texts: tuple[str, ...]
    prefix: int = 768
    """Tokens whose KV is replaced."""
    score: int = 768
    """Tokens fed after the prefix; the last ``score - 1`` of them are scored."""
    greedy: int = 32
    """Tokens generated greedily from the prefix (plus its next text token)."""
    scopes: tuple[str, ...] = DEFAULT_SCOPES
    kv_dtype: str | None = None
    """The cache's dtype ("bf16", "fp16"); None: the model's own."""
    anchors: tuple[str, ...] = tuple(ANCHORS)
    """Which of :data:`ANCHORS` to measure besides kvcodec (fp8_kv always)."""
    seed: int = 0
    max_kl_ratio: float | None = None
    """Fail when a kvcodec variant's mean KL exceeds this multiple of the FP8 K+V anchor's."""
    progress: bool | None = None

    def validate(self) -> None:
        """Refuse counts the measurement cannot use."""
        if not self.texts:
            raise UnsupportedConfigError("at least one text is needed", reason=Reason.MISSING_ARGUMENT)
        for name in ("prefix", "score"):
            if getattr(self, name) < 2:
                raise UnsupportedConfigError(f"{name} must be >= 2", reason=Reason.BAD_VALUE)
        if self.greedy < 0:
            raise UnsupportedConfigError("greedy must be >= 0", reason=Reason.BAD_VALUE)
        variants_for(self.scopes, self.anchors)
        if self.kv_dtype is not None and self.kv_dtype not in ("bf16", "fp16"):
            raise UnsupportedConfigError(
                f"kv_dtype must be bf16 or fp16; got {self.kv_dtype!r}", reason=Reason.UNSUPPORTED_DTYPE
            )


# ----------------------------------------------------------------------------- the KV replacements


def _kvcodec_round_trip(k: torch.Tensor, v: torch.Tensor, var: Variant) -> tuple[torch.Tensor, bool]:
    """V after kvcodec's encode/decode, and whether K came back bit for bit."""
    blob = encode(k, v, scope=var.scope, page_size=var.page_size)
    d = decode(blob, out_v_dtype=v.dtype, copy=True)
    k_exact = d.k is not None and torch.equal(d.k.contiguous().view(torch.uint8), k.view(torch.uint8))
    return d.v.reshape(v.shape), k_exact


def fp8_per_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x`` cast to FP8 e4m3 with one scale (amax / 448) and back to its dtype."""
    scale = x.float().abs().amax().clamp_min(1e-12) / FP8_MAX
    return ((x.float() / scale).to(FP8).float() * scale).to(x.dtype)


def below_one_unit(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``x`` moved by a uniform amount in (-1, 1) units of its dtype's last place, then rounded back."""
    ulp = (torch.nextafter(x.abs(), torch.tensor(math.inf, dtype=x.dtype)) - x.abs()).float()
    noise = (torch.rand(x.shape, generator=gen) * 2 - 1) * ulp
    return (x.float() + noise).to(x.dtype)


@dataclass
class Replaced:
    """A variant's KV for one text, whether every layer's K stayed exact, V's SQNR per layer."""

    kv: KV
    k_exact: bool
    v_sqnr_db: list[float | None]
    """None where V is exact (infinite SQNR), so the report stays valid JSON."""


def replace_kv(kv: KV, var: Variant, gen: torch.Generator) -> Replaced:
    """Each layer's (K, V) as ``var`` leaves it."""
    out: KV = []
    k_exact, sq = True, []
    for k, v in kv:
        if var.kind == "kvcodec":
            v2, ok = _kvcodec_round_trip(k, v, var)
            k2, k_exact = k, k_exact and ok
        elif var.kind == "fp8_kv":
            k2, v2 = fp8_per_tensor(k), fp8_per_tensor(v)
        elif var.kind == "fp8_k":
            k2, v2 = fp8_per_tensor(k), v
        else:
            k2, v2 = k, below_one_unit(v, gen)
        out.append((k2, v2))
        db = sqnr_db(v, v2)
        sq.append(db if math.isfinite(db) else None)
    return Replaced(out, k_exact, sq)


# ----------------------------------------------------------------------------- scoring one text


@dataclass
class Continuation:
    """Log-probs over the scored positions and the scored targets."""

    logp: torch.Tensor
    targets: torch.Tensor

    @property
    def ppl(self) -> float:
        """Perplexity of the targets."""
        nll = -self.logp.gather(1, self.targets[:, None]).mean()
        return math.exp(float(nll))


@torch.inference_mode()
def continuation(loaded: LoadedModel, kv: KV, cont_ids: torch.Tensor) -> Continuation:
    """Feed ``cont_ids`` (``[1, n]``) after the cached prefix; log-probs of tokens 2..n."""
    logits = forward(loaded, cont_ids, make_cache(kv, loaded.dtype)).logits[0, :-1]
    return Continuation(torch.log_softmax(logits.float(), dim=-1), cont_ids[0, 1:])


@dataclass
class Greedy:
    """Greedily generated tokens and each step's top-2 log-prob gap."""

    tokens: list[int]
    gaps: list[float]


@torch.inference_mode()
def greedy_tokens(loaded: LoadedModel, kv: KV, first: torch.Tensor, n: int) -> Greedy:
    """Generate ``n`` tokens greedily after the cached prefix, starting by feeding ``first`` (``[1, 1]``)."""
    cache, x = make_cache(kv, loaded.dtype), first
    out = Greedy([], [])
    for _ in range(n):
        logits = forward(loaded, x, cache).logits[0, -1].float()
        top = torch.log_softmax(logits, dim=-1).topk(2)
        out.tokens.append(int(top.indices[0]))
        out.gaps.append(float(top.values[0] - top.values[1]))
        x = top.indices[:1].view(1, 1)
    return out


def compare(base: Continuation, got: Continuation) -> dict[str, float]:
    """PPL, mean KL(base || got) and top-1 agreement over the scored positions."""
    kl = (base.logp.exp() * (base.logp - got.logp)).sum(-1)
    top1 = (base.logp.argmax(-1) == got.logp.argmax(-1)).float().mean()
    return {"ppl": got.ppl, "kl_mean": float(kl.mean()), "top1": float(top1)}


def greedy_compare(base: Greedy, got: Greedy) -> dict[str, Any]:
    """How many greedy tokens match the exact run, the first divergence and the exact run's gap there."""
    n = len(base.tokens)
    first = next((i for i in range(n) if base.tokens[i] != got.tokens[i]), None)
    return {
        "greedy_same": n if first is None else first,
        "first_divergence": first,
        "gap_at_divergence": None if first is None else base.gaps[first],
    }


# ----------------------------------------------------------------------------- the run


@dataclass
class _TextResult:
    path: str
    base_ppl: float
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)


def _score_text(
    loaded: LoadedModel, cfg: ModelQualityConfig, path: str, variants: list[Variant], step: Callable[[], None]
) -> _TextResult:
    ids = read_tokens(loaded, path, cfg.prefix + max(cfg.score, 1))
    kv = prefix_cache(loaded, ids[:, : cfg.prefix], DTYPES[cfg.kv_dtype] if cfg.kv_dtype else None)
    cont_ids, first = ids[:, cfg.prefix : cfg.prefix + cfg.score], ids[:, cfg.prefix : cfg.prefix + 1]
    base = continuation(loaded, kv, cont_ids)
    base_greedy = greedy_tokens(loaded, kv, first, cfg.greedy)
    step()
    res = _TextResult(path, base.ppl)
    gen = torch.Generator().manual_seed(cfg.seed)
    for var in variants:
        rep = replace_kv(kv, var, gen)
        row = compare(base, continuation(loaded, rep.kv, cont_ids))
        row["dppl_pct"] = 100.0 * (row["ppl"] / base.ppl - 1.0)
        row.update(greedy_compare(base_greedy, greedy_tokens(loaded, rep.kv, first, cfg.greedy)))
        row["k_exact"] = rep.k_exact if var.kind == "kvcodec" else None
        row["v_sqnr_db"] = rep.v_sqnr_db
        res.rows[var.name] = row
        step()
    return res


def _mean_or_none(values: Any) -> float | None:
    vals = list(values)
    return None if any(v is None for v in vals) else statistics.fmean(vals)


def _summary(var: Variant, results: list[_TextResult], greedy: int) -> dict[str, Any]:
    rows = [r.rows[var.name] for r in results]
    layers = len(rows[0]["v_sqnr_db"])
    return {
        **asdict(var),
        "dppl_pct_mean": statistics.fmean(r["dppl_pct"] for r in rows),
        "dppl_pct_max": max(r["dppl_pct"] for r in rows),
        "top1": statistics.fmean(r["top1"] for r in rows),
        "kl_mean": statistics.fmean(r["kl_mean"] for r in rows),
        "greedy_all_same": sum(r["first_divergence"] is None for r in rows),
        "greedy_same_mean": statistics.fmean(r["greedy_same"] for r in rows) if greedy else None,
        "divergences": [
            {
                "text": os.path.basename(t.path),
                "position": r["first_divergence"],
                "gap": r["gap_at_divergence"],
            }
            for t, r in zip(results, rows)
            if r["first_divergence"] is not None
        ],
        "k_exact": None if var.kind != "kvcodec" else all(r["k_exact"] for r in rows),
        "v_sqnr_db_per_layer": [_mean_or_none(r["v_sqnr_db"][i] for r in rows) for i in range(layers)],
    }


def _verdict(summaries: list[dict[str, Any]], cfg: ModelQualityConfig) -> list[str]:
    """Failures: a kvcodec K that was not exact, a KL ratio above the bar."""
    anchor = next(s for s in summaries if s["kind"] == "fp8_kv")
    failures = []
    for s in summaries:
        if s["kind"] != "kvcodec":
            continue
        s["kl_vs_fp8_kv"] = s["kl_mean"] / anchor["kl_mean"] if anchor["kl_mean"] > 0 else math.inf
        if not s["k_exact"]:
            failures.append(f"{s['name']}: K was not bit-exact after the round trip")
        if cfg.max_kl_ratio is not None and s["kl_vs_fp8_kv"] > cfg.max_kl_ratio:
            failures.append(
                f"{s['name']}: mean KL {s['kl_mean']:.3g} is {s['kl_vs_fp8_kv']:.2f}x the FP8 K+V anchor's "
                f"(bar {cfg.max_kl_ratio}x)"
            )
    return failures


def run_model_quality(loaded: LoadedModel, cfg: ModelQualityConfig) -> dict[str, Any]:
    """Measure every variant on every text; a JSON-friendly report with ``passed`` and ``failures``."""
    cfg.validate()
    variants = variants_for(cfg.scopes, cfg.anchors)
    with Progress(
        len(cfg.texts) * (len(variants) + 1), "quality", enabled=progress_enabled(cfg.progress), unit="run"
    ) as bar:
        results = [_score_text(loaded, cfg, p, variants, bar.update) for p in cfg.texts]
    summaries = [_summary(v, results, cfg.greedy) for v in variants]
    failures = _verdict(summaries, cfg)
    return {
        "model": loaded.name,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "kv_dtype": str(DTYPES[cfg.kv_dtype] if cfg.kv_dtype else loaded.dtype).removeprefix("torch."),
        "layers": loaded.layers,
        "prefix_tokens": cfg.prefix,
        "scored_tokens": cfg.score - 1,
        "greedy_tokens": cfg.greedy,
        "texts": [{"path": r.path, "base_ppl": r.base_ppl, "variants": r.rows} for r in results],
        "variants": summaries,
        "max_kl_ratio": cfg.max_kl_ratio,
        "passed": not failures,
        "failures": failures,
    }


# ----------------------------------------------------------------------------- output


def _greedy_cell(s: dict[str, Any], texts: int) -> str:
    divs = ", ".join(
        f"@{d['position']} gap {d['gap']:.2f}" for d in sorted(s["divergences"], key=lambda d: d["position"])
    )
    return f"{s['greedy_all_same']}/{texts}" + (f" ({divs})" if divs else "")


def format_model_table(r: dict[str, Any]) -> str:
    """The report of :func:`run_model_quality` as a text table."""
    n = len(r["texts"])
    ppl = statistics.fmean(t["base_ppl"] for t in r["texts"])
    head = (
        f"{'KV':<26} {'ΔPPL mean':>9} {'ΔPPL max':>9} {'top-1':>7} {'mean KL':>9} {'KL/FP8':>6} "
        f"{'K exact':>7}  greedy same (first divergence, exact run's top-2 gap)"
    )
    lines = [
        f"kvcodec quality: {r['model']} computing in {r['dtype']}, KV cache in {r['kv_dtype']}, {r['layers']} layers, {n} texts, prefix "
        f"{r['prefix_tokens']} tokens, {r['scored_tokens']} scored, {r['greedy_tokens']} greedy",
        f"exact KV: mean perplexity {ppl:.3f}",
        head,
        "-" * len(head),
    ]
    for s in r["variants"]:
        ratio = f"{s['kl_vs_fp8_kv']:.2f}x" if "kl_vs_fp8_kv" in s else ""
        exact = "" if s["k_exact"] is None else ("yes" if s["k_exact"] else "NO")
        lines.append(
            f"{s['name']:<26} {s['dppl_pct_mean']:>+8.3f}% {s['dppl_pct_max']:>+8.3f}% {100 * s['top1']:>6.2f}% "
            f"{s['kl_mean']:>9.5f} {ratio:>6} {exact:>7}  {_greedy_cell(s, n)}"
        )
    lines.append("result: " + ("PASS" if r["passed"] else "FAIL"))
    return "\n".join(lines)


def plot_report(r: dict[str, Any], path: str) -> bool:
    """Save a PNG (mean KL per variant; V's SQNR per layer) to ``path``; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kvcodec: note: matplotlib is not installed; no plot written", file=sys.stderr)
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [s["name"] for s in r["variants"]]
    ax1.barh(names, [max(s["kl_mean"], 1e-9) for s in r["variants"]], color="tab:blue")
    ax1.set_xscale("log")
    ax1.invert_yaxis()
    ax1.set_xlabel("mean KL(exact || variant), nats (log)")
    ax1.set_title(f"{r['model']} ({r['dtype']}, KV {r['kv_dtype']}): next-token KL")
    for s in r["variants"]:
        if all(x is not None for x in s["v_sqnr_db_per_layer"]):
            ax2.plot(s["v_sqnr_db_per_layer"], marker=".", label=s["name"])
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_xlabel("layer")
    ax2.set_ylabel("V SQNR, dB (higher is better; exact V not drawn)")
    ax2.set_title("V's error per layer")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
