"""``kvcodec tune``: time every launch config of each kernel on this GPU and keep the fastest correct one.

For given shapes (or a model preset such as ``llama-3-8b``) it runs the
codec's workloads (fused encode and decode of a chunk of all layers per
scope, the vLLM connector's fused gather+encode), and for every kernel they
launch tries each config of :func:`kvcodec.kernels.configs.config_space`:
the whole workload is run with that config and its output compared byte for
byte with the torch reference *before* the launch is timed with
``triton.testing.do_bench``. Winners go to a JSON tuning file keyed by GPU
name, Triton version, kernel and shape key (default: the user cache dir,
``--out`` to choose), which the launchers read at their first launch. No
serving process ever autotunes unless ``KVCODEC_AUTOTUNE=1``.

Without a GPU it says so and exits 2. ``--dry-run`` under
``TRITON_INTERPRET=1`` checks every config's correctness on tiny shapes
instead (no timing, no file).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PRESETS", "Shape", "TuneResult", "add_parser", "run", "tune"]


@dataclass(frozen=True)
class Shape:
    """A chunk shape to tune for."""

    layers: int = 32
    tokens: int = 256
    heads: int = 8
    dim: int = 128
    page_size: int = 16
    block_size: int = 16
    dtype: str = "float16"


PRESETS: dict[str, Shape] = {
    "llama-3-8b": Shape(32, 256, 8, 128),
    "llama-3-70b": Shape(80, 256, 8, 128),
    "mistral-7b": Shape(32, 256, 8, 128),
    "qwen2-7b": Shape(28, 256, 4, 128),
}
DRY_RUN_SHAPE = Shape(layers=2, tokens=12, heads=2, dim=32, page_size=4, block_size=4)
"""Tiny shape of ``--dry-run`` (the interpreter pays ~10 ms per program)."""


@dataclass
class _Case:
    """One workload: ``run`` launches (outputs kept in ``state``), ``ok`` compares with the reference."""

    name: str
    run: Callable[[], None]
    ok: Callable[[], bool]


@dataclass
class TuneResult:
    """The outcome for one (kernel, shape key)."""

    kernel: str
    key: str
    default: str
    best: str
    default_us: float | None
    best_us: float | None
    checked: int
    failed: list[str] = field(default_factory=list)


def _cases(shape: Shape, device: str) -> list[_Case]:
    """The workloads, their inputs on ``device`` and reference outputs computed once on CPU."""
    import torch

    from kvcodec.backends import reference as Q
    from kvcodec.format import ScaleScope
    from kvcodec.kernels import fused_triton, operands

    L, T, H, D, PS = shape.layers, shape.tokens, shape.heads, shape.dim, shape.page_size
    dt = getattr(torch, shape.dtype)
    g = torch.Generator().manual_seed(0)
    ks = torch.randn(L, T, H, D, generator=g).to(dt)
    vs = (torch.randn(L, T, H, D, generator=g) * 4).to(dt)
    kd, vd = ks.to(device), vs.to(device)

    def u8(x: torch.Tensor) -> torch.Tensor:
        return x.detach().reshape(-1).contiguous().view(torch.uint8).cpu()

    cases: list[_Case] = []
    for label, scope, ps in (
        ("per_page_head", ScaleScope.PER_PAGE_HEAD, PS),
        ("per_layer_head", ScaleScope.PER_LAYER_HEAD, None),
        ("per_tensor", ScaleScope.PER_TENSOR, None),
    ):
        scales = [Q.compute_scales(vs[i], scope, page_size=ps) for i in range(L)]
        qs = [Q.quantize(vs[i], scales[i], scope, page_size=ps) for i in range(L)]
        want = torch.stack([torch.cat([u8(ks[i]), u8(qs[i]), u8(scales[i])]) for i in range(L)])
        want_v = torch.stack(
            [u8(Q.dequantize(qs[i], scales[i], scope, page_size=ps, out_dtype=dt)) for i in range(L)]
        )
        pays = operands.empty_payloads(L, want.shape[1], device)
        src = operands.empty_payloads(L, want.shape[1], device)
        src.copy_(want.to(device))
        ko, vo = torch.empty_like(kd), torch.empty_like(vd)

        def enc(scope: ScaleScope = scope, ps: int | None = ps, pays: torch.Tensor = pays) -> None:
            pays.fill_(0xAB)
            fused_triton.encode_fused_layers(kd, vd, scope, page_size=ps, payloads=pays)

        def dec(
            scope: ScaleScope = scope,
            ps: int | None = ps,
            src: torch.Tensor = src,
            ko: torch.Tensor = ko,
            vo: torch.Tensor = vo,
        ) -> None:
            ko.zero_()
            vo.zero_()
            fused_triton.decode_fused_layers(src, ko, vo, scope, page_size=ps)

        cases.append(_Case(f"encode {label}", enc, lambda p=pays, w=want: torch.equal(p.cpu(), w)))
        cases.append(
            _Case(
                f"decode {label}",
                dec,
                lambda ko=ko, vo=vo, w=want_v: (
                    torch.equal(ko.cpu(), ks) and torch.equal(torch.stack([u8(vo[i]) for i in range(L)]), w)
                ),
            )
        )

    cases.append(_vllm_case(shape, device, g))
    return cases


def _vllm_case(shape: Shape, device: str, g: Any) -> _Case:
    """The vLLM connector's fused gather+encode (per_page_head) over per-layer ``[B, H, N, 2D]`` views."""
    import torch

    from kvcodec.backends import reference as Q
    from kvcodec.format import ScaleScope
    from kvcodec.kernels import operands, vllm_triton

    L, T, H, D, PS, BS = shape.layers, shape.tokens, shape.heads, shape.dim, shape.page_size, shape.block_size
    dt = getattr(torch, shape.dtype)
    need = -(-T // BS)
    nb = 4 * need + 3
    cache = (torch.randn(L, nb, H, BS, 2 * D, generator=g) * 4).to(dt)
    ids = torch.randperm(nb, generator=g)[:need].tolist()
    rows = [(ids[t // BS], t % BS) for t in range(T)]
    want = []
    for i in range(L):
        kv = torch.stack([cache[i, b, :, n] for b, n in rows])  # [T, H, 2D]
        k, v = kv[..., :D].contiguous(), kv[..., D:].contiguous()
        s = Q.compute_scales(v, ScaleScope.PER_PAGE_HEAD, page_size=PS)
        q = Q.quantize(v, s, ScaleScope.PER_PAGE_HEAD, page_size=PS)
        want.append(torch.cat([x.reshape(-1).contiguous().view(torch.uint8) for x in (k, q, s)]))
    want_t = torch.stack(want)
    views = vllm_triton.prepare_views(list(cache.to(device)), D)
    pays = operands.empty_payloads(L, want_t.shape[1], device)

    def enc() -> None:
        pays.fill_(0xAB)
        vllm_triton.gather_encode_layers(
            views, ids, num_tokens=T, head_size=D, scope=ScaleScope.PER_PAGE_HEAD, page_size=PS, payloads=pays
        )

    return _Case("vllm encode per_page_head", enc, lambda: torch.equal(pays.cpu(), want_t))


def _record(case: _Case, device: str) -> list[Any]:
    """The launches ``case`` makes, recorded (nothing runs) for the real target of ``device``."""
    import torch

    from kvcodec.kernels.launch import current_target, recording

    target = current_target(torch.device(device))
    with recording(target) as launches:
        case.run()
    return launches


def _progress(i: int, n: int, what: str) -> None:
    w = 30
    done = w * i // max(n, 1)
    print(f"\r[{'#' * done}{'.' * (w - done)}] {i}/{n} {what[:50]:<50}", end="", file=sys.stderr, flush=True)


def tune(shape: Shape, device: str, *, dry_run: bool = False, reps: int = 50) -> list[TuneResult]:
    """Sweep every (kernel, shape key) the workloads launch; returns one result per pair."""
    import torch

    from kvcodec.kernels import configs, tiles
    from kvcodec.kernels.launch import current_target

    configs.AUTOTUNE = False
    tgt = current_target(torch.device(device))
    plans: list[tuple[_Case, str, str, int, int]] = []
    seen: set[tuple[str, str]] = set()
    for case in _cases(shape, device):
        for ln in _record(case, device):
            kw = ln.kwargs
            name = next((n for n, (raw, _) in tiles.KERNELS.items() if raw is ln.kernel), None)
            if name is None or "BLOCK_T" not in kw:
                continue
            rows, bd = configs.rows_covered(kw), int(kw["BLOCK_D"])
            key = configs.shape_key(name, kw, rows)
            if (name, key) not in seen:
                seen.add((name, key))
                plans.append((case, name, key, rows, bd))
    total = sum(len(configs.config_space(p[3], p[4], p[1])) for p in plans)
    results: list[TuneResult] = []
    step = 0
    for case, name, key, rows, bd in plans:
        default = configs.heuristic(rows, bd, tgt.interpret)
        timings: dict[configs.TileConfig, float | None] = {}
        failed: list[str] = []
        for cfg in configs.config_space(rows, bd, name):
            step += 1
            _progress(step, total, f"{name} {key}")
            with configs.override(name, cfg):
                try:
                    case.run()
                    good = case.ok()
                except Exception as e:  # a config that fails to compile or launch is not a winner
                    good = False
                    failed.append(f"{cfg}: {type(e).__name__}: {str(e)[:200]}")
                if not good:
                    if not failed or not failed[-1].startswith(str(cfg)):
                        failed.append(f"{cfg}: output differs from the reference")
                    continue
            if dry_run:
                timings[cfg] = None
                continue
            timings[cfg] = _time_launch(case, name, cfg, device, reps)
        timed = {c: t for c, t in timings.items() if t is not None}
        best = min(timed, key=lambda c: timed[c], default=None)
        results.append(
            TuneResult(
                kernel=name,
                key=key,
                default=_fmt(default),
                best=_fmt(best) if best else "-",
                default_us=timed.get(default),
                best_us=timed.get(best) if best else None,
                checked=len(timings),
                failed=failed,
            )
        )
    print(file=sys.stderr)
    return results


def _time_launch(case: _Case, name: str, cfg: Any, device: str, reps: int) -> float:
    """Microseconds of ``name``'s launch in ``case`` with ``cfg`` (re-recorded to get its grid and arguments)."""
    import triton

    from kvcodec.kernels import configs, tiles
    from kvcodec.kernels.launch import launch

    with configs.override(name, cfg):
        lns = [ln for ln in _record(case, device) if ln.kernel is tiles.KERNELS[name][0]]
    ln = lns[0]
    return float(triton.testing.do_bench(lambda: launch(ln.kernel, ln.grid, ln.kwargs), rep=reps)) * 1e3


def _fmt(c: Any) -> str:
    return f"{c.block_t}x/{c.num_warps}w"


def format_results(results: Sequence[TuneResult], dry_run: bool) -> str:
    """Best vs default per (kernel, shape key)."""
    head = f"{'kernel':<22} {'shape key':<44} {'default':>9} {'us':>8} {'best':>9} {'us':>8} {'speedup':>7} {'checked':>7}"
    lines = [head, "-" * len(head)]
    for r in results:
        sp = f"{r.default_us / r.best_us:.2f}x" if r.default_us and r.best_us else "-"
        du = f"{r.default_us:.1f}" if r.default_us else "-"
        bu = f"{r.best_us:.1f}" if r.best_us else "-"
        lines.append(
            f"{r.kernel.strip('_'):<22} {r.key:<44} {r.default:>9} {du:>8} {r.best:>9} {bu:>8} {sp:>7} "
            f"{r.checked:>7}"
        )
        lines += [f"    FAILED {f}" for f in r.failed]
    return "\n".join(lines)


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", choices=sorted(PRESETS), default=None, help="shape preset (default llama-3-8b)")
    p.add_argument("--layers", type=int)
    p.add_argument("--tokens", type=int, help="tokens per chunk")
    p.add_argument("--heads", type=int, help="KV heads")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--page-size", type=int)
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default=None)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="tuning file (default: $KVCODEC_TUNING_FILE or the user cache dir)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check every config's output on tiny shapes, no timing, no file (CPU: TRITON_INTERPRET=1)",
    )
    p.add_argument("--reps", type=int, default=50, help="do_bench milliseconds per config")
    return p


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``tune`` on the ``kvcodec`` CLI's subparsers (``func`` = :func:`run`)."""
    p = subparsers.add_parser(
        "tune",
        help="tune the Triton kernels' launch configs on this GPU",
        description=__doc__.split("\n\n")[0],
    )
    _configure(p)
    p.set_defaults(func=run)
    return p


def _shape(args: argparse.Namespace) -> Shape:
    base = DRY_RUN_SHAPE if args.dry_run and args.model is None else PRESETS[args.model or "llama-3-8b"]
    over = {
        "layers": args.layers,
        "tokens": args.tokens,
        "heads": args.heads,
        "dim": args.head_dim,
        "page_size": args.page_size,
        "dtype": args.dtype,
    }
    return Shape(**{**base.__dict__, **{k: v for k, v in over.items() if v is not None}})


def run(args: argparse.Namespace) -> int:
    """Run ``kvcodec tune``; 0 when every config ran and a winner was written, 1 on failures, 2 if it cannot run."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        print("kvcodec tune: triton is not installed", file=sys.stderr)
        return 2
    import torch

    from kvcodec.kernels.launch import INTERPRET

    if args.dry_run:
        if not INTERPRET and not torch.cuda.is_available():
            print(
                "kvcodec tune --dry-run: no CUDA GPU; set TRITON_INTERPRET=1 to check the configs on CPU",
                file=sys.stderr,
            )
            return 2
        device = "cpu" if INTERPRET else "cuda"
    else:
        if INTERPRET or not torch.cuda.is_available():
            why = (
                "TRITON_INTERPRET is set"
                if INTERPRET
                else "no CUDA GPU is visible (torch.cuda.is_available() is False)"
            )
            print(
                f"kvcodec tune needs a CUDA GPU to time kernels: {why}. "
                "Use --dry-run (with TRITON_INTERPRET=1 on CPU) to check every config's correctness.",
                file=sys.stderr,
            )
            return 2
        device = "cuda"
    shape = _shape(args)
    print(f"kvcodec tune: {shape} on {device}{' (dry run)' if args.dry_run else ''}", file=sys.stderr)
    results = tune(shape, device, dry_run=args.dry_run, reps=args.reps)
    print(format_results(results, args.dry_run))
    bad = [r for r in results if r.failed]
    if args.dry_run:
        print(
            f"dry run: {sum(r.checked for r in results)} configs correct, "
            f"{sum(len(r.failed) for r in results)} failed"
        )
        return 1 if bad else 0
    import triton

    from kvcodec.kernels import configs

    path = args.out or configs.default_tuning_path()
    table = configs.TuningTable.load(path)
    gpu = torch.cuda.get_device_name()
    for r in results:
        if r.best_us is None:
            continue
        bt, nw = r.best.split("x/")
        table.put(
            gpu,
            triton.__version__,
            r.kernel,
            r.key,
            configs.TileConfig(int(bt), int(nw.rstrip("w"))),
            us=round(r.best_us, 2),
            default_us=round(r.default_us or 0.0, 2),
        )
    table.save(path)
    configs.reload_tuning()
    print(f"wrote {len(table)} entries to {path}")
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = _configure(
        argparse.ArgumentParser(prog="python -m kvcodec.tools.tune", description=__doc__.split("\n\n")[0])
    )
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
