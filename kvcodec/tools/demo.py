"""End-to-end demo: a Llama-3-8B-shaped KV cache through encode, a DirectoryStore and back.

The cache is synthetic but has the structure of real ones: K carries a few
outlier channels 10-50x larger than the rest (in RoPE pairs) and a per-layer
scale; V is smoother, Gaussian with a per-head scale spread over a decade and
a mild per-channel spread. Each (layer, chunk) is generated from its own seed,
so the cache never sits in memory whole: the write pass generates, encodes and
stores one chunk of one layer at a time, and the read pass regenerates the same
tensors to check what comes back (K bit for bit, V's error).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from .cli import Progress, progress_enabled
from .codec import decode, encode
from .errors import CodecError, CodecMismatchError
from .format import Hashes, parse
from .quality import attention_error, v_metrics
from .store import DirectoryStore

__all__ = ["MODEL_HASHES", "SyntheticKVCache", "format_demo", "run_demo"]

_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "max_position_embeddings": 8192}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


MODEL_HASHES = Hashes(
    model_id="meta-llama/Meta-Llama-3-8B",
    model_revision_hash=_sha("meta-llama/Meta-Llama-3-8B@main (synthetic demo revision)")[:40],
    tokenizer_hash="sha256:" + _sha("llama-3 tiktoken BPE, 128256 tokens (synthetic demo)"),
    rope_config_hash="sha256:" + _sha(json.dumps(_ROPE, sort_keys=True)),
    attention_backend="FLASH_ATTN",
    kv_layout="NHD",
)
"""Identity hashes the demo writes and expects back (synthetic but well-formed)."""

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class SyntheticKVCache:
    """Deterministic K/V per (layer, chunk), shaped ``[tokens, heads, head_dim]``."""

    def __init__(
        self,
        *,
        layers: int,
        tokens: int,
        chunk_tokens: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        seed: int = 0,
    ) -> None:
        self.layers, self.tokens, self.chunk_tokens = layers, tokens, chunk_tokens
        self.heads, self.head_dim, self.dtype, self.seed = heads, head_dim, dtype, seed
        self.chunks = -(-tokens // chunk_tokens)
        self._profiles: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def chunk_len(self, chunk: int) -> int:
        """Tokens in ``chunk`` (the last one may be partial)."""
        return min(self.chunk_tokens, self.tokens - chunk * self.chunk_tokens)

    def _gen(self, *salt: int) -> torch.Generator:
        h = hashlib.blake2b(repr((self.seed, *salt)).encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))

    def _profile(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K's per-channel scale and bias ``[heads, dim]``, V's per-(head, channel) scale."""
        prof = self._profiles.get(layer)
        if prof is not None:
            return prof
        h, d = self.heads, self.head_dim
        g = self._gen(-1, layer)
        depth = layer / max(1, self.layers - 1)
        k_scale = torch.full((h, d), 0.5 + 1.5 * depth)  # per-layer scale, deeper layers larger
        k_scale *= torch.empty(h, d).uniform_(0.7, 1.3, generator=g)
        n_out = max(1, d // 64)  # a few outlier channels per head, in RoPE pairs (i, i + d/2)
        for head in range(h):
            ch = torch.randperm(max(1, d // 2), generator=g)[:n_out]
            mult = torch.empty(n_out).uniform_(10.0, 50.0, generator=g)
            k_scale[head, ch] *= mult
            if d >= 2:
                k_scale[head, ch + d // 2] *= mult
        k_bias = torch.randn(h, d, generator=g) * 0.2 * k_scale
        v_head = torch.logspace(-0.5, 0.5, h)[torch.randperm(h, generator=g)]  # one decade across heads
        v_scale = v_head.view(h, 1) * torch.empty(h, d).uniform_(0.6, 1.4, generator=g)
        prof = (k_scale, k_bias, v_scale)
        self._profiles[layer] = prof
        return prof

    def chunk(self, layer: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer over one chunk, at the cache's dtype."""
        k_scale, k_bias, v_scale = self._profile(layer)
        t = self.chunk_len(chunk)
        x = torch.randn(2, t, self.heads, self.head_dim, generator=self._gen(layer, chunk))
        k = x[0].mul_(k_scale).add_(k_bias).to(self.dtype)
        v = x[1].mul_(v_scale).to(self.dtype)
        return k, v


def _sample_pairs(layers: int, chunks: int, n: int) -> set[tuple[int, int]]:
    """Up to ``n`` distinct (layer, chunk) pairs spread evenly over the cache, first and last included."""
    total = layers * chunks
    n = max(0, min(n, total))
    if n <= 1:
        return {(0, 0)} if n else set()
    idx = {round(j * (total - 1) / (n - 1)) for j in range(n)}
    return {divmod(i, chunks) for i in idx}


def run_demo(
    *,
    layers: int = 32,
    tokens: int = 2048,
    chunk_tokens: int = 256,
    heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    scope: str = "per_page_head",
    dtype: str = "fp16",
    store: str | os.PathLike[str] | None = None,
    keep: bool = False,
    seed: int = 0,
    sample: int = 8,
    fsync: bool = False,
    threads: int | None = 1,
    min_sqnr_db: float = 20.0,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Encode a synthetic cache into a store, read it back, and report.

    Returns a JSON-friendly dict; ``passed`` is False (with ``failures``) if any
    K differs by a bit, a blob fails to decode or carries wrong ids, the hash
    gate lets a wrong model through, or V's SQNR falls below ``min_sqnr_db``.
    ``threads`` sets torch's CPU threads for the run (1 by default: the
    per-chunk work is small, and extra threads only contend on a busy machine).
    """
    if dtype not in _DTYPES:
        raise CodecError(f"dtype must be one of {sorted(_DTYPES)}; got {dtype!r}")
    for name, val in (
        ("layers", layers), ("tokens", tokens), ("chunk_tokens", chunk_tokens),
        ("heads", heads), ("head_dim", head_dim), ("page_size", page_size),
    ):  # fmt: skip
        if val < 1:
            raise CodecError(f"{name} must be >= 1; got {val}")
    t_wall = time.perf_counter()
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    tmp_root = None
    if store is None:
        tmp_root = tempfile.mkdtemp(prefix="kvcodec-demo-")
        root = tmp_root
    else:
        root = os.fspath(store)
    cache = SyntheticKVCache(
        layers=layers, tokens=tokens, chunk_tokens=chunk_tokens, heads=heads, head_dim=head_dim,
        dtype=_DTYPES[dtype], seed=seed,
    )  # fmt: skip
    n_blobs = layers * cache.chunks
    hashes = MODEL_HASHES
    failures: list[str] = []
    try:
        st = DirectoryStore(root, fsync=fsync)
        raw_bytes = blob_bytes = k_bytes = v_bytes = s_bytes = 0
        t_enc = t_dec = t_put = t_get = 0.0
        keys: dict[tuple[int, int], str] = {}
        bar_on = progress_enabled(progress)
        with Progress(2 * n_blobs, "encode+store", enabled=bar_on, unit="blob") as bar:
            # ---- write pass: generate, encode, put --------------------------------
            for layer in range(layers):
                for c in range(cache.chunks):
                    k, v = cache.chunk(layer, c)
                    t0 = time.perf_counter()
                    blob = encode(
                        k, v, scope=scope, page_size=page_size, hashes=hashes,
                        layer_id=layer, chunk_id=c, chunk_size=chunk_tokens,
                    )  # fmt: skip
                    t1 = time.perf_counter()
                    key = DirectoryStore.make_key(hashes, layer, c)
                    st.put(key, blob)
                    t2 = time.perf_counter()
                    t_enc += t1 - t0
                    t_put += t2 - t1
                    keys[layer, c] = key
                    raw_bytes += k.numel() * k.element_size() + v.numel() * v.element_size()
                    blob_bytes += len(blob)
                    k_bytes += k.numel() * k.element_size()
                    v_bytes += v.numel()
                    s_bytes += parse(blob, verify_crc=False).header.scale_payload_len
                    del blob
                    bar.update()

            # ---- read pass: get, decode (hash-gated), check -----------------------
            bar.set_description("read+verify")
            samples = _sample_pairs(layers, cache.chunks, sample)
            sig = noise = 0.0
            min_sqnr = math.inf
            k_ok = 0
            sampled: list[dict[str, Any]] = []
            for layer in range(layers):
                for c in range(cache.chunks):
                    key = keys[layer, c]
                    try:
                        t0 = time.perf_counter()
                        view = st.get(key)
                        t1 = time.perf_counter()
                        d = decode(view, out_v_dtype=cache.dtype, expected_hashes=hashes, strict_hashes=True)
                        t2 = time.perf_counter()
                    except (CodecError, KeyError) as e:
                        failures.append(f"layer {layer} chunk {c} ({key}): {type(e).__name__}: {e}")
                        bar.update()
                        continue
                    t_get += t1 - t0
                    t_dec += t2 - t1
                    k, v = cache.chunk(layer, c)
                    if (d.header.layer_id, d.header.chunk_id) != (layer, c):
                        failures.append(
                            f"{key}: header says layer {d.header.layer_id} chunk {d.header.chunk_id}, "
                            f"expected layer {layer} chunk {c}"
                        )
                    if (
                        d.k is not None
                        and d.k.shape == k.shape
                        and d.k.dtype == k.dtype
                        and torch.equal(d.k.contiguous().view(torch.uint8), k.view(torch.uint8))
                    ):
                        k_ok += 1
                    else:
                        failures.append(f"layer {layer} chunk {c}: K is not bit-exact after the round trip")
                    ref = v.float()
                    err = d.v.float().sub_(ref)
                    s_ = float(torch.dot(ref.view(-1), ref.view(-1)))
                    n_ = float(torch.dot(err.view(-1), err.view(-1)))
                    sig += s_
                    noise += n_
                    if s_ > 0:
                        min_sqnr = min(min_sqnr, math.inf if n_ == 0 else 10 * math.log10(s_ / n_))
                    if (layer, c) in samples:
                        sq, mx, med = v_metrics(v, d.v)
                        sampled.append({
                            "layer": layer, "chunk": c, "sqnr_db": sq, "max_rel_err": mx,
                            "median_rel_err": med, "attn_rel_err": attention_error(v, d.v),
                        })  # fmt: skip
                    del d, view
                    bar.update()

        # ---- the hash gate must refuse another model's blob ---------------------
        gate_ok = False
        if keys:
            wrong = Hashes(**{**hashes.as_dict(), "model_id": "meta-llama/Meta-Llama-3-70B"})
            try:
                decode(st.get(keys[0, 0]), expected_hashes=wrong)
            except CodecMismatchError:
                gate_ok = True
            if not gate_ok:
                failures.append("hash gate: a blob of another model_id was accepted")
        st.close()
    finally:
        torch.set_num_threads(old_threads)
        if tmp_root is not None and not keep:
            shutil.rmtree(tmp_root, ignore_errors=True)

    sqnr = math.inf if noise == 0 else 10 * math.log10(sig / noise) if sig > 0 else 0.0
    if sqnr < min_sqnr_db:
        failures.append(f"V SQNR {sqnr:.2f} dB is below the floor of {min_sqnr_db} dB")
    if k_ok != n_blobs and not any("bit-exact" in f for f in failures):
        failures.append(f"only {k_ok} of {n_blobs} blobs gave K back bit for bit")
    hdr_bytes = blob_bytes - k_bytes - v_bytes - s_bytes
    wall = time.perf_counter() - t_wall

    def gbps(n: int, s: float) -> float | None:
        return n / s / 1e9 if s > 0 else None

    rel_max = max((s["max_rel_err"] for s in sampled), default=None)
    rel_med = statistics.median(s["median_rel_err"] for s in sampled) if sampled else None
    attn = [s["attn_rel_err"] for s in sampled]
    return {
        "model": hashes.model_id,
        "shape": {
            "layers": layers,
            "tokens": tokens,
            "chunk_tokens": chunk_tokens,
            "chunks": cache.chunks,
            "kv_heads": heads,
            "head_dim": head_dim,
            "page_size": page_size,
        },
        "scope": scope,
        "dtype": dtype,
        "threads": torch.get_num_threads() if threads is None else threads,
        "store": root if (tmp_root is None or keep) else None,
        "blobs": n_blobs,
        "bytes_before": raw_bytes,
        "bytes_after": blob_bytes,
        "ratio": blob_bytes / raw_bytes if raw_bytes else None,
        "bytes_breakdown": {"k": k_bytes, "v": v_bytes, "scales": s_bytes, "headers": hdr_bytes},
        "k_exact": k_ok,
        "hash_gate_ok": gate_ok,
        "v_sqnr_db": sqnr,
        "v_min_blob_sqnr_db": min_sqnr,
        "v_max_rel_err": rel_max,
        "v_median_rel_err": rel_med,
        "attn_rel_err_mean": statistics.fmean(attn) if attn else None,
        "attn_rel_err_max": max(attn) if attn else None,
        "sampled": sampled,
        "encode_s": t_enc,
        "decode_s": t_dec,
        "put_s": t_put,
        "get_s": t_get,
        "encode_gbps": gbps(raw_bytes, t_enc),
        "decode_gbps": gbps(blob_bytes, t_dec),
        "wall_s": wall,
        "passed": not failures,
        "failures": failures,
    }


def _fmt_bytes(n: int) -> str:
    return f"{n:,} B ({n / 2**20:.1f} MiB)"


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def format_demo(r: dict[str, Any]) -> str:
    """The report of :func:`run_demo` as a text table."""
    s = r["shape"]
    raw = r["bytes_before"] or 1
    b = r["bytes_breakdown"]
    dt = r["dtype"]
    n = r["blobs"]
    n_s = len(r["sampled"])
    rows = [
        ("blobs (layers x chunks)", f"{n} ({s['layers']} x {s['chunks']})"),
        (f"bytes before (K+V {dt})", _fmt_bytes(r["bytes_before"])),
        ("bytes after (blobs)", _fmt_bytes(r["bytes_after"])),
        ("ratio after/before", _fmt(r["ratio"], ".4f")),
        (
            "  of which K / V / scales / hdr",
            f"{b['k'] / raw:.4f} / {b['v'] / raw:.4f} / {b['scales'] / raw:.5f} / {b['headers'] / raw:.5f}",
        ),
        ("K bit-exact", f"{r['k_exact']}/{n}"),
        ("hash gate (wrong model_id)", "refused" if r["hash_gate_ok"] else "NOT REFUSED"),
        (
            "V SQNR, all blobs",
            f"{_fmt(r['v_sqnr_db'], '.2f')} dB (worst blob {_fmt(r['v_min_blob_sqnr_db'], '.2f')} dB)",
        ),
        (f"V max rel err ({n_s} blobs)", _fmt(r["v_max_rel_err"], ".4f")),
        (f"V median rel err ({n_s} blobs)", _fmt(r["v_median_rel_err"], ".4f")),
        (
            f"attention out rel err ({n_s})",
            f"mean {_fmt(r['attn_rel_err_mean'], '.5f')}, max {_fmt(r['attn_rel_err_max'], '.5f')}",
        ),
        ("encode throughput", f"{_fmt(r['encode_gbps'], '.2f')} GB/s of K+V in ({r['encode_s']:.2f} s)"),
        ("decode throughput", f"{_fmt(r['decode_gbps'], '.2f')} GB/s of blobs in ({r['decode_s']:.2f} s)"),
        ("store put / get", f"{r['put_s']:.2f} s / {r['get_s']:.2f} s"),
        ("wall time", f"{r['wall_s']:.2f} s ({r['threads']} torch thread{'s' if r['threads'] != 1 else ''})"),
        ("result", "PASS" if r["passed"] else "FAIL"),
    ]
    width = max(len(a) for a, _ in rows)
    title = (
        f"kvcodec demo: {r['model']}-shaped KV cache (synthetic), {s['layers']} layers x "
        f"{s['tokens']} tokens x {s['kv_heads']} KV heads x {s['head_dim']} dims, {dt}\n"
        f"scope {r['scope']}, page_size {s['page_size']}, {s['chunk_tokens']}-token chunks"
        + (f", store {r['store']}" if r["store"] else "")
    )
    lines = [title, "-" * (width + 40)]
    lines += [f"{a:<{width}}  {v}" for a, v in rows]
    return "\n".join(lines)
