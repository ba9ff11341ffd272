"""The tile kernels' registry and their one launch path.

A tile kernel runs one program per (token tile, head, layer). Its module
registers it here under its name (the name the tuning file, the kernel
audit's budget and ``kvcodec tune`` use); launchers call
:func:`launch_tiles` or :func:`launch_grid`, which launch it with the config
:func:`kvcodec.kernels.configs.choose` picks, or through Triton's autotuner
(pruned to :func:`~kvcodec.kernels.configs.config_space`) when autotuning is
asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton

from . import configs
from .configs import TileConfig
from .launch import current_target, launch

__all__ = [
    "JIT_KERNELS",
    "KERNELS",
    "launch_grid",
    "launch_tiles",
    "pick_config",
    "prune_tiles",
    "register",
    "register_plain",
    "tile_configs",
]

KERNELS: dict[str, tuple[Any, Any]] = {}
"""Tile kernels by name: (launched with a chosen config, autotuned)."""
JIT_KERNELS: dict[str, Any] = {}
"""Every kernel by name, as launched (tile kernels and the others), for the kernel audit."""


def tile_configs(max_bt: int = 256) -> list[triton.Config]:
    """Every (BLOCK_T, num_warps) the autotuner may see; :func:`prune_tiles` keeps the worthwhile ones."""
    return [
        triton.Config({"BLOCK_T": bt}, num_warps=nw)
        for bt in configs.BLOCK_TS
        if bt <= max_bt
        for nw in configs.WARPS
    ]


def prune_tiles(
    candidates: list[triton.Config], named_args: dict[str, Any], kernel: str = "", **kwargs: Any
) -> list[triton.Config]:
    """Keep :func:`kvcodec.kernels.configs.config_space` (no mostly-masked or spilling tiles)."""
    args = {**named_args, **kwargs}
    bd = int(args.get("BLOCK_D", 128))
    rows = configs.rows_covered(args)
    allowed = set(configs.config_space(rows, bd, kernel))
    keep = [c for c in candidates if TileConfig(c.kwargs["BLOCK_T"], c.num_warps) in allowed]
    if keep:
        return keep
    h = configs.heuristic(rows, bd)
    return [triton.Config({"BLOCK_T": h.block_t}, num_warps=h.num_warps)]


def register(name: str, kernel: Any) -> Any:
    """Register ``kernel`` (a JIT function, or one wrapped in ``triton.heuristics``) under ``name``."""
    prune = functools.partial(prune_tiles, kernel=name)
    key = list(configs.KEY_FIELDS[name])
    tuned = triton.autotune(configs=tile_configs(), key=key, prune_configs_by={"early_config_prune": prune})(
        kernel
    )
    KERNELS[name] = (kernel, tuned)
    JIT_KERNELS[name] = kernel
    return kernel


def register_plain(name: str, kernel: Any) -> Any:
    """Register a kernel launched with its own grid and block (not a tile kernel) for the audit."""
    JIT_KERNELS[name] = kernel
    return kernel


def _device_of(kw: dict[str, Any]) -> torch.device:
    return next(v.device for v in kw.values() if isinstance(v, torch.Tensor))


def pick_config(name: str, kw: dict[str, Any], rows: int, block_d: int, dev: torch.device) -> TileConfig:
    """The launch config on ``dev``'s target: :func:`kvcodec.kernels.configs.choose`."""
    tgt = current_target(dev)
    return configs.choose(name, kw, rows, block_d, gpu=tgt.name, interpret=tgt.interpret)


def launch_grid(name: str, rows: int, block_d: int, grid: Callable[[int], Any], kw: dict[str, Any]) -> None:
    """Launch kernel ``name`` over ``grid(BLOCK_T)``: autotuned if asked, else with :func:`pick_config`'s config."""
    raw, tuned = KERNELS[name]
    kw["BLOCK_D"] = block_d
    if configs.autotune_enabled():
        launch(tuned, lambda m: grid(m["BLOCK_T"]), kw)
        return
    cfg = pick_config(name, kw, rows, block_d, _device_of(kw))
    kw.update(BLOCK_T=cfg.block_t, num_warps=cfg.num_warps)
    launch(raw, grid(cfg.block_t), kw)


def launch_tiles(name: str, ntok: int, block_d: int, heads: int, layers: int, kw: dict[str, Any]) -> None:
    """Launch a (token-tile, head, layer) kernel over ``ntok`` rows."""
    launch_grid(name, ntok, block_d, lambda bt: (triton.cdiv(ntok, bt), heads, layers), kw)
