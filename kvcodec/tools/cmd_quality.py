"""``kvcodec quality``: FP8 V error per scope, on synthetic V or on a real model's outputs.

Without ``--model``: V's FP8 error per distribution and scope on synthetic V.
The sizes given are the data generated, so they are capped
(:data:`MAX_ELEMENTS` per tensor) and ``--page-size`` is checked against the
format's limit before any work; pages larger than the data cost nothing extra.

With ``--model PATH --text FILE...`` (the ``quality`` extra): what kvcodec's
round trip of a prefix's KV does to the model's next-token distributions and
greedy output, beside plain FP8 K+V and a noise floor
(:mod:`kvcodec.tools.model_quality`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, PROG, CLIError, escape_text, page_size, positive

__all__ = ["MAX_ELEMENTS", "add_parser", "run"]

MAX_ELEMENTS = 1 << 26
"""Most V elements (tokens x heads x head_dim) one report generates: 256 MiB in fp32."""

_DEFAULT_SCOPES = ("per_page_head/16", "per_layer_head", "per_tensor")  # model_quality.DEFAULT_SCOPES


def _non_negative(text: str) -> int:
    if text == "0":
        return 0
    return positive(text)


def _ratio(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return x


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``quality``."""
    s = sub.add_parser(
        "quality",
        help="FP8 V quality per scope (synthetic V, or a real model with --model)",
        description="Measure V's FP8 error per scope on synthetic V; with --model and --text, measure what "
        "kvcodec's round trip of a prefix's KV does to a real model's outputs, beside plain FP8 K+V.",
    )
    s.add_argument("--tokens", type=positive, default=1024)
    s.add_argument("--heads", type=positive, default=8)
    s.add_argument("--head-dim", type=positive, default=128)
    s.add_argument("--page-size", type=page_size, default=16)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="OUT",
        help="JSON report to OUT (to stdout when OUT is left out)",
    )
    m = s.add_argument_group("real model (needs the quality extra: pip install 'kvcodec[quality]')")
    m.add_argument("--model", metavar="PATH", help="Hugging Face checkpoint folder or .gguf file")
    m.add_argument("--text", nargs="+", metavar="FILE", help="English text files, one measurement each")
    m.add_argument("--prefix", type=positive, default=768, help="tokens whose KV is replaced (default 768)")
    m.add_argument(
        "--score", type=positive, default=768, help="tokens fed after the prefix; all but the first scored"
    )
    m.add_argument("--greedy", type=_non_negative, default=32, metavar="N", help="greedy tokens compared")
    m.add_argument(
        "--scopes",
        nargs="+",
        default=list(_DEFAULT_SCOPES),
        metavar="SCOPE[/PAGE]",
        help="kvcodec scopes to measure (default: per_page_head/16 per_layer_head per_tensor)",
    )
    m.add_argument(
        "--anchors",
        nargs="+",
        choices=("fp8_kv", "fp8_k", "v_ulp"),
        default=["fp8_kv", "fp8_k", "v_ulp"],
        help="comparisons beside kvcodec: plain FP8 K+V (always), FP8 K only, V moved < 1 unit (noise floor)",
    )
    m.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="model dtype")
    m.add_argument(
        "--kv-dtype",
        choices=("bf16", "fp16"),
        help="KV cache dtype when narrower than the model's (e.g. an fp32 model with a bf16 cache)",
    )
    m.add_argument("--plot", metavar="PNG", help="also draw the report (needs matplotlib)")
    m.add_argument(
        "--max-kl-ratio",
        type=_ratio,
        metavar="R",
        help="exit 1 if a kvcodec scope's mean KL is above R x the FP8 K+V anchor's",
    )
    m.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: only when stderr is a terminal)",
    )
    return s


def check_size(tokens: int, heads: int, head_dim: int, what: str) -> None:
    """Refuse (usage error) a generated tensor above :data:`MAX_ELEMENTS` elements."""
    n = tokens * heads * head_dim
    if n > MAX_ELEMENTS:
        raise CLIError(
            f"{what} of {tokens} x {heads} x {head_dim} = {n:,} elements is too large "
            f"(at most {MAX_ELEMENTS:,})",
            EXIT_USAGE,
        )


def _emit_json(payload: Any, dest: str) -> None:
    text = json.dumps(payload, indent=2)
    if dest == "-":
        print(text)
        return
    with open(dest, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def _run_synthetic(args: argparse.Namespace) -> int:
    check_size(args.tokens, args.heads, args.head_dim, "--tokens x --heads x --head-dim")
    from .quality import format_table, quality_report

    rows = quality_report(
        tokens=args.tokens, heads=args.heads, dim=args.head_dim, page_size=args.page_size, seed=args.seed
    )
    if args.json is not None:
        _emit_json([r.as_dict() for r in rows], args.json)
        if args.json == "-":
            return EXIT_OK
    print(
        f"V in FP8 e4m3: {args.tokens} tokens x {args.heads} heads x {args.head_dim} dims, "
        f"page_size {args.page_size}, seed {args.seed}"
    )
    print(format_table(rows))
    return EXIT_OK


def _run_model(args: argparse.Namespace) -> int:
    from .model_quality import ModelQualityConfig, format_model_table, plot_report, run_model_quality
    from .realmodel import load_model, quiet_transformers

    cfg = ModelQualityConfig(
        texts=tuple(args.text),
        prefix=args.prefix,
        score=args.score,
        greedy=args.greedy,
        scopes=tuple(args.scopes),
        kv_dtype=args.kv_dtype,
        anchors=tuple(args.anchors),
        seed=args.seed,
        max_kl_ratio=args.max_kl_ratio,
        progress=args.progress,
    )
    cfg.validate()
    quiet_transformers()
    report = run_model_quality(load_model(args.model, args.dtype), cfg)
    if args.json is not None:
        _emit_json(report, args.json)
    if args.json != "-":
        print(format_model_table(report))
    if args.plot and plot_report(report, args.plot) and args.json != "-":
        print(f"plot: {args.plot}")
    for failure in report["failures"]:
        print(f"{PROG}: error: quality: {escape_text(failure)}", file=sys.stderr)
    return EXIT_OK if report["passed"] else EXIT_FAILURE


def run(args: argparse.Namespace) -> int:
    """The synthetic table, or with ``--model`` the real model's report; exit 1 if the model run failed."""
    if (args.model is None) != (args.text is None):
        raise CLIError("--model and --text go together", EXIT_USAGE)
    return _run_synthetic(args) if args.model is None else _run_model(args)
