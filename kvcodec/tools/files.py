"""Files for the CLI: reading blobs safely, loading and saving tensors, atomic writes.

Every failure becomes a :class:`~kvcodec.tools.common.CLIError` naming the
file, so a command never prints a traceback for a bad path.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .common import EXIT_USAGE, CLIError, dtype_name

__all__ = [
    "BlobFile",
    "load_safetensors",
    "load_tensor",
    "read_blob",
    "read_file",
    "read_regular",
    "require_files",
    "save_tensors",
    "write_atomic",
]


def read_regular(path: Path) -> bytes:
    """A regular file's bytes; anything else (FIFO, device, socket) raises OSError, never blocks."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def read_file(path: Path) -> bytes:
    """The file's bytes; a directory, a missing or a non-regular file raises CLIError."""
    if path.is_dir():
        raise CLIError(f"{path}: is a directory")
    try:
        return read_regular(path)
    except FileNotFoundError:
        raise CLIError(f"{path}: no such file") from None
    except OSError as e:
        raise CLIError(f"{path}: {e.strerror or e}") from None


@dataclass(frozen=True)
class BlobFile:
    """A blob read from a file: its bytes (header and payload only) and what else the file held."""

    data: bytes
    file_size: int
    trailing: int
    """Bytes after the payload that were not read (version 1 only; version 2 refuses them)."""


_HEADER_STEP = 1 << 16
"""Header bytes read at once while finding where the header ends (never past the file's end)."""


def _read_header(f: IO[bytes], size: int) -> tuple[bytes, Any]:
    """The bytes read so far and the header's extent (None where the file ends inside the header)."""
    from ..format.parser import blob_extent

    data = f.read(min(size, _HEADER_STEP))
    while True:
        extent = blob_extent(data)
        if not isinstance(extent, int):
            return data, extent
        if extent > size:  # the file ends inside the header: what it holds is all there is
            return data + f.read(size - len(data)), None
        data += f.read(min(size, max(extent, len(data) + _HEADER_STEP)) - len(data))


def _size_refusal(size: int, extent: Any, strict: bool) -> Exception | None:
    """Why a file of ``size`` bytes cannot hold the blob its header declares, or None."""
    from ..errors import CorruptEncodedKVError, Reason

    if size < extent.size:
        return CorruptEncodedKVError(
            f"truncated blob: the header declares {extent.header_len} + {extent.payload_len} = "
            f"{extent.size} bytes, the file holds {size}",
            reason=Reason.TRUNCATED_PAYLOAD,
        )
    if size > extent.size and (extent.version >= 2 or strict):
        return CorruptEncodedKVError(
            f"{size - extent.size} trailing bytes after the payload (the header declares "
            f"{extent.size} bytes, the file holds {size})",
            reason=Reason.TRAILING_BYTES,
        )
    return None


def read_blob(path: Path, *, strict: bool = False) -> BlobFile:
    """A blob file's header and payload, never more than its header declares and the file holds.

    The header is read first and its declared size compared with the file's
    before the payload is read: a file smaller than that (truncated, or a header
    claiming terabytes) or larger (a version-2 blob, or ``strict``) raises the
    parser's :class:`~kvcodec.errors.CorruptEncodedKVError` at the cost of its
    header. Version-1 trailing bytes are counted, not read. A directory, a
    missing or a non-regular file raises CLIError.
    """
    fd = _open_regular(path)
    try:
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(fd).st_size
            data, extent = _read_header(f, size)
            if extent is None:
                return BlobFile(data, size, 0)
            refusal = _size_refusal(size, extent, strict)
            if refusal is not None:
                raise refusal
            if len(data) < extent.size:
                data += f.read(extent.size - len(data))
    except OSError as e:
        raise CLIError(f"{path}: {e.strerror or e}") from None
    return BlobFile(data[: extent.size], size, size - extent.size)


def _open_regular(path: Path) -> int:
    """A read-only descriptor of regular file ``path``; anything else raises CLIError, never blocks."""
    if path.is_dir():
        raise CLIError(f"{path}: is a directory")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CLIError(f"{path}: no such file") from None
    except OSError as e:
        raise CLIError(f"{path}: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CLIError(f"{path}: not a regular file")
    return fd


def require_files(paths: Iterable[Path], *, allow_dirs: bool = False) -> None:
    """Refuse missing inputs (and directories unless allowed) before any work."""
    for p in paths:
        if not p.exists():
            raise CLIError(f"{p}: no such file or directory")
        if p.is_dir() and not allow_dirs:
            raise CLIError(f"{p}: is a directory")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
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


# ----------------------------------------------------------------------------- loading tensors


def _check_npy_header(path: Path) -> None:
    """Refuse a .npy whose header declares more array bytes than the file holds, before numpy
    allocates them (a 180-byte file may claim petabytes)."""
    import numpy as np

    fmt = np.lib.format
    with open(path, "rb") as f:
        try:
            version = fmt.read_magic(f)
        except ValueError:
            return  # not a .npy at all (an .npz, or garbage): np.load names it
        try:
            read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, _, dtype = read(f)
        except (ValueError, SyntaxError, TypeError) as e:
            raise CLIError(f"{path}: bad .npy header: {e}") from None
        have = os.fstat(f.fileno()).st_size - f.tell()
    need = math.prod(shape) * dtype.itemsize
    if need > have:
        raise CLIError(
            f"{path}: bad .npy header: it declares a {dtype} array of shape {shape} ({need} bytes), "
            f"but the file holds {have} bytes after the header"
        )


def _load_npy(path: Path) -> Any:
    import numpy as np
    import torch

    try:
        _check_npy_header(path)
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        if isinstance(e, FileNotFoundError):
            raise CLIError(f"{path}: no such file") from None
        raise CLIError(f"{path}: not a valid .npy file ({e})") from None
    except MemoryError:
        raise CLIError(f"{path}: the .npy array does not fit in memory") from None
    if not isinstance(arr, np.ndarray):
        raise CLIError(f"{path}: holds several arrays (.npz); give a .npy file or a .safetensors file")
    if arr.dtype.byteorder not in ("=", "|") and arr.dtype.byteorder != sys.byteorder[0]:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(arr)
    except TypeError as e:
        raise CLIError(f"{path}: dtype {arr.dtype} is not supported: {e}") from None


def load_safetensors(path: Path, names: Sequence[str], *, optional: Sequence[str] = ()) -> dict[str, Any]:
    """The tensors ``names`` (required) and ``optional`` (if present) of a .safetensors file."""
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


def load_tensor(path: Path, name: str) -> Any:
    """One tensor from a ``.npy`` file or the tensor ``name`` of a ``.safetensors`` file."""
    suffix = path.suffix.lower()
    if suffix == ".npy":
        return _load_npy(path)
    if suffix == ".safetensors":
        return load_safetensors(path, [name])[name]
    raise CLIError(f"{path}: expected a .npy or .safetensors file", EXIT_USAGE)


# ----------------------------------------------------------------------------- saving tensors


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
        stored_as[name] = f"{dtype_name(dtype)} as {arrays[name].dtype}"
    arrays["meta"] = np.array(json.dumps({**meta, "npz_dtypes": stored_as}))
    write_atomic(path, lambda f: np.savez(f, **arrays))


def _save_safetensors(path: Path, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    try:
        from safetensors.torch import save
    except ImportError:
        raise CLIError(
            "writing .safetensors needs the 'safetensors' package (pip install safetensors)"
        ) from None
    flat = {name: t.detach().cpu().contiguous().clone() for name, t in tensors.items()}
    data = save(flat, metadata={"kvcodec": json.dumps(meta)})
    write_atomic(path, lambda f: f.write(data))


def save_tensors(path: Path, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write ``tensors`` and ``meta`` to ``.npz`` or ``.safetensors`` (by ``path``'s suffix)."""
    if path.suffix.lower() == ".npz":
        _save_npz(path, tensors, meta)
    else:
        _save_safetensors(path, tensors, meta)
