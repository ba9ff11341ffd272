"""The vLLM connector's CPU load path, old way and new way, beside an ExampleConnector-like load.

One hit of ``--tokens`` tokens (``--tokens / --chunk`` chunks of ``--layers`` layers: one
blob per layer and chunk) is loaded from a DirectoryStore into fresh paged caches:

* ``old``: what ``KvcodecConnector._prepare_chunk`` / ``_write_prepared`` did per layer:
  ``store.get`` (mmap, header parse), ``decode_chunk`` (parse again with the CRC, identity,
  ids, dequantize V), ``scatter_kv``.
* ``new``: per chunk, ``store.get_parsed`` of every layer (one read, one CRC-verified parse),
  ``read_chunk`` (every check, nothing decoded), ``write_chunk`` (slots once; K copied and V
  dequantized straight into each cache by one C pass per layer).
* ``deferred``: the connector's CPU load path with ``loads.DEFER_CRC`` on: ``new`` with every blob read by
  ``get_parsed(verify_crc=False)`` (every check but the CRC; the header memoised only once the CRC
  passed) and its CRC checked by ``write_chunk``'s C pass while it writes K and V
  (``read_chunk(crc_checked=False)``). Both read into reused buffers, as the connector does.
* ``example``: vLLM's ExampleConnector's way: one safetensors file of raw 16-bit KV per layer
  (all ``--tokens`` tokens), loaded and copied into the cache by an indexed assignment.

The four take turns round after round (``--rounds``); each one's median CPU time (the calling
thread's: torch is held to one thread, kvcodec starts none) and wall time are reported with the
ratios against example and old, and the new and deferred paths' split between what the connector's
loader thread does (read and check) and what the engine step does (write), all written to
``bench/results/connector-load.json``. Before timing, the new and deferred paths' caches are checked
bit-identical to the old path's.

Run: ``.venv/bin/python bench/connector_load.py`` (defaults: a 12-layer model, 4 KV heads x 64,
bf16, vLLM block 32, chunk 256, 2048 tokens, per_page_head page 16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import safetensors.torch as st
import torch

from kvcodec.format.parser import clear_header_memo
from kvcodec.integrations.vllm.buffers import ReadBuffers
from kvcodec.integrations.vllm.chunk_writes import write_chunk
from kvcodec.integrations.vllm.chunks import ChunkCodec, decode_chunk, encode_chunk, read_chunk
from kvcodec.integrations.vllm.layout import scatter_kv
from kvcodec.store import DirectoryStore

RESULTS = Path(__file__).resolve().parent / "results" / "connector-load.json"


@dataclass(frozen=True)
class Geometry:
    layers: int = 12
    heads: int = 4
    head_size: int = 64
    block: int = 32
    chunk: int = 256
    tokens: int = 2048
    page: int = 16
    spare_blocks: int = 136
    """Blocks of each cache beyond the hit's, so the caches are as large as a real pool's share."""

    @property
    def chunks(self) -> int:
        return self.tokens // self.chunk

    @property
    def blocks(self) -> int:
        return self.tokens // self.block


class Setup:
    """A store holding one hit's blobs, the same KV as safetensors files, and caches to load into."""

    def __init__(self, g: Geometry, root: str) -> None:
        torch.manual_seed(0)
        self.g = g
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(g.layers)]
        self.layer_ids = {n: i for i, n in enumerate(self.names)}
        shape = (g.blocks + g.spare_blocks, g.heads, g.block, 2 * g.head_size)
        source = {n: torch.randn(shape).to(torch.bfloat16) for n in self.names}
        self.codec = ChunkCodec(
            head_size=g.head_size, block_size=g.block, page_size=g.page, hashes={"model_id": "bench"}
        )
        self.codecs = dict.fromkeys(self.names, self.codec)
        # The hit's blocks, scattered over the pool as a running engine's are.
        self.block_ids = list(range(g.spare_blocks, g.spare_blocks + g.blocks))[::-1]
        self.store = DirectoryStore(root, fsync=False, verify=False)
        for c in range(g.chunks):
            for n in self.names:
                blob = encode_chunk(
                    source[n],
                    self.block_ids,
                    self.codec,
                    start=c * g.chunk,
                    num_tokens=g.chunk,
                    layer_id=self.layer_ids[n],
                    chunk_id=c,
                    chunk_hash=self.chunk_hash(c),
                )
                self.store.put(self.key(n, c), blob)
        self.example_files = {}
        index = torch.tensor(self.block_ids)
        for n in self.names:
            path = f"{root}/example-{self.layer_ids[n]}.safetensors"
            st.save_file({"kv_cache": source[n][index].contiguous()}, path)
            self.example_files[n] = path
        self.example_index = index
        self.phases: dict[str, list[tuple[float, float]]] = {"new": [], "deferred": []}
        self.buffers = {way: ReadBuffers() for way in ("new", "deferred")}
        """As the connector's loads: each blob read into a reused buffer, given back once written."""
        self.caches = {way: {n: torch.zeros(shape, dtype=torch.bfloat16) for n in self.names} for way in WAYS}

    def key(self, name: str, c: int) -> str:
        return f"bench-L{self.layer_ids[name]}-C{c}-H{self.chunk_hash(c)}"

    @staticmethod
    def chunk_hash(c: int) -> str:
        return f"{c:016x}"

    # ------------------------------------------------------------ the three loads

    def load_old(self) -> None:
        g, caches = self.g, self.caches["old"]
        for c in range(g.chunks):
            for n in self.names:
                blob = self.store.get(self.key(n, c))
                k, v = decode_chunk(
                    blob,
                    caches[n],
                    self.codec,
                    num_tokens=g.chunk,
                    chunk_hash=self.chunk_hash(c),
                    ids=(self.layer_ids[n], c),
                )
                scatter_kv(
                    caches[n],
                    self.block_ids,
                    k,
                    v,
                    head_size=g.head_size,
                    block_size=g.block,
                    start=c * g.chunk,
                )

    def load_new(self, way: str = "new") -> None:
        """As the connector's loader thread (read and check) then its step (write) would; CPU time of
        each part recorded in ``phases``. ``deferred``: the CRC checked by the write's C pass."""
        g, caches = self.g, self.caches[way]
        verify = way == "new"
        reading = writing = 0.0
        for c in range(g.chunks):
            t0 = time.thread_time()
            pool = self.buffers[way]
            blobs = {
                n: self.store.get_parsed(self.key(n, c), into=pool.take(), verify_crc=verify)
                for n in self.names
            }
            chunk = read_chunk(
                blobs,
                caches,
                self.codecs,
                self.layer_ids,
                chunk_id=c,
                num_tokens=g.chunk,
                chunk_hash=self.chunk_hash(c),
                crc_checked=verify,
            )
            t1 = time.thread_time()
            write_chunk(chunk, caches, self.block_ids, start=c * g.chunk)
            pool.give([p.buffer.obj for p in blobs.values()])
            reading, writing = reading + t1 - t0, writing + time.thread_time() - t1
        self.phases[way].append((reading, writing))

    def load_deferred(self) -> None:
        self.load_new("deferred")

    def load_example(self) -> None:
        caches = self.caches["example"]
        for n in self.names:
            kv = st.load_file(self.example_files[n])["kv_cache"]
            caches[n][self.example_index] = kv


WAYS = ("old", "new", "deferred", "example")


RATIOS = (
    ("deferred", "example"),
    ("new", "example"),
    ("old", "example"),
    ("deferred", "new"),
    ("new", "old"),
)


def _rounds(
    fns: dict[str, Callable[[], None]], rounds: int, warmup: int, fresh: bool = False
) -> dict[str, dict[str, list[float]]]:
    """CPU and wall seconds of every call, the callables taking turns round after round (``fresh``:
    the parse memo emptied before each call, as for a hit whose chunks this process never read)."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    out: dict[str, dict[str, list[float]]] = {n: {"cpu": [], "wall": []} for n in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            if fresh:
                clear_header_memo()
            w0, c0 = time.perf_counter(), time.thread_time()
            f()
            out[name]["cpu"].append(time.thread_time() - c0)
            out[name]["wall"].append(time.perf_counter() - w0)
    return out


def _check(s: Setup) -> None:
    """The new and deferred paths write exactly the old path's bytes."""
    s.load_old()
    s.load_new()
    s.load_deferred()
    for way in ("new", "deferred"):
        for n in s.names:
            old, new = s.caches["old"][n], s.caches[way][n]
            if not torch.equal(old.view(torch.int16), new.view(torch.int16)):
                raise SystemExit(f"{way} and old loads differ in {n}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=Geometry.layers)
    ap.add_argument("--tokens", type=int, default=Geometry.tokens)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--fresh-headers", action="store_true", help="empty the parse memo before every timed load"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = Geometry(layers=args.layers, tokens=args.tokens)
    with tempfile.TemporaryDirectory() as root:
        s = Setup(g, root)
        _check(s)
        samples = _rounds(
            {w: getattr(s, f"load_{w}") for w in WAYS}, args.rounds, args.warmup, args.fresh_headers
        )
        phases = {w: p[-args.rounds :] for w, p in s.phases.items()}
        blob_bytes = sum(len(s.store.get_parsed(s.key(n, c)).blob) for n in s.names for c in range(g.chunks))
    med = {w: {k: statistics.median(v) * 1e3 for k, v in t.items()} for w, t in samples.items()}
    result = {
        "geometry": asdict(g),
        "blobs": g.layers * g.chunks,
        "blob_bytes": blob_bytes,
        "rounds": args.rounds,
        "median_ms": {w: {k: round(v, 3) for k, v in m.items()} for w, m in med.items()},
        "phases_median_cpu_ms": {
            w: {
                "read_and_check": round(statistics.median(r for r, _ in p) * 1e3, 3),
                "write": round(statistics.median(x for _, x in p) * 1e3, 3),
            }
            for w, p in phases.items()
        },
        **{
            f"ratio_{a}_vs_{b}": {k: round(med[a][k] / med[b][k], 3) for k in ("cpu", "wall")}
            for a, b in RATIOS
        },
        "fresh_headers": args.fresh_headers,
        "command": "python bench/connector_load.py" + (" --fresh-headers" if args.fresh_headers else ""),
        "torch_threads": torch.get_num_threads(),
    }
    print(
        f"{g.layers} layers x {g.chunks} chunks = {g.layers * g.chunks} blobs ({blob_bytes / 1e6:.1f} MB), {g.tokens} tokens"
    )
    print(f"{'way':10s} {'CPU ms':>9s} {'wall ms':>9s}")
    for w in WAYS:
        print(f"{w:10s} {med[w]['cpu']:9.2f} {med[w]['wall']:9.2f}")
    for w, ph in result["phases_median_cpu_ms"].items():
        print(
            f"{w} = read and check {ph['read_and_check']:.2f} ms (loader thread) + write {ph['write']:.2f} ms (step)"
        )
    for a, b in RATIOS:
        r = f"ratio_{a}_vs_{b}"
        print(f"{r:27s} CPU {result[r]['cpu']:.3f}  wall {result[r]['wall']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
