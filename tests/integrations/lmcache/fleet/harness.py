"""Real servers on 127.0.0.1 for the fleet tests and benchmark: Redis (one node or a 3-node cluster),
``kvcodec-lmcache server`` processes standing for hosts, and LMCache's own client standing for vLLM.

Every process lives in a temp dir, listens on 127.0.0.1 only, is waited for with a deadline and is
stopped by its PID (terminate, then kill) when its context ends; the Redis processes are
``tests/redis_servers.py``'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests import redis_servers as servers
from tests.integrations.lmcache.fleet.resp import RespClient
from tests.redis_servers import free_port, redis_missing
from tests.redis_servers import stop_process as _stop
from tests.redis_servers import wait_for as _wait

__all__ = [
    "SHAPE_SPEC",
    "LMCacheServer",
    "RedisNodes",
    "Step",
    "adapter_json",
    "free_port",
    "lmcache_servers",
    "redis_cluster",
    "redis_missing",
    "redis_single",
    "run_client",
    "wait_keys",
]

LAUNCHER = [sys.executable, "-m", "kvcodec.integrations.lmcache.launcher"]
CLIENT = [sys.executable, str(Path(__file__).with_name("client.py"))]  # a script: no repo root on sys.path
SHAPE_SPEC = "(2,512,16,8,128):bfloat16:4"
"""The engine's KV cache as LMCache's bench client allocates it: 4 layers, 8 KV heads x 128, bf16, 16-token blocks."""
HEAD_DIM = 128


# ----------------------------------------------------------------------------
# Redis
# ----------------------------------------------------------------------------


@dataclass
class RedisNodes:
    """The nodes of one Redis deployment (one node, or the masters of a cluster)."""

    ports: list[int]
    cluster: bool

    def clients(self) -> list[RespClient]:
        return [RespClient(p) for p in self.ports]

    def values(self) -> dict[bytes, bytes]:
        """Every key and value on every node (each read from the node that holds it)."""
        out: dict[bytes, bytes] = {}
        for c in self.clients():
            with c:
                for k in c.keys():
                    out[k] = c.call("GET", k)
        return out

    def key_count(self) -> int:
        total = 0
        for c in self.clients():
            with c:
                total += int(c.call("DBSIZE"))
        return total

    def keys_per_node(self) -> list[int]:
        counts = []
        for c in self.clients():
            with c:
                counts.append(int(c.call("DBSIZE")))
        return counts

    def used_memory(self) -> int:
        """Sum of ``used_memory`` over the nodes (bytes)."""
        total = 0
        for c in self.clients():
            with c:
                total += int(c.info("memory")["used_memory"])
        return total

    def flush(self) -> None:
        for c in self.clients():
            with c:
                c.call("FLUSHALL")

    @property
    def resp_adapter(self) -> dict:
        """The ``resp`` L2 adapter for the first node (one endpoint)."""
        return {"type": "resp", "host": "127.0.0.1", "port": self.ports[0], "num_workers": 2}

    def valkey_adapter(self, key_prefix: str = "") -> dict:
        """The ``valkey`` L2 adapter: every node as a seed, cluster mode when a cluster."""
        nodes = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        # generous timeouts: in the tests, several servers connect while others are still starting
        out = {"type": "valkey", "startup_nodes": nodes, "cluster_mode": self.cluster, "num_workers": 2}
        out |= {"connection_timeout": 60, "request_timeout": 30}
        if key_prefix:
            out["key_prefix"] = key_prefix
        return out


LRU_1GB = ["--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"]


@contextlib.contextmanager
def redis_single(workdir: Path) -> Iterator[RedisNodes]:
    """One redis-server on a free port of 127.0.0.1, ``maxmemory 1gb`` with ``allkeys-lru``."""
    with servers.redis_single(workdir, LRU_1GB) as srv:
        yield RedisNodes([srv.port], cluster=False)


@contextlib.contextmanager
def redis_cluster(workdir: Path, n: int = 3) -> Iterator[RedisNodes]:
    """A Redis Cluster of ``n`` masters (no replicas) on 127.0.0.1, joined by ``redis-cli --cluster create``."""
    with servers.redis_cluster(workdir, n, LRU_1GB) as cl:
        yield RedisNodes([node.port for node in cl.nodes], cluster=True)


# ----------------------------------------------------------------------------
# kvcodec-lmcache server (one per host) and LMCache's client
# ----------------------------------------------------------------------------


def adapter_json(adapter: dict, serde: dict | None) -> str:
    """An L2 adapter's JSON with ``serde`` (None: no serde, raw objects)."""
    return json.dumps({**adapter, "serde": serde} if serde is not None else adapter)


@dataclass
class LMCacheServer:
    """One running ``kvcodec-lmcache server``: its ports and its log."""

    proc: subprocess.Popen
    rpc_port: int
    http_port: int
    log: Path

    @property
    def rpc_url(self) -> str:
        return f"tcp://127.0.0.1:{self.rpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def lmcache_servers(
    workdir: Path, adapters: dict[str, str], l1_gb: float = 0.2, extra_args: tuple[str, ...] = ()
) -> Iterator[dict[str, LMCacheServer]]:
    """One ``kvcodec-lmcache server`` per entry of ``adapters`` (name -> L2 adapter JSON), started side by
    side on 127.0.0.1 (each a separate host's service), each stopped by its PID at the end."""
    servers: dict[str, LMCacheServer] = {}
    env = {**_env(), "LMCACHE_DISABLE_BANNER": "1"}
    try:
        for name, adapter in adapters.items():
            rpc, http = free_port(), free_port()
            log = workdir / f"server-{name}.log"
            cmd = [
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
                str(l1_gb),
                "--eviction-policy",
                "LRU",
                "--disable-observability",
                "--l2-adapter",
                adapter,
                *extra_args,
            ]
            with log.open("w") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            servers[name] = LMCacheServer(proc, rpc, http, log)
        for name, srv in servers.items():
            _wait(
                lambda srv=srv: "Uvicorn running" in srv.log_text(), 600, f"server {name}", srv.proc, srv.log
            )
        yield servers
    finally:
        for srv in servers.values():
            _stop(srv.proc)


def _env() -> dict[str, str]:
    """The servers' and clients' environment: kvcodec comes from the venv's editable install."""
    return dict(os.environ)


@dataclass(frozen=True)
class Step:
    """One action of LMCache's client on one server: ``store`` (saving what it stored to ``ref``) or ``load``."""

    name: str
    action: str
    server: LMCacheServer
    ref: Path | None
    """Where ``store`` saves what it stored and ``load`` compares with (None: nothing kept, timing only)."""


def run_client(
    steps: list[Step], workdir: Path, seqs: int, shape_spec: str = SHAPE_SPEC, timeout: float = 600
) -> tuple[dict, str]:
    """Run LMCache's bench client (one process) through ``steps``; returns the summary by step name, and its output."""
    plan = [
        {
            "name": s.name,
            "action": s.action,
            "rpc_url": s.server.rpc_url,
            "http_url": s.server.http_url,
            "ref": str(s.ref) if s.ref else None,
        }
        for s in steps
    ]
    tag = "-".join(s.name for s in steps)
    plan_path, out_json = workdir / f"plan-{tag}.json", workdir / f"summary-{tag}.json"
    plan_path.write_text(json.dumps(plan))
    cmd = [*CLIENT, str(plan_path), "--seqs", str(seqs), "--shape-spec", shape_spec, "--json", str(out_json)]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**_env(), "LMCACHE_DISABLE_BANNER": "1"}
    )
    text = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"LMCache client failed ({res.returncode}):\n{text[-4000:]}")
    return json.loads(out_json.read_text()), text


def wait_keys(
    nodes: RedisNodes, count: int, timeout: float = 300, writer: LMCacheServer | None = None
) -> None:
    """Wait until the deployment holds ``count`` keys (a server's L2 writes finish after its STORE replies)."""
    log = writer.log if writer else None
    _wait(lambda: nodes.key_count() >= count, timeout, f"{count} keys in redis {nodes.ports}", log=log)
