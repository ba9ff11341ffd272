"""Blob bytes with ``compression="lossless"`` on a real model's KV (issue 38), beside the plain blob.

``make lossless-ratio`` (mk/quality.mk): the model of ``make quality-real`` (SmolLM2-135M-Instruct,
fp32 compute), its cache cast to bf16 and to fp16, every layer, the first ``--tokens`` tokens of
each text in 256-token blobs (per_page_head, page 16, the quality run's default scope). Prints total
blob bytes over raw K+V for the plain and the lossless blobs, and checks that each lossless blob
decodes to the plain blob's K and V bit for bit.

    python bench/lossless_ratio.py MODEL.gguf TEXT... [--tokens 1024] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import kvcodec
from kvcodec.tools.realmodel import load_model, prefix_cache, read_tokens

BLOB_TOKENS = 256
CACHES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _totals(kv: list, cache: str, into: dict[str, int]) -> None:
    for layer, (k, v) in enumerate(kv):
        for s in range(0, k.shape[0] - BLOB_TOKENS + 1, BLOB_TOKENS):
            kk, vv = k[s : s + BLOB_TOKENS], v[s : s + BLOB_TOKENS]
            kw = {"scope": "per_page_head", "page_size": 16, "layer_id": layer}
            plain = kvcodec.encode(kk, vv, **kw)
            coded = kvcodec.encode(kk, vv, compression="lossless", **kw)
            a, b = kvcodec.decode(plain), kvcodec.decode(coded)
            if not (torch.equal(a.k, b.k) and torch.equal(a.v.view(torch.uint8), b.v.view(torch.uint8))):
                raise SystemExit(f"{cache} layer {layer}: the lossless blob decodes differently")
            into["raw"] += kk.numel() * kk.element_size() + vv.numel() * vv.element_size()
            into["plain"] += len(plain)
            into["lossless"] += len(coded)
            into["blobs"] += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("texts", nargs="+")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    loaded = load_model(a.model, "fp32")
    totals = {c: {"raw": 0, "plain": 0, "lossless": 0, "blobs": 0} for c in CACHES}
    for text in a.texts:
        ids = read_tokens(loaded, text, BLOB_TOKENS, a.tokens)
        for cache, dtype in CACHES.items():
            _totals(prefix_cache(loaded, ids, dtype), cache, totals[cache])
    out = {}
    for cache, t in totals.items():
        out[cache] = {**t, "plain_ratio": t["plain"] / t["raw"], "lossless_ratio": t["lossless"] / t["raw"]}
        print(
            f"{cache} cache: {t['blobs']} blobs, raw K+V {t['raw']} B, plain {out[cache]['plain_ratio']:.4f}x, "
            f"lossless {out[cache]['lossless_ratio']:.4f}x (coder {kvcodec.codec.lossless.CODER})"
        )
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
