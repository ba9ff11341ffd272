"""``kvcodec demo``: a Llama-3-8B-shaped KV cache through encode, a DirectoryStore and back.

With ``--model PATH --text FILE`` the cache is a real model's, from a forward pass over the text.

Arguments map one to one onto :class:`kvcodec.tools.demo.DemoConfig`;
``--min-sqnr-db`` must be finite (``nan`` would make every run pass).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..format import SCOPE_NAMES, ScaleScope
from .common import EXIT_FAILURE, EXIT_OK, PROG, escape_text, finite_float, page_size, positive

__all__ = ["add_parser", "run"]

# demo.SCOPES (every scope but external: the demo has no scales to pass), without importing torch
_SCOPES = tuple(name for name, scope in SCOPE_NAMES.items() if scope != ScaleScope.EXTERNAL)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``demo``."""
    s = sub.add_parser(
        "demo",
        help="encode, store, read back and check a Llama-3-8B-shaped KV cache",
        description="Build a synthetic KV cache shaped like Llama-3-8B's, encode every (layer, chunk) "
        "into a DirectoryStore, read it all back, check K bit for bit and measure V's error, the "
        "size ratio and the throughput.",
    )
    s.add_argument("--layers", type=positive, default=32)
    s.add_argument("--tokens", type=positive, default=2048)
    s.add_argument("--chunk-tokens", type=positive, default=256)
    s.add_argument("--heads", type=positive, default=8, help="KV heads")
    s.add_argument("--head-dim", type=positive, default=128)
    s.add_argument("--page-size", type=page_size, default=16)
    s.add_argument("--scope", choices=_SCOPES, default="per_page_head")
    s.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="K/V dtype of the cache")
    s.add_argument("--store", metavar="DIR", help="store folder (default: a temp folder, removed at the end)")
    s.add_argument("--keep", action="store_true", help="keep the temp store folder")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--sample", type=int, default=8, metavar="N", help="blobs to measure attention error on")
    s.add_argument("--fsync", action="store_true", help="fsync every put (durable, slower)")
    s.add_argument(
        "--min-sqnr-db",
        type=finite_float,
        default=20.0,
        metavar="DB",
        help="fail if V's SQNR is below (a finite number; default 20)",
    )
    s.add_argument(
        "--version",
        type=int,
        choices=(1, 2),
        default=2,
        help="header version of the blobs (default 2, sealed)",
    )
    s.add_argument(
        "--model",
        metavar="PATH",
        help="real KV instead: a checkpoint folder or .gguf file read over --text (the quality extra); "
        "layers, heads and head_dim come from the model, --tokens caps the text",
    )
    s.add_argument("--text", metavar="FILE", help="the text the --model reads")
    s.add_argument("--json", action="store_true")
    s.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: only when stderr is a terminal)",
    )
    return s


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its table (or JSON); exit 1 if it failed."""
    from .demo import DemoConfig, format_demo, run_demo

    config = DemoConfig(
        layers=args.layers,
        tokens=args.tokens,
        chunk_tokens=args.chunk_tokens,
        heads=args.heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        scope=args.scope,
        dtype=args.dtype,
        store=args.store,
        keep=args.keep,
        seed=args.seed,
        sample=args.sample,
        fsync=args.fsync,
        threads=args.threads if args.threads is not None else 1,
        min_sqnr_db=args.min_sqnr_db,
        progress=args.progress,
        version=args.version,
        model=args.model,
        text=args.text,
    )
    if args.model is not None:
        from .realmodel import quiet_transformers

        quiet_transformers()
    report = run_demo(config)
    print(json.dumps(report, indent=2) if args.json else format_demo(report))
    for failure in report["failures"]:
        print(f"{PROG}: error: demo: {escape_text(failure)}", file=sys.stderr)
    return EXIT_OK if report["passed"] else EXIT_FAILURE
