"""``kvcodec decode``: a blob into tensors k, v and scales in a .safetensors or .npz file.

Memory is what the blob's payload holds (V dequantized at most 4 bytes per
element): the file is read only up to what its header declares, once the
file's size matches it, and the decoder bounds every allocation by the real
payload.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .common import EXIT_OK, EXIT_USAGE, CLIError, add_expect_args, dtype_name, expected_hashes, torch_dtype
from .files import load_tensor, read_blob, require_files, save_tensors

__all__ = ["DTYPE_NAMES", "add_parser", "run"]

DTYPE_NAMES = ("fp16", "bf16", "fp32")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``decode``."""
    s = sub.add_parser(
        "decode",
        help="decode a blob to .safetensors or .npz",
        description="Decode a blob into tensors k, v and scales. Without --dequant V stays raw FP8 "
        "(uint8 bytes in .npz, float8 in .safetensors); bf16 goes into .npz as uint16 bits.",
    )
    s.add_argument("blob", metavar="BLOB")
    s.add_argument("--out", required=True, metavar="OUT", help="OUT.safetensors or OUT.npz")
    s.add_argument("--dequant", choices=DTYPE_NAMES, help="dequantize V to this dtype")
    s.add_argument("--scales", metavar="FILE", help="scales of an external-scope blob")
    s.add_argument("--strict", action="store_true", help="refuse trailing bytes after a v1 payload")
    add_expect_args(s)
    return s


def run(args: argparse.Namespace) -> int:
    """Decode a blob into k, v and scales in a .safetensors or .npz file."""
    from ..codec import decode
    from ..format import header_fields

    out = Path(args.out)
    if out.suffix.lower() not in (".safetensors", ".npz"):
        raise CLIError(f"--out {out}: expected a .safetensors or .npz file name", EXIT_USAGE)
    blob_path = Path(args.blob)
    require_files([blob_path])
    data = read_blob(blob_path, strict=args.strict).data  # no more than the header declares
    d = decode(
        data,
        out_v_dtype=torch_dtype(args.dequant),
        expected_hashes=expected_hashes(args),
        strict_hashes=args.strict_hashes,
        scales=load_tensor(Path(args.scales), "scales") if args.scales else None,
        strict=args.strict,
    )
    tensors = {name: t for name, t in (("k", d.k), ("v", d.v), ("scales", d.scales)) if t is not None}
    meta = {"source": str(blob_path), "header": header_fields(d.header), "dequant": args.dequant}
    save_tensors(out, tensors, meta)
    desc = ", ".join(f"{name} {list(t.shape)} {dtype_name(t.dtype)}" for name, t in tensors.items())
    print(f"wrote {out}: {desc}")
    return EXIT_OK
