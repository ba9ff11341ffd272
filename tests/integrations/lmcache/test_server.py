"""``kvcodec-lmcache server`` (LMCache's own server, kvcodec serde) on 127.0.0.1, driven by ``lmcache bench server``.

Server A stores through the serde into an fs L2; its blobs are read by LMCache's
own kv_codec reader. Server B, fresh (empty L1) on the same directory, is driven
over the same sequences: its lookups hit, LMCache's log shows its prefetches
served from L2 (through the kvcodec deserializer), and no serde task fails. Bounded: each process has a timeout.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvcodec

LAUNCHER = [sys.executable, "-m", "kvcodec.integrations.lmcache.launcher"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(base: Path, log: Path) -> tuple[subprocess.Popen, int, int]:
    rpc, http = _port(), _port()
    adapter = {
        "type": "fs",
        "base_path": str(base),
        "serde": {"type": "kvcodec", "head_dim": 128, "model": "bench"},
    }
    proc = subprocess.Popen(
        [
            *LAUNCHER,
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(rpc),
            "--http-host",
            "127.0.0.1",
            "--http-port",
            str(http),
            "--l1-size-gb",
            "0.5",
            "--eviction-policy",
            "LRU",
            "--disable-observability",
            "--l2-adapter",
            json.dumps(adapter),
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    polls = 0
    while "Uvicorn running" not in log.read_text():
        polls += 1
        if proc.poll() is not None or polls > 450:  # a liveness bound (90 s of polls), not a speed check
            proc.kill()
            pytest.fail(f"server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return proc, rpc, http


def _bench(rpc: int, http: int) -> str:
    out = subprocess.run(
        [
            *LAUNCHER,
            "bench",
            "server",
            "--mode",
            "cpu",
            "--transfer-mode",
            "lmcache_driven",
            "--rpc-url",
            f"tcp://127.0.0.1:{rpc}",
            "--url",
            f"http://127.0.0.1:{http}",
            "--kvcache-shape-spec",
            "(2,128,16,8,128):bfloat16:4",
            "--num-tokens",
            "512",
            "--end",
            "3",
            "--interval",
            "0.2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_lmcache_server_with_kvcodec_serde(tmp_path):
    from lmcache.v1.kv_codec import AsymK16V8Codec, CodecHashes

    base = tmp_path / "l2"
    base.mkdir()
    proc, rpc, http = _server(base, tmp_path / "a.log")
    try:
        assert "Done." in _bench(rpc, http)
    finally:
        _stop(proc)
    files = sorted(base.glob("*.data"))
    assert files, "no blob reached the fs L2"
    for f in files:
        data = f.read_bytes()
        enc = AsymK16V8Codec().from_bytes(data, expected_hashes=CodecHashes(model_id="bench"))
        assert (enc.kv_head_count, enc.head_dim) == (8, 128)
        kvcodec.parse(data, strict=True)
    proc, rpc, http = _server(base, tmp_path / "b.log")
    try:
        out_b = _bench(rpc, http)
    finally:
        _stop(proc)
    assert "Done." in out_b
    log_b = (tmp_path / "b.log").read_text()
    assert "task" not in log_b or "failed" not in log_b, log_b[-3000:]
    # Server B started with an empty L1: its lookups hit, and its prefetches are served from L2,
    # i.e. through the kvcodec deserializer (LMCache logs where each prefetched key came from).
    lookups = re.findall(r"LOOKUP: (\d+)/(\d+) chunks hit", out_b)
    assert lookups and all(a == b != "0" for a, b in lookups), out_b[-3000:]
    prefetches = re.findall(
        r"Prefetch request completed.*?(\d+)/(\d+) retained keys \((\d+) L1, (\d+) L2\)", log_b
    )
    assert prefetches, log_b[-3000:]
    assert all(kept == asked for kept, asked, _, _ in prefetches)
    assert int(prefetches[0][3]) == int(prefetches[0][1]) > 0  # the first (cold) prefetch: every key from L2
