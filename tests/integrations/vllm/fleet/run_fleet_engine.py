"""Run ``engine/run_engine.py``'s engine as one host of a Redis fleet (``python run_fleet_engine.py SPEC``).

Two SPEC keys on top of run_engine.py's: ``connector`` (more ``kv_connector_extra_config`` keys:
``store``, ``store_timeout_ms``, ``key_prefix``, ``fleet_key_env``, ...) and ``pause_after`` (after
the n-th ``LLM.generate`` call returns, write ``<pause_dir>/paused-<n>`` and wait for
``<pause_dir>/go-<n>``: the test breaks or mends a server between two prompts of one engine).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import run_engine

PAUSE_POLLS = 6000
"""How many 0.1 s polls a paused engine waits for its go file before it carries on."""


def _with_connector_keys(extra: dict) -> None:
    base = run_engine._transfer_config

    def transfer_config(spec: dict) -> dict | None:
        cfg = base(spec)
        if cfg is not None:
            cfg["kv_connector_extra_config"].update(extra)
        return cfg

    run_engine._transfer_config = transfer_config


def _with_pauses(pause_dir: Path, after: set[int]) -> None:
    from vllm import LLM

    generate, calls = LLM.generate, [0]

    def paused_generate(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] in after:
            (pause_dir / f"paused-{calls[0]}").touch()
            go = pause_dir / f"go-{calls[0]}"
            for _ in range(PAUSE_POLLS):
                if go.exists():
                    break
                time.sleep(0.1)
        return out

    LLM.generate = paused_generate


def main(path: str) -> None:
    spec = json.loads(Path(path).read_text())
    _with_connector_keys(spec.get("connector", {}))
    if spec.get("pause_after"):
        _with_pauses(Path(spec["pause_dir"]), set(spec["pause_after"]))
    run_engine.main(path)


if __name__ == "__main__":
    main(sys.argv[1])
