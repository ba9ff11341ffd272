"""Hosts of a Redis fleet for the tests and the bench: each a vLLM engine in a fresh process
(``run_fleet_engine.py``), sharing nothing with the others but the Redis it is given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["RUNNER", "connector_keys", "run_host"]

RUNNER = Path(__file__).parent / "run_fleet_engine.py"


def connector_keys(
    url: str, *, timeout_ms: int = 1000, key_prefix: str | None = None, **more: object
) -> dict:
    """The connector keys that put an engine on the Redis store ``url``; a generous timeout by default
    (the machine running the tests is busy: an outage is still refused at once, a connection refused
    costs no wait)."""
    keys = {"store": url, "store_timeout_ms": timeout_ms, **more}
    if key_prefix is not None:
        keys["key_prefix"] = key_prefix
    return keys


def run_host(
    tmp: Path,
    name: str,
    spec: dict,
    *,
    env: dict[str, str] | None = None,
    on_pause: Callable[[int], None] | None = None,
    timeout: float = 900,
) -> tuple[dict, str]:
    """Run ``spec`` as host ``name`` (its own empty local directory ``tmp/<name>-local``); call
    ``on_pause(n)`` at each of its ``pause_after`` points. Its result line and its output, stdout and
    stderr together (also in ``tmp/<name>.log``); past ``timeout`` seconds (counted in polls) or a
    non-zero exit raises."""
    pause_dir = tmp / f"pause-{name}"
    pause_dir.mkdir(parents=True, exist_ok=True)
    spec = {"store": str(tmp / f"{name}-local"), **spec, "pause_dir": str(pause_dir)}
    path = tmp / f"spec-{name}.json"
    path.write_text(json.dumps(spec))
    log = tmp / f"{name}.log"
    run_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    with log.open("w") as flog:
        cmd = [sys.executable, str(RUNNER), str(path)]
        proc = subprocess.Popen(cmd, stdout=flog, stderr=subprocess.STDOUT, env=run_env)
        try:
            _follow(proc, pause_dir, spec.get("pause_after", []), on_pause, timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"host {name} exited with {proc.returncode}:\n{text[-4000:]}")
    (line,) = [x for x in text.splitlines() if x.startswith('{"outputs"')]
    return json.loads(line), text


def _follow(
    proc: subprocess.Popen,
    pause_dir: Path,
    pauses: list[int],
    on_pause: Callable[[int], None] | None,
    timeout: float,
) -> None:
    pending = list(pauses)
    for _ in range(int(timeout / 0.1)):  # polls, not a clock: a liveness bound
        if proc.poll() is not None:
            return
        if pending and (pause_dir / f"paused-{pending[0]}").exists():
            n = pending.pop(0)
            if on_pause is not None:
                on_pause(n)
            (pause_dir / f"go-{n}").touch()
        time.sleep(0.1)
    raise RuntimeError(f"host did not finish within {timeout} s")
