"""One chunk's read, side by side: a local directory, Redis on kvcodec's own socket, Redis through redis-py.

``python bench/fleet/wire.py [--json FILE]`` (the repo's ``.venv``): a 12-layer chunk of the fleet
bench model's geometry (256 tokens x 4 KV heads x 64, bf16, per_page_head/16: 197 KB blobs, each
stored in Redis as a head and a small tail) is written to a directory store and to one redis-server
on 127.0.0.1 (started and stopped here), then ``get_parsed_many`` of the chunk is timed on each,
the ways taking turns for ``--rounds`` rounds of ``--reads`` reads; medians per way, and the
ratios of each round's medians. The reads return the same bytes (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
runpy.run_path(str(REPO / "tests" / "paths.py"))["import_tests_package"]()  # no repo root on sys.path

from kvcodec import encode  # noqa: E402
from kvcodec.store import StoreOptions, open_store  # noqa: E402
from tests.redis_servers import redis_single  # noqa: E402

LAYERS, TOKENS, HEADS, DIM, PAGE = 12, 256, 4, 64, 16
WAYS = {"directory": None, "redis wire": "wire", "redis client (hiredis)": "client"}


def chunk() -> list[tuple[str, bytes]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for layer in range(LAYERS):
        k, v = (torch.randn(TOKENS, HEADS, DIM, generator=gen).to(torch.bfloat16) for _ in range(2))
        out.append((f"c0.l{layer}", bytes(encode(k, v, layer_id=layer, page_size=PAGE))))
    return out


def timed(store: Any, keys: list[str], bound: int, reads: int) -> float:
    """Median seconds of ``reads`` reads of the chunk."""
    ts = []
    for _ in range(reads):
        t0 = time.perf_counter()
        store.get_parsed_many(keys, max_bytes=bound)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run(work: Path, rounds: int, reads: int) -> dict[str, Any]:
    items = chunk()
    keys, bound = [k for k, _ in items], max(len(b) for _, b in items)
    with redis_single(work) as server:
        stores = {}
        for way, reads_env in WAYS.items():
            os.environ["KVCODEC_REDIS_READS"] = reads_env or "wire"
            url = str(work / "dir") if reads_env is None else server.url
            stores[way] = open_store(url, StoreOptions(timeout_s=5.0))
        stores["directory"].put_many(items)
        stores["redis wire"].put_many(items)
        per_round: list[dict[str, float]] = []
        for _ in range(rounds):
            row = {}
            for way, st in stores.items():
                os.environ["KVCODEC_REDIS_READS"] = WAYS[way] or "wire"
                assert [bytes(p.blob) for p in st.get_parsed_many(keys, max_bytes=bound)] == [
                    b for _, b in items
                ]
                row[way] = timed(st, keys, bound, reads)
            per_round.append(row)
        for st in stores.values():
            st.close()
    med = {w: statistics.median(r[w] for r in per_round) for w in WAYS}
    ratios = {w: statistics.median(r[w] / r["directory"] for r in per_round) for w in WAYS}
    return {
        "chunk_bytes": sum(len(b) for _, b in items),
        "median_s": med,
        "vs_directory": ratios,
        "rounds": per_round,
        "loadavg": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reads", type=int, default=30)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvcodec-wire-") as d:
        res = run(Path(d), args.rounds, args.reads)
    print(
        f"a chunk of {res['chunk_bytes']} bytes, medians of {args.reads} reads x {args.rounds} rounds; "
        f"load average {res['loadavg'][0]:.2f}"
    )
    for way in WAYS:
        print(
            f"  {way:<24} {res['median_s'][way] * 1e3:6.2f} ms  {res['vs_directory'][way]:.2f}x the directory"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
