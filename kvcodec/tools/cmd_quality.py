"""``kvcodec quality``: FP8 V error per distribution and scope, on synthetic V.

The sizes given are the data generated, so they are capped
(:data:`MAX_ELEMENTS` per tensor) and ``--page-size`` is checked against the
format's limit before any work; pages larger than the data cost nothing extra.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .common import EXIT_OK, EXIT_USAGE, CLIError, page_size, positive

__all__ = ["MAX_ELEMENTS", "add_parser", "run"]

MAX_ELEMENTS = 1 << 26
"""Most V elements (tokens x heads x head_dim) one report generates: 256 MiB in fp32."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``quality``."""
    s = sub.add_parser(
        "quality", help="FP8 V quality per scope", description="Measure V's FP8 error per scope."
    )
    s.add_argument("--tokens", type=positive, default=1024)
    s.add_argument("--heads", type=positive, default=8)
    s.add_argument("--head-dim", type=positive, default=128)
    s.add_argument("--page-size", type=page_size, default=16)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true")
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


def run(args: argparse.Namespace) -> int:
    """Print the FP8 V quality table per distribution and scope."""
    check_size(args.tokens, args.heads, args.head_dim, "--tokens x --heads x --head-dim")
    from .quality import format_table, quality_report

    rows = quality_report(
        tokens=args.tokens, heads=args.heads, dim=args.head_dim, page_size=args.page_size, seed=args.seed
    )
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return EXIT_OK
    print(
        f"V in FP8 e4m3: {args.tokens} tokens x {args.heads} heads x {args.head_dim} dims, "
        f"page_size {args.page_size}, seed {args.seed}"
    )
    print(format_table(rows))
    return EXIT_OK
