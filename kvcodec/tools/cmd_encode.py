"""``kvcodec encode``: K/V tensors from .npy or .safetensors files into one blob.

Writes header version 2 (CRC over header and payload) unless ``--version 1``
asks for a blob LMCache 0.5.6 can read.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..format import SCOPE_NAMES
from .common import (
    EXIT_OK,
    EXIT_USAGE,
    HASH_KEYS,
    CLIError,
    bytes_str,
    hashes_from,
    human,
    identifier,
    page_size,
    positive,
    torch_dtype,
)
from .files import load_safetensors, load_tensor, require_files, write_atomic

__all__ = ["SCOPES", "add_parser", "run"]

SCOPES = tuple(SCOPE_NAMES)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``encode``."""
    s = sub.add_parser(
        "encode",
        help="encode K/V tensors into a blob",
        description="Encode K and V (.npy files, or one .safetensors holding both) into an LMCKV blob. "
        "bf16 inputs must come from .safetensors (numpy has no bf16).",
    )
    s.add_argument("--k", metavar="FILE", help="K: .npy, or .safetensors (holding V too unless --v is given)")
    s.add_argument("--v", metavar="FILE", help="V: .npy or .safetensors (omit --k for a V-only blob)")
    s.add_argument("--k-name", default="k", help="tensor name of K in a .safetensors file (default: k)")
    s.add_argument("--v-name", default="v", help="tensor name of V in a .safetensors file (default: v)")
    s.add_argument("--out", required=True, metavar="BLOB", help="output blob file")
    s.add_argument(
        "--scope", choices=SCOPES, default="per_page_head", help="V scale scope (default: per_page_head)"
    )
    s.add_argument(
        "--page-size", type=page_size, metavar="N", help="tokens per page (needed by per_page_head)"
    )
    s.add_argument(
        "--scales", metavar="FILE", help="scales for --scope external (.npy, or 'scales' in .safetensors)"
    )
    s.add_argument("--scale-dtype", choices=("fp32", "fp16"), default="fp32", help="stored scale dtype")
    s.add_argument("--layer-id", type=identifier, default=-1, metavar="N")
    s.add_argument("--chunk-id", type=identifier, default=-1, metavar="N")
    s.add_argument(
        "--chunk-size", type=positive, metavar="N", help="chunk size in tokens (default: tokens given)"
    )
    s.add_argument("--head-axis", type=int, metavar="AXIS", help="axis of the heads (default: -2)")
    s.add_argument("--page-axis", type=int, metavar="AXIS", help="axis of the pages in a 4-D input")
    s.add_argument("--nonfinite", choices=("error", "saturate"), default="error", help="NaN/Inf in V")
    s.add_argument(
        "--version",
        type=int,
        choices=(1, 2),
        default=2,
        help="header version: 2 (default) seals header and payload with one CRC; 1 is what "
        "LMCache 0.5.6 reads (its CRC covers the payload only)",
    )
    g = s.add_argument_group("identity hashes written into the header")
    for key in HASH_KEYS:
        g.add_argument(f"--{key.replace('_', '-')}", dest=key, metavar="STR")
    return s


def _load_kv(args: argparse.Namespace) -> tuple[Any, Any]:
    """K (or None for a V-only blob) and V from the files named by ``--k``/``--v``."""
    if args.k is None and args.v is None:
        raise CLIError(
            "encode needs --k (and --v unless --k is a .safetensors file holding both)", EXIT_USAGE
        )
    k_path = Path(args.k) if args.k else None
    v_path = Path(args.v) if args.v else None
    if v_path is None:
        if k_path is None or k_path.suffix.lower() != ".safetensors":
            raise CLIError("--v is required unless --k is a .safetensors file holding both", EXIT_USAGE)
        v_path = k_path
    require_files([p for p in (k_path, v_path) if p is not None])
    if k_path == v_path and v_path.suffix.lower() == ".safetensors":
        both = load_safetensors(v_path, [args.k_name, args.v_name])
        return both[args.k_name], both[args.v_name]
    k = load_tensor(k_path, args.k_name) if k_path is not None else None
    return k, load_tensor(v_path, args.v_name)


def _load_scales(args: argparse.Namespace) -> Any:
    """The ``--scales`` tensor (fp32 or fp16), or None."""
    if not args.scales:
        if args.scope == "external":
            raise CLIError(
                "--scope external needs --scales FILE (.npy, or .safetensors with 'scales')", EXIT_USAGE
            )
        return None
    import torch

    scales = load_tensor(Path(args.scales), "scales")
    return scales if scales.dtype in (torch.float32, torch.float16) else scales.to(torch.float32)


def run(args: argparse.Namespace) -> int:
    """Encode K and V tensors from files into one blob."""
    from ..codec import EncodeSpec, encode

    k, v = _load_kv(args)
    spec = EncodeSpec(
        scope=args.scope,
        page_size=args.page_size,
        head_axis=args.head_axis,
        page_axis=args.page_axis,
        hashes=hashes_from(args, "") or None,
        layer_id=args.layer_id,
        chunk_id=args.chunk_id,
        chunk_size=args.chunk_size,
        scale_dtype=torch_dtype(args.scale_dtype),
        scales=_load_scales(args),
        nonfinite=args.nonfinite,
        version=args.version,
    )
    blob = encode(k, v, spec)
    out = Path(args.out)
    write_atomic(out, lambda f: f.write(blob))
    raw = (v.numel() * v.element_size()) + (k.numel() * k.element_size() if k is not None else 0)
    ratio = f", {len(blob) / raw:.4f} of the {human(raw)} input" if raw else ""
    print(f"wrote {out}: {bytes_str(len(blob))}{ratio}")
    return EXIT_OK
