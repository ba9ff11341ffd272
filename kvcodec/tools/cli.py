"""The ``kvcodec`` command line: inspect, verify, encode, decode, quality, demo.

Every failure ends as one ``kvcodec: error: ...`` line on stderr and a
non-zero exit status (2 for usage errors, 1 for bad blobs and other
failures), never a traceback (set ``KVCODEC_DEBUG=1`` to get one).
Heavy modules (torch, numpy, safetensors, tqdm) are imported only by the
commands that need them, so ``kvcodec --help`` is fast.
"""

from __future__ import annotations

import argparse
import errno
import fnmatch
import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, NoReturn

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "CLIError",
    "Progress",
    "build_parser",
    "main",
    "progress_enabled",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

PROG = "kvcodec"

# The six identity hashes, in kvcodec.format.HASH_KEYS order (kept here so that
# building the parser needs no torch import; tests check the two agree).
HASH_KEYS: tuple[str, ...] = (
    "model_id",
    "model_revision_hash",
    "tokenizer_hash",
    "rope_config_hash",
    "attention_backend",
    "kv_layout",
)

SCOPES = ("per_page_head", "per_tensor", "per_layer_head", "external", "raw")
DTYPE_NAMES = ("fp16", "bf16", "fp32")


class CLIError(Exception):
    """A failure to report as one line; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


class _UsageError(Exception):
    """Raised by the parser instead of exiting (carries argparse's message)."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line and never exit the interpreter."""

    def error(self, message: str) -> NoReturn:
        hint = f" (see '{self.prog} --help')"
        raise _UsageError(f"{message}{hint}")


# ----------------------------------------------------------------------------
# Progress bars
# ----------------------------------------------------------------------------


def progress_enabled(flag: bool | None, stream: IO[str] | None = None) -> bool:
    """Whether to draw a bar: ``flag`` if given, else whether stderr is a terminal."""
    if flag is not None:
        return flag
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """A tqdm bar on stderr when enabled and installed, else a no-op.

    ``write`` prints a line without tearing the bar.
    """

    def __init__(self, total: int | None, desc: str, *, enabled: bool, unit: str = "blob") -> None:
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is an optional dependency
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(
                    total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True
                )

    @property
    def active(self) -> bool:
        """Whether a bar is being drawn."""
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` steps."""
        if self._bar is not None:
            self._bar.update(n)

    def set_description(self, desc: str) -> None:
        """Change the bar's label."""
        if self._bar is not None:
            self._bar.set_description(desc, refresh=False)

    def write(self, line: str, file: IO[str] | None = None) -> None:
        """Print ``line`` (to stdout by default) above the bar."""
        out = file if file is not None else sys.stdout
        if self._bar is not None:
            self._bar.write(line, file=out)
        else:
            print(line, file=out)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# ----------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------


def _human(n: float) -> str:
    """Bytes as ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _bytes_str(n: int) -> str:
    return f"{n:,} ({_human(n)})" if n >= 1024 else f"{n:,}"


def _read_regular(path: Path) -> bytes:
    """A regular file's bytes; anything else (FIFO, device, socket) raises OSError, never blocks."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def _read_file(path: Path) -> bytes:
    """The file's bytes; a directory, a missing or a non-regular file raises CLIError."""
    if path.is_dir():
        raise CLIError(f"{path}: is a directory")
    try:
        return _read_regular(path)
    except FileNotFoundError:
        raise CLIError(f"{path}: no such file") from None
    except OSError as e:
        raise CLIError(f"{path}: {e.strerror or e}") from None


def _require_files(paths: Iterable[Path], *, allow_dirs: bool = False) -> None:
    """Refuse missing inputs (and directories unless allowed) before any work."""
    for p in paths:
        if not p.exists():
            raise CLIError(f"{p}: no such file or directory")
        if p.is_dir() and not allow_dirs:
            raise CLIError(f"{p}: is a directory")


def _write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through a temp file in its folder, renamed into place when complete."""
    if not path.name or path.is_dir():
        raise CLIError(f"{path}: is a directory, not an output file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise CLIError(f"{path}: folder {parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _hashes_from(args: argparse.Namespace, prefix: str) -> dict[str, str]:
    """The hash options given (``prefix`` is "" for encode, "expect_" for checks)."""
    out = {}
    for key in HASH_KEYS:
        val = getattr(args, prefix + key, None)
        if val:
            out[key] = val
    return out


def _dtype(name: str | None) -> Any:
    import torch

    return {None: None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------
# inspect
# ----------------------------------------------------------------------------


def _inspect_one(path: Path) -> dict[str, Any]:
    """Header fields, CRC status and sizes of one blob, or ``{"file", "error"}``."""
    from .errors import CodecError
    from .format import MAGIC, header_fields, parse, payload_crc

    info: dict[str, Any] = {"file": str(path)}
    try:
        data = _read_file(path)
    except CLIError as e:
        info["error"] = str(e).removeprefix(f"{path}: ")
        return info
    except OSError as e:
        info["error"] = e.strerror or str(e)
        return info
    info["file_size"] = len(data)
    try:
        parsed = parse(data, verify_crc=False)
    except CodecError as e:
        info["error"] = str(e)
        return info
    h = parsed.header
    crc = payload_crc(h, parsed.buffer[: parsed.header_len - 4], (parsed.payload,))
    info["magic"] = MAGIC.decode("latin-1").encode("unicode_escape").decode("ascii")
    info.update(header_fields(h))
    info["tokens"] = h.num_tokens
    info["header_len"] = parsed.header_len
    info["payload_len"] = h.payload_len
    info["trailing_bytes"] = parsed.trailing
    info["unknown_hashes"] = dict(parsed.unknown_hashes)
    info["crc"] = f"{parsed.crc:#010x}"
    info["crc_computed"] = f"{crc:#010x}"
    info["crc_ok"] = crc == parsed.crc
    return info


_INSPECT_ROWS: tuple[tuple[str, str], ...] = (
    ("magic", "magic"),
    ("version", "version"),
    ("scale_scope", "scope"),
    ("scale_scheme", "scale scheme"),
    ("k_dtype", "K dtype"),
    ("v_dtype", "V dtype"),
    ("scale_dtype", "scale dtype"),
    ("layer_id", "layer id"),
    ("chunk_id", "chunk id"),
    ("chunk_size", "chunk size"),
    ("tokens", "tokens held"),
    ("page_size", "page size"),
    ("kv_head_count", "KV heads"),
    ("head_dim", "head dim"),
    ("scale_shape", "scale shape"),
    ("k_payload_len", "K bytes"),
    ("v_payload_len", "V bytes"),
    ("scale_payload_len", "scale bytes"),
    ("header_len", "header bytes"),
    ("file_size", "file bytes"),
    ("trailing_bytes", "trailing bytes"),
)


def _inspect_table(info: dict[str, Any]) -> str:
    lines = [f"== {info['file']}"]
    if "error" in info:
        lines.append(f"  error: {info['error']}")
        return "\n".join(lines)
    rows: list[tuple[str, str]] = []
    for key, label in _INSPECT_ROWS:
        val = info.get(key)
        if key == "scale_shape":
            text = "(" + ", ".join(str(d) for d in val) + ("," if len(val) == 1 else "") + ")"
        elif key.endswith(("_len", "_size", "_bytes")) and isinstance(val, int) and val >= 0:
            text = _bytes_str(val)
        elif key in ("layer_id", "chunk_id", "chunk_size", "page_size", "kv_head_count", "head_dim"):
            text = "unset (-1)" if val == -1 else str(val)
        elif val is None:
            text = "unknown"
        else:
            text = str(val)
        if key == "scale_scheme" and info.get("version") == 1:
            text += " (v1: implied)"
        rows.append((label, text))
    for key, val in info["hashes"].items():
        rows.append((f"hash {key}", val if val else "-"))
    for key, val in info["unknown_hashes"].items():
        rows.append((f"hash {key} (unknown)", val if val else "-"))
    crc = info["crc"] + ("  ok" if info["crc_ok"] else f"  BAD (payload gives {info['crc_computed']})")
    rows.append(("CRC", crc))
    width = max(len(r[0]) for r in rows)
    lines += [f"  {label:<{width}}  {text}" for label, text in rows]
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Show each blob's header; exit 1 if any file is unreadable, malformed or fails its CRC."""
    paths = [Path(p) for p in args.files]
    _require_files(paths)
    infos = [_inspect_one(p) for p in paths]
    if args.json:
        print(json.dumps(infos[0] if len(infos) == 1 else infos, indent=2))
    else:
        print("\n\n".join(_inspect_table(i) for i in infos))
    bad = [i for i in infos if "error" in i or not i["crc_ok"]]
    return EXIT_FAILURE if bad else EXIT_OK


# ----------------------------------------------------------------------------
# verify
# ----------------------------------------------------------------------------


def _walk(root: Path, pattern: str = "*") -> Iterator[Path]:
    """Files under ``root`` whose name matches ``pattern``, sorted, skipping hidden files and
    folders (e.g. ``.quarantine`` and a store's temp files)."""
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise_walk_error):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if not name.startswith(".") and fnmatch.fnmatchcase(name, pattern) and _is_regular(p):
                yield p


def _is_regular(p: Path) -> bool:
    """Only regular files are blobs: a FIFO or device in a tree must not hang a walk."""
    try:
        return stat.S_ISREG(os.stat(p).st_mode)
    except OSError:
        return True  # let the read report why it cannot be read


def _raise_walk_error(e: OSError) -> None:
    raise e


def _collect(paths: Sequence[Path], pattern: str = "*") -> tuple[list[Path], bool]:
    """Files to verify, and whether any directory was given."""
    files: list[Path] = []
    seen: set[str] = set()
    any_dir = False
    for p in paths:
        if p.is_dir():
            any_dir = True
            found: Iterable[Path] = _walk(p, pattern)
        else:
            found = (p,)
        for f in found:
            real = os.path.realpath(f)
            if real not in seen:  # a file named twice (or inside a named folder) is checked once
                seen.add(real)
                files.append(f)
    return files, any_dir


def _verify_one(path: Path, args: argparse.Namespace, expected: dict[str, str]) -> str | None:
    """None if ``path`` holds a good blob, else why not."""
    from .codec import check_hashes
    from .errors import CodecError
    from .format import parse

    try:
        data = _read_regular(path)
    except OSError as e:
        return e.strerror or str(e)
    try:
        parsed = parse(data, verify_crc=True, strict=args.strict)
        if expected or args.strict_hashes:
            check_hashes(parsed.header.hashes, expected, strict=args.strict_hashes)
    except CodecError as e:
        return f"{type(e).__name__}: {e}"
    return None


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every blob; print bad ones and a summary; exit 1 if any is bad."""
    paths = [Path(p) for p in args.paths]
    _require_files(paths, allow_dirs=True)
    files, any_dir = _collect(paths, args.glob)
    expected = _hashes_from(args, "expect_")
    ok = bad = 0
    with Progress(len(files), "verify", enabled=any_dir and progress_enabled(args.progress)) as bar:
        for f in files:
            err = _verify_one(f, args, expected)
            if err is None:
                ok += 1
                if args.verbose:
                    bar.write(f"{f}: ok")
            else:
                bad += 1
                bar.write(f"{f}: {err}")
            bar.update()
    if not files:
        print(f"{PROG}: warning: no blobs found under {', '.join(map(str, paths))}", file=sys.stderr)
    print(f"verified {ok + bad} blobs: {ok} ok, {bad} bad")
    return EXIT_FAILURE if bad else EXIT_OK


# ----------------------------------------------------------------------------
# encode / decode
# ----------------------------------------------------------------------------


def _load_npy(path: Path) -> Any:
    import numpy as np
    import torch

    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        if isinstance(e, FileNotFoundError):
            raise CLIError(f"{path}: no such file") from None
        raise CLIError(f"{path}: not a valid .npy file ({e})") from None
    if not isinstance(arr, np.ndarray):
        raise CLIError(f"{path}: holds several arrays (.npz); give a .npy file or a .safetensors file")
    if arr.dtype.byteorder not in ("=", "|") and arr.dtype.byteorder != sys.byteorder[0]:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(arr)
    except TypeError as e:
        raise CLIError(f"{path}: dtype {arr.dtype} is not supported: {e}") from None


def _load_safetensors(path: Path, names: Sequence[str], *, optional: Sequence[str] = ()) -> dict[str, Any]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise CLIError(
            "reading .safetensors needs the 'safetensors' package (pip install safetensors)"
        ) from None
    out: dict[str, Any] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            have = list(f.keys())
            for name in names:
                if name not in have:
                    raise CLIError(
                        f"{path}: no tensor named {name!r} (it holds: {', '.join(have) or 'none'})"
                    )
                out[name] = f.get_tensor(name)
            for name in optional:
                if name in have:
                    out[name] = f.get_tensor(name)
    except CLIError:
        raise
    except FileNotFoundError:
        raise CLIError(f"{path}: no such file") from None
    except Exception as e:  # safetensors raises its own error types for malformed files
        raise CLIError(f"{path}: not a readable .safetensors file: {e}") from None
    return out


def _load_tensor(path: Path, name: str) -> Any:
    """One tensor from a ``.npy`` file or the tensor ``name`` of a ``.safetensors`` file."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        return _load_npy(path)
    if suffix == ".safetensors":
        return _load_safetensors(path, [name])[name]
    raise CLIError(f"{path}: expected a .npy or .safetensors file", EXIT_USAGE)


def cmd_encode(args: argparse.Namespace) -> int:
    """Encode K and V tensors from files into one blob."""
    import torch

    from .codec import encode

    if args.k is None and args.v is None:
        raise CLIError(
            "encode needs --k (and --v unless --k is a .safetensors file holding both)", EXIT_USAGE
        )
    k_path = Path(args.k) if args.k else None
    v_path = Path(args.v) if args.v else None
    if v_path is None and k_path is not None:
        if k_path.suffix.lower() != ".safetensors":
            raise CLIError("--v is required unless --k is a .safetensors file holding both", EXIT_USAGE)
        v_path = k_path
    _require_files([p for p in (k_path, v_path) if p is not None])
    if k_path is not None and k_path == v_path and k_path.suffix.lower() == ".safetensors":
        both = _load_safetensors(k_path, [args.k_name, args.v_name])
        k, v = both[args.k_name], both[args.v_name]
    else:
        k = _load_tensor(k_path, args.k_name) if k_path is not None else None
        if v_path is None:
            raise CLIError("--v is required (or --k naming a .safetensors file holding both)", EXIT_USAGE)
        v = _load_tensor(v_path, args.v_name)
    scales = None
    if args.scales:
        scales = _load_tensor(Path(args.scales), "scales")
        if scales.dtype not in (torch.float32, torch.float16):
            scales = scales.to(torch.float32)
    elif args.scope == "external":
        raise CLIError(
            "--scope external needs --scales FILE (.npy, or .safetensors with 'scales')", EXIT_USAGE
        )
    blob = encode(
        k,
        v,
        scope=args.scope,
        page_size=args.page_size,
        head_axis=args.head_axis,
        page_axis=args.page_axis,
        hashes=_hashes_from(args, "") or None,
        layer_id=args.layer_id,
        chunk_id=args.chunk_id,
        chunk_size=args.chunk_size,
        scale_dtype=_dtype(args.scale_dtype),
        scales=scales,
        nonfinite=args.nonfinite,
        version=args.version,
    )
    out = Path(args.out)
    _write_atomic(out, lambda f: f.write(blob))
    raw = (v.numel() * v.element_size()) + (k.numel() * k.element_size() if k is not None else 0)
    ratio = f", {len(blob) / raw:.4f} of the {_human(raw)} input" if raw else ""
    print(f"wrote {out}: {_bytes_str(len(blob))}{ratio}")
    return EXIT_OK


def _save_npz(path: Path, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    import numpy as np
    import torch

    arrays: dict[str, Any] = {}
    stored_as: dict[str, str] = {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        dtype = t.dtype
        if dtype.is_floating_point and dtype.itemsize == 1:
            t = t.view(torch.uint8)  # FP8: numpy has no such dtype; keep the raw bytes
        elif dtype == torch.bfloat16:
            t = t.view(torch.uint16)  # bf16: likewise, raw bits
        arrays[name] = t.numpy()
        stored_as[name] = f"{_dtype_name(dtype)} as {arrays[name].dtype}"
    meta = {**meta, "npz_dtypes": stored_as}
    arrays["meta"] = np.array(json.dumps(meta))
    _write_atomic(path, lambda f: np.savez(f, **arrays))


def _save_safetensors(path: Path, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    try:
        from safetensors.torch import save
    except ImportError:
        raise CLIError(
            "writing .safetensors needs the 'safetensors' package (pip install safetensors)"
        ) from None
    flat = {name: t.detach().cpu().contiguous().clone() for name, t in tensors.items()}
    data = save(flat, metadata={"kvcodec": json.dumps(meta)})
    _write_atomic(path, lambda f: f.write(data))


def cmd_decode(args: argparse.Namespace) -> int:
    """Decode a blob into k, v and scales in a .safetensors or .npz file."""
    from .codec import decode
    from .format import header_fields

    out = Path(args.out)
    fmt = out.suffix.lower()
    if fmt not in (".safetensors", ".npz"):
        raise CLIError(f"--out {out}: expected a .safetensors or .npz file name", EXIT_USAGE)
    blob_path = Path(args.blob)
    _require_files([blob_path])
    data = _read_file(blob_path)
    scales = _load_tensor(Path(args.scales), "scales") if args.scales else None
    expected = _hashes_from(args, "expect_")
    d = decode(
        data,
        out_v_dtype=_dtype(args.dequant),
        expected_hashes=expected if (expected or args.strict_hashes) else None,
        strict_hashes=args.strict_hashes,
        scales=scales,
        strict=args.strict,
    )
    tensors = {"k": d.k, "v": d.v, "scales": d.scales}
    tensors = {name: t for name, t in tensors.items() if t is not None}
    meta = {"source": str(blob_path), "header": header_fields(d.header), "dequant": args.dequant}
    if fmt == ".npz":
        _save_npz(out, tensors, meta)
    else:
        _save_safetensors(out, tensors, meta)
    desc = ", ".join(f"{name} {list(t.shape)} {_dtype_name(t.dtype)}" for name, t in tensors.items())
    print(f"wrote {out}: {desc}")
    return EXIT_OK


# ----------------------------------------------------------------------------
# quality / demo
# ----------------------------------------------------------------------------


def cmd_quality(args: argparse.Namespace) -> int:
    """Print the FP8 V quality table per distribution and scope."""
    from .quality import format_table, quality_report

    rows = quality_report(
        tokens=args.tokens, heads=args.heads, dim=args.head_dim, page_size=args.page_size, seed=args.seed
    )
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        print(
            f"V in FP8 e4m3: {args.tokens} tokens x {args.heads} heads x {args.head_dim} dims, "
            f"page_size {args.page_size}, seed {args.seed}"
        )
        print(format_table(rows))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """Run :func:`kvcodec.demo.run_demo` and print its table (or JSON)."""
    from .demo import format_demo, run_demo

    report = run_demo(
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
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_demo(report))
    for failure in report["failures"]:
        print(f"{PROG}: error: demo: {failure}", file=sys.stderr)
    return EXIT_OK if report["passed"] else EXIT_FAILURE


# ----------------------------------------------------------------------------
# Parser
# ----------------------------------------------------------------------------


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _id(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= -1, got {text!r}") from None
    if n < -1:
        raise argparse.ArgumentTypeError(f"expected an integer >= -1 (-1 = unset), got {n}")
    return n


def _add_expect(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("identity checks (empty values are wildcards, as in LMCache)")
    for key in HASH_KEYS:
        flag = key.replace("_", "-")
        g.add_argument(
            f"--expect-{flag}", dest=f"expect_{key}", metavar="STR", help=f"refuse blobs whose {key} differs"
        )
    g.add_argument(
        "--strict-hashes",
        action="store_true",
        help="also refuse blobs that lack a hash given with --expect-*",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``kvcodec`` argument parser."""
    p = _Parser(
        prog=PROG,
        description="LMCKV KV-cache blobs: K bit-exact at fp16/bf16, V in FP8 e4m3 (LMCache-compatible).",
        epilog="Exit status: 0 ok, 1 bad blobs or failures, 2 usage errors.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    p.add_argument(
        "--threads",
        type=_positive,
        metavar="N",
        help="torch CPU threads (default: torch's own choice; 1 for demo)",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    s = sub.add_parser("inspect", help="show blob headers", description="Show each blob's header as a table.")
    s.add_argument("files", nargs="+", metavar="FILE")
    s.add_argument("--json", action="store_true", help="one JSON object per file (a list for several)")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser(
        "verify",
        help="check blobs (magic, lengths, CRC, consistency, hashes)",
        description="Check blobs; folders are walked recursively, skipping hidden entries (.quarantine).",
    )
    s.add_argument("paths", nargs="+", metavar="FILE|DIR")
    s.add_argument("--strict", action="store_true", help="refuse trailing bytes after a v1 payload")
    s.add_argument(
        "--glob", default="*", metavar="PATTERN", help="in folders, check only files matching (e.g. '*.blob')"
    )
    s.add_argument("-v", "--verbose", action="store_true", help="also list good blobs")
    s.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr for folders (default: only when stderr is a terminal)",
    )
    _add_expect(s)
    s.set_defaults(func=cmd_verify)

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
        "--page-size", type=_positive, metavar="N", help="tokens per page (needed by per_page_head)"
    )
    s.add_argument(
        "--scales", metavar="FILE", help="scales for --scope external (.npy, or 'scales' in .safetensors)"
    )
    s.add_argument("--scale-dtype", choices=("fp32", "fp16"), default="fp32", help="stored scale dtype")
    s.add_argument("--layer-id", type=_id, default=-1, metavar="N")
    s.add_argument("--chunk-id", type=_id, default=-1, metavar="N")
    s.add_argument(
        "--chunk-size", type=_positive, metavar="N", help="chunk size in tokens (default: tokens given)"
    )
    s.add_argument("--head-axis", type=int, metavar="AXIS", help="axis of the heads (default: -2)")
    s.add_argument("--page-axis", type=int, metavar="AXIS", help="axis of the pages in a 4-D input")
    s.add_argument("--nonfinite", choices=("error", "saturate"), default="error", help="NaN/Inf in V")
    s.add_argument(
        "--version", type=int, choices=(1, 2), default=1, help="header version (raw scope forces 2)"
    )
    g = s.add_argument_group("identity hashes written into the header")
    for key in HASH_KEYS:
        g.add_argument(f"--{key.replace('_', '-')}", dest=key, metavar="STR")
    s.set_defaults(func=cmd_encode)

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
    _add_expect(s)
    s.set_defaults(func=cmd_decode)

    s = sub.add_parser(
        "quality", help="FP8 V quality per scope", description="Measure V's FP8 error per scope."
    )
    s.add_argument("--tokens", type=_positive, default=1024)
    s.add_argument("--heads", type=_positive, default=8)
    s.add_argument("--head-dim", type=_positive, default=128)
    s.add_argument("--page-size", type=_positive, default=16)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_quality)

    s = sub.add_parser(
        "demo",
        help="encode, store, read back and check a Llama-3-8B-shaped KV cache",
        description="Build a synthetic KV cache shaped like Llama-3-8B's, encode every (layer, chunk) "
        "into a DirectoryStore, read it all back, check K bit for bit and measure V's error, the "
        "size ratio and the throughput.",
    )
    s.add_argument("--layers", type=_positive, default=32)
    s.add_argument("--tokens", type=_positive, default=2048)
    s.add_argument("--chunk-tokens", type=_positive, default=256)
    s.add_argument("--heads", type=_positive, default=8, help="KV heads")
    s.add_argument("--head-dim", type=_positive, default=128)
    s.add_argument("--page-size", type=_positive, default=16)
    s.add_argument(
        "--scope", choices=("per_page_head", "per_tensor", "per_layer_head", "raw"), default="per_page_head"
    )
    s.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="K/V dtype of the cache")
    s.add_argument("--store", metavar="DIR", help="store folder (default: a temp folder, removed at the end)")
    s.add_argument("--keep", action="store_true", help="keep the temp store folder")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--sample", type=int, default=8, metavar="N", help="blobs to measure attention error on")
    s.add_argument("--fsync", action="store_true", help="fsync every put (durable, slower)")
    s.add_argument(
        "--min-sqnr-db", type=float, default=20.0, metavar="DB", help="fail if V's SQNR is below (default 20)"
    )
    s.add_argument("--json", action="store_true")
    s.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: only when stderr is a terminal)",
    )
    s.set_defaults(func=cmd_demo)
    return p


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvcodec")
    except Exception:
        return "unknown"


# ----------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------


def _error(message: str) -> None:
    message = " ".join(str(message).split())  # one line, whatever the message holds
    print(f"{PROG}: error: {message}", file=sys.stderr)


def _os_message(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e) or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as e:
        _error(str(e))
        return EXIT_USAGE
    except SystemExit as e:  # --help / --version
        return e.code if isinstance(e.code, int) else EXIT_OK
    debug = os.environ.get("KVCODEC_DEBUG", "") not in ("", "0")
    try:
        if args.threads is not None and args.command != "demo":
            import torch

            torch.set_num_threads(args.threads)
        return int(args.func(args))
    except CLIError as e:
        _error(str(e))
        return e.code
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `| head`); stay quiet, as other tools do.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_FAILURE
    except Exception as e:
        if debug:
            raise
        from .errors import CodecError

        if isinstance(e, CodecError):
            _error(str(e))
        elif isinstance(e, OSError):
            _error(_os_message(e))
        else:
            _error(f"unexpected {type(e).__name__}: {e} (set KVCODEC_DEBUG=1 for a traceback)")
        return EXIT_FAILURE


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
