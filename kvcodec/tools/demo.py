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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..codec import decode, encode
from ..errors import CodecError, CodecMismatchError, Reason, UnsupportedConfigError
from ..format import MAX_DIM, SCOPE_NAMES, Hashes, ScaleScope, parse
from ..store import DirectoryStore
from .progress import Progress, progress_enabled
from .quality import attention_error, v_metrics

__all__ = [
    "MAX_CHUNK_ELEMENTS",
    "MODEL_HASHES",
    "SCOPES",
    "DemoConfig",
    "SyntheticKVCache",
    "format_demo",
    "run_demo",
]

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
SCOPES = tuple(name for name, scope in SCOPE_NAMES.items() if scope != ScaleScope.EXTERNAL)
"""The scopes the demo can run (external needs scales it has no source for)."""


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
        self.hashes = MODEL_HASHES
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


@dataclass(frozen=True)
class DemoConfig:
    """What :func:`run_demo` runs: the cache's shape, how it is encoded and stored, the pass bar."""

    layers: int = 32
    tokens: int = 2048
    chunk_tokens: int = 256
    heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    scope: str = "per_page_head"
    dtype: str = "fp16"
    """K/V dtype of the cache: "fp16" or "bf16"."""
    store: str | os.PathLike[str] | None = None
    """Store folder; None uses a temp folder, removed at the end unless ``keep``."""
    keep: bool = False
    seed: int = 0
    sample: int = 8
    """Blobs to measure attention error on."""
    fsync: bool = False
    threads: int | None = 1
    """torch CPU threads for the run (1: the per-chunk work is small, more threads only contend)."""
    min_sqnr_db: float = 20.0
    """The run fails if V's SQNR over all blobs is below this (a finite number)."""
    progress: bool | None = None
    version: int = 2
    """Header version of the blobs: 2 (sealed) by default, 1 for LMCache-readable ones."""
    model: str | os.PathLike[str] | None = None
    """A checkpoint folder or .gguf file: real KV from a forward pass over ``text`` (the quality extra)."""
    text: str | os.PathLike[str] | None = None
    """The text the model reads (its first ``tokens`` tokens); needed with ``model``."""

    def validate(self) -> None:
        """Raise :class:`UnsupportedConfigError` for a setting the demo cannot run."""
        if self.scope not in SCOPES:
            raise UnsupportedConfigError(
                f"scope must be one of {list(SCOPES)}; got {self.scope!r}", reason=Reason.BAD_SCOPE
            )
        if self.dtype not in _DTYPES:
            raise UnsupportedConfigError(
                f"dtype must be one of {sorted(_DTYPES)}; got {self.dtype!r}", reason=Reason.UNSUPPORTED_DTYPE
            )
        for name in ("layers", "tokens", "chunk_tokens", "heads", "head_dim", "page_size"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise UnsupportedConfigError(
                    f"{name} must be an integer >= 1; got {val!r}", reason=Reason.BAD_VALUE
                )
        if self.page_size > MAX_DIM:
            raise UnsupportedConfigError(
                f"page_size {self.page_size} is above the format's limit {MAX_DIM}",
                reason=Reason.LIMIT_EXCEEDED,
            )
        chunk = min(self.chunk_tokens, self.tokens) * self.heads * self.head_dim
        if chunk > MAX_CHUNK_ELEMENTS:
            raise UnsupportedConfigError(
                f"one chunk of {chunk:,} K (or V) elements is too large (at most {MAX_CHUNK_ELEMENTS:,})",
                reason=Reason.LIMIT_EXCEEDED,
            )
        if isinstance(self.min_sqnr_db, bool) or not isinstance(self.min_sqnr_db, (int, float)):
            raise UnsupportedConfigError(
                f"min_sqnr_db must be a number; got {self.min_sqnr_db!r}", reason=Reason.BAD_TYPE
            )
        if not math.isfinite(self.min_sqnr_db):
            raise UnsupportedConfigError(
                f"min_sqnr_db must be finite; got {self.min_sqnr_db!r}", reason=Reason.BAD_VALUE
            )
        if self.version not in (1, 2):
            raise UnsupportedConfigError(
                f"version must be 1 or 2; got {self.version!r}", reason=Reason.UNSUPPORTED_VERSION
            )
        if (self.model is None) != (self.text is None):
            raise UnsupportedConfigError("model and text go together", reason=Reason.MISSING_ARGUMENT)

    def cache(self) -> Any:
        """The cache this config describes: synthetic, or a real model's over ``text``."""
        if self.model is not None:
            from .realmodel import ModelKVCache

            return ModelKVCache.from_text(
                self.model,
                self.text,
                tokens=self.tokens,
                chunk_tokens=self.chunk_tokens,
                dtype=_DTYPES[self.dtype],
            )
        return SyntheticKVCache(
            layers=self.layers,
            tokens=self.tokens,
            chunk_tokens=self.chunk_tokens,
            heads=self.heads,
            head_dim=self.head_dim,
            dtype=_DTYPES[self.dtype],
            seed=self.seed,
        )


MAX_CHUNK_ELEMENTS = 1 << 26
"""Most K (or V) elements in one generated chunk (the demo holds about six such tensors at once)."""


@dataclass
class _Tally:
    """What the write and read passes measure."""

    raw_bytes: int = 0
    blob_bytes: int = 0
    k_bytes: int = 0
    v_bytes: int = 0
    s_bytes: int = 0
    t_enc: float = 0.0
    t_dec: float = 0.0
    t_put: float = 0.0
    t_get: float = 0.0
    sig: float = 0.0
    noise: float = 0.0
    min_sqnr: float = math.inf
    k_ok: int = 0
    gate_ok: bool = False
    sampled: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    keys: dict[tuple[int, int], str] = field(default_factory=dict)


# ------------------------------------------------------------------------------ write pass


def _put_chunk(
    cfg: DemoConfig, cache: SyntheticKVCache, st: DirectoryStore, t: _Tally, layer: int, c: int
) -> None:
    """Generate, encode and store one (layer, chunk)."""
    k, v = cache.chunk(layer, c)
    t0 = time.perf_counter()
    blob = encode(
        k,
        v,
        scope=cfg.scope,
        page_size=cfg.page_size,
        hashes=cache.hashes,
        layer_id=layer,
        chunk_id=c,
        chunk_size=cfg.chunk_tokens,
        version=cfg.version,
    )
    t1 = time.perf_counter()
    key = DirectoryStore.make_key(cache.hashes, layer, c)
    st.put(key, blob)
    t.t_put += time.perf_counter() - t1
    t.t_enc += t1 - t0
    t.keys[layer, c] = key
    kb, vb = k.numel() * k.element_size(), v.numel() * v.element_size()
    t.raw_bytes += kb + vb
    t.blob_bytes += len(blob)
    t.k_bytes += kb
    t.v_bytes += v.numel()
    t.s_bytes += parse(blob, verify_crc=False).header.scale_payload_len


def _write_pass(
    cfg: DemoConfig, cache: SyntheticKVCache, st: DirectoryStore, t: _Tally, bar: Progress
) -> None:
    for layer in range(cfg.layers):
        for c in range(cache.chunks):
            _put_chunk(cfg, cache, st, t, layer, c)
            bar.update()


# ------------------------------------------------------------------------------ read pass


def _k_exact(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return (
        got is not None
        and got.shape == want.shape
        and got.dtype == want.dtype
        and torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8))
    )


def _measure_v(t: _Tally, v: torch.Tensor, v_hat: torch.Tensor) -> None:
    """Add V's signal and error energy to the tally; track the worst blob."""
    ref = v.float()
    err = v_hat.float().sub_(ref)
    s_ = float(torch.dot(ref.view(-1), ref.view(-1)))
    n_ = float(torch.dot(err.view(-1), err.view(-1)))
    t.sig += s_
    t.noise += n_
    if s_ > 0:
        t.min_sqnr = min(t.min_sqnr, math.inf if n_ == 0 else 10 * math.log10(s_ / n_))


def _sample(t: _Tally, layer: int, c: int, v: torch.Tensor, v_hat: torch.Tensor) -> None:
    sq, mx, med = v_metrics(v, v_hat)
    t.sampled.append(
        {
            "layer": layer,
            "chunk": c,
            "sqnr_db": sq,
            "max_rel_err": mx,
            "median_rel_err": med,
            "attn_rel_err": attention_error(v, v_hat),
        }
    )


def _check_chunk(
    cache: SyntheticKVCache, st: DirectoryStore, t: _Tally, layer: int, c: int, sample: bool
) -> None:
    """Read one (layer, chunk) back through the hash gate and compare it with the regenerated tensors."""
    key = t.keys[layer, c]
    try:
        t0 = time.perf_counter()
        view = st.get(key)
        t1 = time.perf_counter()
        d = decode(view, out_v_dtype=cache.dtype, expected_hashes=cache.hashes, strict_hashes=True)
        t2 = time.perf_counter()
    except (CodecError, KeyError) as e:
        t.failures.append(f"layer {layer} chunk {c} ({key}): {type(e).__name__}: {e}")
        return
    t.t_get += t1 - t0
    t.t_dec += t2 - t1
    k, v = cache.chunk(layer, c)
    if (d.header.layer_id, d.header.chunk_id) != (layer, c):
        t.failures.append(
            f"{key}: header says layer {d.header.layer_id} chunk {d.header.chunk_id}, "
            f"expected layer {layer} chunk {c}"
        )
    if _k_exact(d.k, k):
        t.k_ok += 1
    else:
        t.failures.append(f"layer {layer} chunk {c}: K is not bit-exact after the round trip")
    _measure_v(t, v, d.v)
    if sample:
        _sample(t, layer, c, v, d.v)


def _read_pass(
    cfg: DemoConfig, cache: SyntheticKVCache, st: DirectoryStore, t: _Tally, bar: Progress
) -> None:
    samples = _sample_pairs(cfg.layers, cache.chunks, cfg.sample)
    for layer in range(cfg.layers):
        for c in range(cache.chunks):
            _check_chunk(cache, st, t, layer, c, (layer, c) in samples)
            bar.update()


def _check_gate(st: DirectoryStore, t: _Tally, hashes: Hashes) -> None:
    """The hash gate must refuse a blob when another model's identity is expected."""
    if not t.keys:
        return
    wrong = Hashes(**{**hashes.as_dict(), "model_id": hashes.model_id + "-other"})
    try:
        decode(st.get(t.keys[0, 0]), expected_hashes=wrong)
    except CodecMismatchError:
        t.gate_ok = True
    if not t.gate_ok:
        t.failures.append("hash gate: a blob of another model_id was accepted")


# ------------------------------------------------------------------------------ the run


@contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextmanager
def _store_root(cfg: DemoConfig) -> Iterator[tuple[str, bool]]:
    """The store folder and whether it is a temp folder (removed on exit unless ``keep``)."""
    if cfg.store is not None:
        yield os.fspath(cfg.store), False
        return
    root = tempfile.mkdtemp(prefix="kvcodec-demo-")
    try:
        yield root, True
    finally:
        if not cfg.keep:
            shutil.rmtree(root, ignore_errors=True)


def _run_passes(cfg: DemoConfig, cache: SyntheticKVCache, root: str) -> _Tally:
    t = _Tally()
    n_blobs = cfg.layers * cache.chunks
    with DirectoryStore(root, fsync=cfg.fsync) as st:
        with Progress(
            2 * n_blobs, "encode+store", enabled=progress_enabled(cfg.progress), unit="blob"
        ) as bar:
            _write_pass(cfg, cache, st, t, bar)
            bar.set_description("read+verify")
            _read_pass(cfg, cache, st, t, bar)
        _check_gate(st, t, cache.hashes)
    return t


def run_demo(config: DemoConfig | None = None, **options: Any) -> dict[str, Any]:
    """Encode a synthetic cache into a store, read it back, and report.

    ``options`` are :class:`DemoConfig` fields (applied over ``config``).
    Returns a JSON-friendly dict; ``passed`` is False (with ``failures``) if any
    K differs by a bit, a blob fails to decode or carries wrong ids, the hash
    gate lets a wrong model through, or V's SQNR falls below ``min_sqnr_db``.
    """
    try:
        cfg = replace(config or DemoConfig(), **options)
    except TypeError as e:
        raise UnsupportedConfigError(f"unknown demo option: {e}", reason=Reason.BAD_VALUE) from None
    cfg.validate()
    t_wall = time.perf_counter()
    cache = cfg.cache()
    cfg = replace(cfg, layers=cache.layers, tokens=cache.tokens, heads=cache.heads, head_dim=cache.head_dim)
    with _torch_threads(cfg.threads), _store_root(cfg) as (root, is_temp):
        t = _run_passes(cfg, cache, root)
    kept = root if (not is_temp or cfg.keep) else None
    return _report(cfg, cache, t, kept, time.perf_counter() - t_wall)


def _final_checks(cfg: DemoConfig, t: _Tally, n_blobs: int, sqnr: float) -> None:
    if sqnr < cfg.min_sqnr_db:
        t.failures.append(f"V SQNR {sqnr:.2f} dB is below the floor of {cfg.min_sqnr_db} dB")
    if t.k_ok != n_blobs and not any("bit-exact" in f for f in t.failures):
        t.failures.append(f"only {t.k_ok} of {n_blobs} blobs gave K back bit for bit")


def _gbps(n: int, s: float) -> float | None:
    return n / s / 1e9 if s > 0 else None


def _report(
    cfg: DemoConfig, cache: SyntheticKVCache, t: _Tally, store: str | None, wall: float
) -> dict[str, Any]:
    n_blobs = cfg.layers * cache.chunks
    sqnr = math.inf if t.noise == 0 else 10 * math.log10(t.sig / t.noise) if t.sig > 0 else 0.0
    _final_checks(cfg, t, n_blobs, sqnr)
    attn = [s["attn_rel_err"] for s in t.sampled]
    return {
        "model": cache.hashes.model_id,
        "source": "synthetic" if cfg.model is None else f"forward pass over {os.path.basename(cfg.text)}",
        "shape": {
            "layers": cfg.layers,
            "tokens": cfg.tokens,
            "chunk_tokens": cfg.chunk_tokens,
            "chunks": cache.chunks,
            "kv_heads": cfg.heads,
            "head_dim": cfg.head_dim,
            "page_size": cfg.page_size,
        },
        "scope": cfg.scope,
        "dtype": cfg.dtype,
        "version": cfg.version,
        "threads": torch.get_num_threads() if cfg.threads is None else cfg.threads,
        "store": store,
        "blobs": n_blobs,
        "bytes_before": t.raw_bytes,
        "bytes_after": t.blob_bytes,
        "ratio": t.blob_bytes / t.raw_bytes if t.raw_bytes else None,
        "bytes_breakdown": {
            "k": t.k_bytes,
            "v": t.v_bytes,
            "scales": t.s_bytes,
            "headers": t.blob_bytes - t.k_bytes - t.v_bytes - t.s_bytes,
        },
        "k_exact": t.k_ok,
        "hash_gate_ok": t.gate_ok,
        "v_sqnr_db": sqnr,
        "v_min_blob_sqnr_db": t.min_sqnr,
        "v_max_rel_err": max((s["max_rel_err"] for s in t.sampled), default=None),
        "v_median_rel_err": statistics.median(s["median_rel_err"] for s in t.sampled) if t.sampled else None,
        "attn_rel_err_mean": statistics.fmean(attn) if attn else None,
        "attn_rel_err_max": max(attn) if attn else None,
        "sampled": t.sampled,
        "encode_s": t.t_enc,
        "decode_s": t.t_dec,
        "put_s": t.t_put,
        "get_s": t.t_get,
        "encode_gbps": _gbps(t.raw_bytes, t.t_enc),
        "decode_gbps": _gbps(t.blob_bytes, t.t_dec),
        "wall_s": wall,
        "passed": not t.failures,
        "failures": t.failures,
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
    source = r.get("source", "synthetic")
    what = (
        f"{r['model']}-shaped KV cache (synthetic)"
        if source == "synthetic"
        else f"{r['model']} KV ({source})"
    )
    title = (
        f"kvcodec demo: {what}, {s['layers']} layers x "
        f"{s['tokens']} tokens x {s['kv_heads']} KV heads x {s['head_dim']} dims, {dt}\n"
        f"scope {r['scope']}, page_size {s['page_size']}, {s['chunk_tokens']}-token chunks, "
        f"header v{r.get('version', 1)}" + (f", store {r['store']}" if r["store"] else "")
    )
    lines = [title, "-" * (width + 40)]
    lines += [f"{a:<{width}}  {v}" for a, v in rows]
    return "\n".join(lines)
