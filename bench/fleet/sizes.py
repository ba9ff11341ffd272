"""``make bench-fleet-sizes``: what Redis keeps per byte of KV, values whole (before) vs sized to its allocator.

A real redis-server (Debian's, jemalloc) on 127.0.0.1, no engines. Two measurements:

1. **Size classes**: ``MEMORY USAGE`` of one key per value size around the 192 KiB and 768 KiB
   classes (the class a value of ``n`` bytes takes is ``n + 10``'s), and of small tails.
2. **Chunks**: real kvcodec blobs (random bf16 K and V, ``per_page_head``/16, 256-token chunks) of
   the bench model (12 layers, 4 KV heads x 64) and of Llama-3-8B (32 layers, 8 KV heads x 128),
   each chunk's layers and its manifest under the connector's names, written (a) as values whole,
   one ``SET`` each, as RedisStore wrote them before issue 36, and (b) by ``RedisStore.put_many``
   (heads of exactly one class and small tails); each with and without a fleet key. ``used_memory``
   after over before (a flushed server), once the server has trimmed the writer's query buffer (its
   clients cron, ~2 s; also shown just after the writes), over the raw bf16 KV of the chunks. (b) is then read back,
   one ``get_parsed_many`` per chunk, bytes compared, round trips counted.

Target (issue 36): ``used_memory`` <= 0.78x raw for both geometries, one round trip per chunk read.
A table to stdout, numbers to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
runpy.run_path(str(REPO / "tests" / "paths.py"))["import_tests_package"]()  # no repo root on sys.path

import torch  # noqa: E402

from kvcodec import encode  # noqa: E402
from kvcodec.format import Hashes, Header, ScaleScope, assemble  # noqa: E402
from kvcodec.integrations.vllm.chunk_keys import group_of  # noqa: E402
from kvcodec.store import StoreOptions, open_store  # noqa: E402
from kvcodec.store.auth import seal  # noqa: E402
from tests.redis_servers import RedisServer, chunk_keys, redis_single  # noqa: E402

CHUNK = 256
FLEET_KEY = b"bench fleet key, 32 bytes long!!"


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    chunks: int

    @property
    def raw_layer(self) -> int:
        """Raw bf16 K and V of one layer's chunk."""
        return 2 * CHUNK * self.kv_heads * self.head_dim * 2


GEOMETRIES = (
    Geometry("bench model (12 x 4 x 64)", 12, 4, 64, 17),
    Geometry("Llama-3-8B (32 x 8 x 128)", 32, 8, 128, 3),
)


def identity(geo: Geometry, chunk: int) -> dict[str, str]:
    """Hashes as the connector writes them (the model's path, its layout, dims and the prefix hash)."""
    layout = f"NHD|block=16|dk={geo.head_dim},dv={geo.head_dim}|prefix={chunk:032x}"
    return {"model_id": "/models/meta-llama/Meta-Llama-3-8B-Instruct", "kv_layout": layout}


def layer_blob(geo: Geometry, layer: int, chunk: int) -> bytes:
    g = torch.Generator().manual_seed(chunk * 1000 + layer)
    k, v = (torch.randn(CHUNK, geo.kv_heads, geo.head_dim, generator=g).to(torch.bfloat16) for _ in range(2))
    hashes = identity(geo, chunk)
    blob = encode(k, v, scope="per_page_head", page_size=16, hashes=hashes, layer_id=layer, chunk_id=chunk)
    return bytes(blob)


def manifest(chunk: int) -> bytes:
    h = Header(
        k_dtype=torch.bfloat16,
        v_dtype=torch.float8_e4m3fn,
        scale_scope=ScaleScope.EXTERNAL,
        version=2,
        layer_id=-1,
        chunk_id=chunk,
        chunk_size=CHUNK,
        hashes=Hashes(
            model_id="/models/meta-llama/Meta-Llama-3-8B-Instruct", kv_layout=f"|prefix={chunk:032x}"
        ),
    )
    return bytes(assemble(h))


def chunk_items(geo: Geometry, chunk: int) -> list[tuple[str, bytes]]:
    keys = chunk_keys(geo.layers, chunk, model16="0123456789abcdef")
    blobs = [layer_blob(geo, layer, chunk) for layer in range(geo.layers)] + [manifest(chunk)]
    return list(zip(keys, blobs))


def probe_classes(server: RedisServer) -> list[dict[str, int]]:
    """``MEMORY USAGE`` of one key per value size around two classes, and of tail-sized values."""
    name = "kvcodec:{C1-Hbench}:0123456789abcdef-L0-C1-Hbench-P0"
    sizes = [c + d for c in (196_608, 786_432) for d in (-11, -10, -9, 0, 400, 900)]
    rows = []
    with server.client() as c:
        c.flushall()
        for n in [*sizes, 100, 400, 900, 2000]:
            c.set(name, b"\0" * n)
            rows.append({"value_bytes": n, "memory_usage": int(c.memory_usage(name))})
        c.flushall()
    return rows


def write_whole(server: RedisServer, store: Any, fleet_key: bytes | None, items: list) -> None:
    """As RedisStore wrote before issue 36: each value whole, one SET."""
    with server.client(timeout=30) as c:
        pipe = c.pipeline(transaction=False)
        for key, blob in items:
            name = store.name_of(key)
            pipe.set(name, seal(fleet_key, name, blob) if fleet_key else blob)
        pipe.execute()


def measure(server: RedisServer, geo: Geometry, chunks: list, sized: bool, fleet_key: bytes | None) -> dict:
    with server.client() as c:
        c.flushall()
    empty = server.used_memory()
    opts = StoreOptions(group_of=group_of, fleet_key=fleet_key, timeout_s=30.0)
    with open_store(server.url, opts) as store:
        for items in chunks:
            store.put_many(items) if sized else write_whole(server, store, fleet_key, items)
        at_once = server.used_memory() - empty
        used = settled_used_memory(server) - empty
        row = {"geometry": geo.name, "layout": "sized" if sized else "whole", "mac": bool(fleet_key)}
        raw = geo.raw_layer * geo.layers * len(chunks)
        values = sum(len(b) for items in chunks for _, b in items)
        row |= {"raw_kv": raw, "blobs": values, "used_memory": used, "used_over_raw": used / raw}
        row |= {"used_over_raw_at_once": at_once / raw}
        row |= {"blobs_over_raw": values / raw, "keys": server_keys(server)}
        if sized:
            row |= read_back(store, chunks)
    return row


def settled_used_memory(server: RedisServer) -> int:
    """``used_memory`` once the server has trimmed the writer's query buffer (its clients cron does
    within about 2 s of an idle connection; the store keeps its connection), polled up to 10 s."""
    for _ in range(20):
        with server.client() as c:
            info = c.info("memory")
        if int(info["mem_clients_normal"]) < 64 << 10:
            break
        time.sleep(0.5)
    return int(info["used_memory"])


def server_keys(server: RedisServer) -> int:
    with server.client() as c:
        return int(c.dbsize())


def read_back(store: Any, chunks: list) -> dict[str, Any]:
    """Every chunk read back by one ``get_parsed_many`` (bounded by its largest blob), bytes compared."""
    before = store.stats()["round_trips"]
    same = True
    for items in chunks:
        keys = [k for k, _ in items]
        got = store.get_parsed_many(keys, max_bytes=max(len(b) for _, b in items))
        same = same and all(bytes(p.blob) == b for p, (_, b) in zip(got, items))
    trips = store.stats()["round_trips"] - before
    return {"read_back_equal": same, "round_trips_per_chunk_read": trips / len(chunks)}


def table(classes: list[dict], rows: list[dict]) -> str:
    out = ["| value bytes | MEMORY USAGE |", "|---|---|"]
    out += [f"| {r['value_bytes']:,} | {r['memory_usage']:,} |" for r in classes]
    out += [
        "",
        "| geometry | layout | MAC | blob bytes (layer) | blobs / raw | used_memory / raw "
        "| just after the writes | keys | trips/chunk read |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        trips = r.get("round_trips_per_chunk_read", "-")
        out.append(
            f"| {r['geometry']} | {r['layout']} | {'yes' if r['mac'] else 'no'} | {r['layer_blob']:,} "
            f"| {r['blobs_over_raw']:.4f} | {r['used_over_raw']:.4f} | {r['used_over_raw_at_once']:.4f} "
            f"| {r['keys']} | {trips} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the numbers here")
    args = ap.parse_args(argv)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, redis_single(Path(tmp)) as server:
        classes = probe_classes(server)
        for geo in GEOMETRIES:
            chunks = [chunk_items(geo, c) for c in range(geo.chunks)]
            for sized in (False, True):
                for key in (None, FLEET_KEY):
                    row = measure(server, geo, chunks, sized, key)
                    rows.append(row | {"layer_blob": len(chunks[0][0][1])})
                    print(f"{row['geometry']} {row['layout']} mac={row['mac']}: {row['used_over_raw']:.4f}")
    print(table(classes, rows))
    met = all(r["used_over_raw"] <= 0.78 for r in rows if r["layout"] == "sized")
    one_trip = all(r["round_trips_per_chunk_read"] == 1.0 for r in rows if r["layout"] == "sized")
    equal = all(r["read_back_equal"] for r in rows if r["layout"] == "sized")
    print(
        f"target used_memory <= 0.78x raw (sized): {'met' if met else 'NOT met'}; "
        f"one round trip per chunk read: {one_trip}; read back equal: {equal}"
    )
    if args.json:
        args.json.write_text(json.dumps({"classes": classes, "rows": rows}, indent=1) + "\n")
    return 0 if met and one_trip and equal else 1


if __name__ == "__main__":
    sys.exit(main())
