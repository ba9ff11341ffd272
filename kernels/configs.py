"""Launch configs of kvcodec's tile kernels: the space worth trying, the heuristic default, the tuning file.

A config is ``(BLOCK_T, num_warps)``: BLOCK_T token rows x BLOCK_D (head_dim
rounded up to a power of two) per program. The space excludes configs that
the kernel audit showed to be wasteful: tiles longer than the rows one
program covers (mostly masked, e.g. 128-row tiles over 16-token pages) and
more than :data:`MAX_PER_THREAD` elements per thread (255 registers and
spills).

Launchers never autotune unless asked (``KVCODEC_AUTOTUNE=1`` or
:data:`AUTOTUNE`). Otherwise a launch's config is chosen one way,
:func:`choose`: the config :func:`override` forces, else the winner recorded
by ``kvcodec tune`` in the tuning file for this GPU, Triton version, kernel
and shape key, else the heuristic.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "AUTOTUNE",
    "KEY_FIELDS",
    "MAX_PER_THREAD",
    "MAX_TUNING_BYTES",
    "TUNING_FORMAT",
    "TileConfig",
    "TuningTable",
    "autotune_enabled",
    "choose",
    "config_space",
    "default_tuning_path",
    "heuristic",
    "overridden",
    "override",
    "pow2",
    "reload_tuning",
    "rows_covered",
    "shape_key",
    "tuned_config",
]

AUTOTUNE: bool | None = None
"""Autotune launch configs: None reads ``KVCODEC_AUTOTUNE`` (default off: :func:`choose`)."""
MAX_PER_THREAD = 32
"""Most tile elements per thread (fp32 working values: more spills registers)."""
MIN_PER_THREAD = 16
"""Fewest tile elements per thread worth a config: 16 FP8 bytes make one 128-bit access."""
MIN_PER_THREAD_BY_KERNEL = {"_amax_tiles_kernel": 8}
"""Kernels that move no FP8 bytes reach 128-bit accesses at 8 16-bit elements per thread."""
BLOCK_TS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WARPS = (1, 2, 4, 8)
TUNING_FORMAT = "kvcodec-tuning/1"
MAX_TUNING_BYTES = 16 << 20
"""A tuning file holds a few hundred entries; a bigger one is not read (it would be read into memory)."""

_log = logging.getLogger("kvcodec.kernels")

KEY_FIELDS: dict[str, tuple[str, ...]] = {
    "_encode_groups_kernel": ("D", "GT", "KB", "V_BF16", "PAGED"),
    "_amax_tiles_kernel": ("D", "TT", "KB", "V_BF16", "PAGED"),
    "_quant_tiles_kernel": ("D", "PS", "V_BF16", "PAGED", "FROM_AMAX"),
    "_dequant_tiles_kernel": ("D", "PS", "KB", "OUT_KIND", "PAGED"),
}
"""Launch arguments a kernel's best config depends on (with the row count, bucketed)."""


@dataclass(frozen=True)
class TileConfig:
    """One launch config of a tile kernel."""

    block_t: int
    num_warps: int

    def per_thread(self, block_d: int) -> float:
        return self.block_t * block_d / (32 * self.num_warps)


def pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def heuristic(rows: int, block_d: int, interpret: bool = False) -> TileConfig:
    """The default: tiles of up to 4096 elements (16384 in the interpreter), 16 elements per thread."""
    cap = 16384 if interpret else 4096
    bt = max(1, min(pow2(rows), cap // max(block_d, 1)))
    if interpret:
        return TileConfig(bt, 1)
    nw = min(8, max(1, bt * block_d // 512))
    return TileConfig(bt, nw)


def config_space(rows: int, block_d: int, kernel: str = "") -> list[TileConfig]:
    """Configs worth trying for ``kernel``'s programs covering ``rows`` token rows of ``block_d`` columns.

    BLOCK_T <= rows rounded up to a power of two (no mostly-masked tiles) and
    16..32 elements per thread (8..32 for kernels moving no FP8 bytes); the
    heuristic is always included (for tiny tiles, the only config).
    """
    lo = MIN_PER_THREAD_BY_KERNEL.get(kernel, MIN_PER_THREAD)
    out = []
    for bt in BLOCK_TS:
        if bt > pow2(rows):
            break
        for nw in WARPS:
            c = TileConfig(bt, nw)
            per = c.per_thread(block_d)
            if lo <= per <= MAX_PER_THREAD:
                out.append(c)
    h = heuristic(rows, block_d)
    if h not in out:
        out.append(h)
    return out


def rows_covered(args: Mapping[str, Any]) -> int:
    """Token rows one program of a tile launch covers: TT (stage-1 absmax), GT (one group), else all T."""
    for name in ("TT", "GT", "T"):
        if name in args:
            return int(args[name])
    return 1


def autotune_enabled() -> bool:
    """True when launches autotune: :data:`AUTOTUNE`, else ``KVCODEC_AUTOTUNE`` (off by default)."""
    if AUTOTUNE is not None:
        return bool(AUTOTUNE)
    env = os.environ.get("KVCODEC_AUTOTUNE")
    if env is not None and env.strip() != "":
        return env.strip().lower() not in ("0", "false", "no", "off")
    return False


def shape_key(kernel: str, kw: Mapping[str, Any], rows: int) -> str:
    """Tuning-file key of a launch: its key fields and the row count rounded up to a power of two."""
    fields = KEY_FIELDS.get(kernel, ("D",))
    parts = [f"{f}={int(kw[f])}" for f in fields if f in kw]
    parts.append(f"rows={pow2(rows)}")
    return ",".join(parts)


def default_tuning_path() -> Path:
    """``$KVCODEC_TUNING_FILE``, else ``$XDG_CACHE_HOME/kvcodec/tuning.json`` (``~/.cache`` by default)."""
    env = os.environ.get("KVCODEC_TUNING_FILE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvcodec" / "tuning.json"


@dataclass(frozen=True)
class _Entry:
    gpu: str
    triton: str
    kernel: str
    key: str


_ENTRY_FIELDS = ("gpu", "triton", "kernel", "key", "BLOCK_T", "num_warps")


def _as_int(x: Any) -> int | None:
    """``x`` as an int when it is one (or an integral finite float), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, float) and math.isfinite(x) and x.is_integer():
        return int(x)
    return None


def _parse_entry(r: Any) -> tuple[_Entry, TileConfig, dict[str, Any]] | None:
    """One tuning-file entry, or None when it is malformed."""
    if not isinstance(r, dict):
        return None
    names = [r.get(f) for f in _ENTRY_FIELDS[:4]]
    bt, nw = _as_int(r.get("BLOCK_T")), _as_int(r.get("num_warps"))
    if not all(isinstance(n, str) for n in names) or bt is None or nw is None:
        return None
    facts = {k: v for k, v in r.items() if k not in _ENTRY_FIELDS and isinstance(k, str)}
    return _Entry(*names), TileConfig(bt, nw), facts


class TuningTable:
    """Winning configs by (GPU name, Triton version, kernel, shape key), stored as JSON."""

    def __init__(self) -> None:
        self._rows: dict[_Entry, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, gpu: str, triton: str, kernel: str, key: str, cfg: TileConfig, **facts: Any) -> None:
        self._rows[_Entry(gpu, triton, kernel, key)] = {
            "BLOCK_T": cfg.block_t,
            "num_warps": cfg.num_warps,
            **facts,
        }

    def get(self, gpu: str, triton: str, kernel: str, key: str) -> TileConfig | None:
        row = self._rows.get(_Entry(gpu, triton, kernel, key))
        if row is None:
            return None
        return TileConfig(int(row["BLOCK_T"]), int(row["num_warps"]))

    def to_json(self) -> dict[str, Any]:
        entries = [
            {"gpu": e.gpu, "triton": e.triton, "kernel": e.kernel, "key": e.key, **r}
            for e, r in self._rows.items()
        ]
        entries.sort(key=lambda r: (r["gpu"], r["triton"], r["kernel"], r["key"]))
        return {"format": TUNING_FORMAT, "entries": entries}

    @classmethod
    def from_json(cls, obj: Any) -> TuningTable:
        """Parse a tuning file's JSON; malformed entries are skipped (a stale file never breaks launches)."""
        t = cls()
        if not isinstance(obj, dict) or obj.get("format") != TUNING_FORMAT:
            return t
        entries = obj.get("entries")
        if not isinstance(entries, list):
            return t
        for r in entries:
            row = _parse_entry(r)
            if row is not None:
                entry, cfg, facts = row
                t.put(entry.gpu, entry.triton, entry.kernel, entry.key, cfg, **facts)
        return t

    @classmethod
    def load(cls, path: Path) -> TuningTable:
        """The table in the file at ``path``; empty (and logged) when it is missing, too big or not a tuning file."""
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_TUNING_BYTES + 1)
        except OSError:
            return cls()  # no tuning file: the heuristic serves
        why = None
        if len(raw) > MAX_TUNING_BYTES:
            why = f"larger than {MAX_TUNING_BYTES} bytes"
        else:
            try:
                return cls.from_json(json.loads(raw))
            except (
                ValueError,
                RecursionError,
            ) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                why = f"not JSON ({type(e).__name__})"
        _log.warning("kvcodec tuning file %s ignored: %s; launches use the heuristic configs", path, why)
        return cls()

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, path)


_TABLE: TuningTable | None = None
_LOCK = threading.Lock()
_OVERRIDE: dict[str, TileConfig] = {}


@contextlib.contextmanager
def override(kernel: str, cfg: TileConfig) -> Iterator[None]:
    """Launch every ``kernel`` with ``cfg`` inside the block (``kvcodec tune`` tries configs this way)."""
    prev = _OVERRIDE.get(kernel)
    _OVERRIDE[kernel] = cfg
    try:
        yield
    finally:
        if prev is None:
            _OVERRIDE.pop(kernel, None)
        else:
            _OVERRIDE[kernel] = prev


def overridden(kernel: str) -> TileConfig | None:
    """The config :func:`override` forces for ``kernel``, if any."""
    return _OVERRIDE.get(kernel)


def _table() -> TuningTable:
    global _TABLE
    if _TABLE is None:
        with _LOCK:
            if _TABLE is None:
                _TABLE = TuningTable.load(default_tuning_path())
    return _TABLE


def reload_tuning(table: TuningTable | None = None) -> None:
    """Forget the loaded tuning file (it is read again at the next launch), or install ``table``."""
    global _TABLE
    _TABLE = table


def tuned_config(gpu: str, kernel: str, key: str, block_d: int) -> TileConfig | None:
    """The tuning file's config for this launch, if any (and sane for ``block_d``)."""
    import triton

    cfg = _table().get(gpu, triton.__version__, kernel, key)
    if cfg is None or cfg.block_t not in BLOCK_TS or cfg.num_warps not in WARPS:
        return None
    if cfg.per_thread(block_d) > 4 * MAX_PER_THREAD:
        return None
    return cfg


def choose(
    kernel: str, kw: Mapping[str, Any], rows: int, block_d: int, *, gpu: str, interpret: bool
) -> TileConfig:
    """The config of a launch of ``kernel``: forced by :func:`override`, else tuned for ``gpu``, else the heuristic."""
    cfg = overridden(kernel)
    if cfg is None and not interpret and gpu:
        cfg = tuned_config(gpu, kernel, shape_key(kernel, kw, rows), block_d)
    return cfg or heuristic(rows, block_d, interpret)
