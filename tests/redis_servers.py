"""Real ``redis-server`` processes on 127.0.0.1 for the store, fleet and bench tests.

One server or a 3-node Redis Cluster (no replicas), each process in its own
temp dir with ``--save '' --appendonly no``, waited for by polls, and stopped
by its PID when the context ends. A server can be killed (SIGKILL, an outage)
and restarted on the same port (a cluster node with its ``nodes.conf``, so it
rejoins). Needs Debian's ``redis-server``/``redis-cli`` and redis-py. Also the
Redis tests' small blobs and a chunk's keys in the connector's grammar.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "RedisCluster",
    "RedisServer",
    "chunk_keys",
    "connector_keys",
    "free_port",
    "make_blob",
    "redis_cluster",
    "redis_missing",
    "redis_single",
    "stop_process",
    "wait_for",
]


def redis_missing() -> str | None:
    """Why a Redis server cannot be had here (None: redis-server, redis-cli and redis-py are there)."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis-py")
    return f"{', '.join(missing)} not found (Debian package redis-server, PyPI redis)" if missing else None


_HANDED_OUT: set[int] = set()
"""Ports this process has handed out: a port just closed can come back from the kernel, never twice from here."""


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(bus: bool = False) -> int:
    """A free TCP port on 127.0.0.1, never one handed out before in this process (with ``bus``, port + 10000
    is free too, for Redis Cluster's bus)."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        taken = {port, port + 10000} if bus else {port}
        if taken & _HANDED_OUT or (bus and (port + 10000 > 65535 or not _bindable(port + 10000))):
            continue
        _HANDED_OUT.update(taken)
        return port
    raise RuntimeError("no free port found")


def stop_process(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop one process by its PID: SIGTERM, then SIGKILL after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for(
    pred: Callable[[], bool],
    timeout: float,
    what: str,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
) -> None:
    """Poll ``pred`` every 0.1 s, at most ``timeout / 0.1`` times (polls, not a clock: a liveness bound)."""
    for _ in range(int(timeout / 0.1) + 1):
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{what}: process exited with {proc.returncode}\n{tail}")
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise RuntimeError(f"{what}: not ready after {timeout}s\n{tail}")


@dataclass
class RedisServer:
    """One redis-server on a fixed port of 127.0.0.1; ``kill`` and ``start`` again keep the port."""

    port: int
    workdir: Path
    extra: list[str] = field(default_factory=list)
    password: str | None = None
    """The server's ``--requirepass`` (None: none)."""
    proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return self.workdir / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        return [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--protected-mode",
            "yes",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            str(self.log),
            *(["--requirepass", self.password] if self.password else []),
            *self.extra,
        ]

    def client(self, timeout: float = 5.0):
        """A plain redis-py client of this node (for the tests' own checks and plants), no retries."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            password=self.password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
        )

    def ping(self) -> bool:
        import redis

        try:
            with self.client(timeout=1.0) as c:
                return bool(c.ping())
        except (redis.RedisError, OSError):
            return False

    def start(self) -> None:
        """Start (or restart) the server on its port and wait until it answers PING."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self.ping, 30, f"redis-server :{self.port}", self.proc, self.log)

    def kill(self) -> None:
        """SIGKILL by PID (an outage: no goodbye to clients), waited for."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def config_set(self, name: str, value: str) -> None:
        with self.client() as c:
            c.config_set(name, value)

    def used_memory(self) -> int:
        with self.client() as c:
            return int(c.info("memory")["used_memory"])


@contextlib.contextmanager
def redis_single(
    workdir: Path, extra: list[str] | None = None, password: str | None = None
) -> Iterator[RedisServer]:
    """One redis-server on a free port of 127.0.0.1 (``extra``: more server arguments), stopped at the end."""
    cluster_mode = "--cluster-enabled" in (extra or [])  # its bus port (+10000) must be free and valid
    server = RedisServer(free_port(bus=cluster_mode), workdir / "redis-single", list(extra or []), password)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@dataclass
class RedisCluster:
    """The masters of one Redis Cluster (no replicas) on 127.0.0.1."""

    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def node_of(self, name: str) -> RedisServer:
        """The node that serves the slot of the Redis name ``name``."""
        with self.nodes[0].client() as c:
            slot = int(c.execute_command("CLUSTER", "KEYSLOT", name))
            for start, end, primary, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(primary[1])
        return next(n for n in self.nodes if n.port == port)

    def ok(self) -> bool:
        """Whether every running node reports ``cluster_state:ok``."""
        import redis

        try:
            for n in self.nodes:
                if n.proc is None or n.proc.poll() is not None:
                    continue
                with n.client(timeout=1.0) as c:
                    if c.execute_command("CLUSTER", "INFO").decode().find("cluster_state:ok") < 0:
                        return False
        except (redis.RedisError, OSError):
            return False
        return True

    def used_memory(self) -> int:
        return sum(n.used_memory() for n in self.nodes)

    def restart(self, node: RedisServer) -> None:
        """Start a killed node again on its port with its ``nodes.conf``; wait until the cluster is ok."""
        node.start()
        wait_for(self.ok, 60, "redis cluster ok after a restart")


@contextlib.contextmanager
def redis_cluster(workdir: Path, n: int = 3, extra: list[str] | None = None) -> Iterator[RedisCluster]:
    """A Redis Cluster of ``n`` masters on 127.0.0.1, joined by ``redis-cli --cluster create``; a node
    that is down leaves the others serving their slots (``cluster-require-full-coverage no``)."""
    nodes = []
    for _ in range(n):
        port = free_port(bus=True)
        node_dir = workdir / f"redis-cluster-{port}"
        args = ["--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf")]
        args += ["--cluster-node-timeout", "3000", "--cluster-require-full-coverage", "no", *(extra or [])]
        nodes.append(RedisServer(port, node_dir, args))
    try:
        for node in nodes:
            node.start()
        create = ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{x.port}" for x in nodes]]
        out = subprocess.run(
            [*create, "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60
        )
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}\n{out.stderr}")
        cluster = RedisCluster(nodes)
        wait_for(cluster.ok, 60, "redis cluster state ok")
        yield cluster
    finally:
        for node in nodes:
            node.stop()


# ----------------------------------------------------------------------------
# test data
# ----------------------------------------------------------------------------


def make_blob(nbytes: int, seed: int, model: str = "m") -> bytes:
    """A valid version-2 LMCKV blob of about ``nbytes`` payload bytes (random K and V), ``chunk_id=seed``."""
    import numpy as np
    import torch

    from kvcodec.format import Hashes, Header, ScaleScope, assemble

    half = max(2, nbytes // 2) // 2 * 2
    rng = np.random.default_rng(seed)
    h = Header(
        k_dtype=torch.float16,
        v_dtype=torch.float16,
        scale_scope=ScaleScope.EXTERNAL,
        version=2,
        layer_id=seed % 7,
        chunk_id=seed,
        hashes=Hashes(model_id=model, tokenizer_hash="tok"),
    )
    return bytes(assemble(h, rng.bytes(half), rng.bytes(half)))


def connector_keys(model16: str) -> object:
    """The connector's ``ChunkKeys`` of one model identity, rank 0 of one (whether it takes the
    ``model16`` itself or a rank -> ``model16`` map)."""
    from kvcodec.integrations.vllm.chunk_keys import ChunkKeys

    per_rank = "dict" in str(ChunkKeys.__dataclass_fields__["model16"].type)
    return ChunkKeys({0: model16}) if per_rank else ChunkKeys(model16)  # type: ignore[arg-type]


def chunk_keys(layers: int, chunk: int, model16: str = "m") -> list[str]:
    """Chunk ``chunk``'s keys as the connector writes them: each layer's blob, then the manifest."""
    from kvcodec.integrations.vllm.chunk_keys import ChunkRef

    keys: Any = connector_keys(model16)
    ref = ChunkRef(chunk, f"h{chunk}", f"h{chunk - 1}" if chunk else None)
    return [keys.blob(0, layer, ref) for layer in range(layers)] + [keys.manifest(ref)]
