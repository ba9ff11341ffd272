"""LMCache's own bench client standing for one host's vLLM: ``store`` or ``load`` against a server.

Each step of a plan is one action on one server (one host), in order:
``store``: for each sequence, STORE every full chunk (the server's L1, then its L2 through the serde)
and save the stored blocks of every layer to ``--ref``.
``load``: for each sequence, zero the request's blocks, LOOKUP (the server prefetches from L2 through
the serde), RETRIEVE the chunks that hit, and compare with ``--ref``: K bit-exact, V within FP8
e4m3's half-ulp (2^-4) of the amax. Blocks of chunks that did not hit must stay zero (never wrong data).
Writes a JSON summary to ``--json``.

Run as ``python -m tests.integrations.lmcache.fleet.client PLAN.json ...``.
"""

from __future__ import annotations

import argparse
import json

import torch
from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
from lmcache.cli.commands.bench.server_bench.config import BenchConfig

__all__ = ["main"]

NUM_TOKENS = 1024
"""Tokens per sequence: four 256-token chunks (LMCache's default chunk size)."""


def _kv_blocks(client: ServerBenchClient, request) -> list[torch.Tensor]:
    """Each layer's ``[2, blocks, block_size, heads, head_dim]`` slice of the request (views into SHM).

    LMCache's bench client keeps its Workers' KV tensors in ``_workers``; this test client needs them to
    see what the server wrote (the bench tool itself only checksums them).
    """
    tensors = []
    for worker in client._workers:
        for t in worker.kv_caches.values():
            tensors.append(t.narrow(1, request.block_offset, request.num_blocks))
    return tensors


def _compare(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    k_exact = all(torch.equal(g[0].view(torch.int16), r[0].view(torch.int16)) for g, r in zip(got, ref))
    v_err = max(float((g[1].float() - r[1].float()).abs().max()) for g, r in zip(got, ref))
    v_amax = max(float(r[1].float().abs().max()) for r in ref)
    return {"k_exact": k_exact, "v_max_err": v_err, "v_bound": v_amax * 2**-4}


def _store(client: ServerBenchClient, seqs: int, ref_path: str) -> dict:
    refs, stores = {}, []
    for seq in range(seqs):
        req = client.create_request(seq, f"store-{seq}", "store")
        res = client.store(req, 0, req.num_full_tokens)
        stores.append({"seq": seq, "ok": bool(res and res.succeeded), "ms": res.latency_ms if res else None})
        if ref_path:
            refs[seq] = [t.clone() for t in _kv_blocks(client, req)]
        client.end_session(req)
    if ref_path:
        torch.save(refs, ref_path)
    return {"stores": stores, "chunks_per_seq": req.total_chunks}


def _load(client: ServerBenchClient, seqs: int, ref_path: str) -> dict:
    refs = torch.load(ref_path) if ref_path else None  # None: timing only (the benchmark)
    out = []
    for seq in range(seqs):
        req = client.create_request(seq, f"load-{seq}", "load")
        blocks = _kv_blocks(client, req)
        for t in blocks:
            t.zero_()
        hit = client.lookup(req)
        row = {
            "seq": seq,
            "hit_chunks": hit.hit_chunks,
            "total_chunks": hit.total_chunks,
            "lookup_ms": hit.latency_ms,  # LMCache's client times it (as the retrieve's latency_ms)
        }
        if hit.hit_chunks:
            n_tok = hit.hit_chunks * req.chunk_size
            res = client.retrieve(req, 0, n_tok)
            row["retrieved"] = bool(res and res.succeeded)
            row["retrieve_ms"] = res.latency_ms if res else None
            n_blk = n_tok // (req.num_full_tokens // req.num_blocks)
            if refs is not None:
                got = [b.narrow(1, 0, n_blk) for b in blocks]
                row.update(_compare(got, [r.narrow(1, 0, n_blk) for r in refs[seq]]))
            rest = [b.narrow(1, n_blk, req.num_blocks - n_blk) for b in blocks]
        else:
            rest = blocks
        row["untouched_zero"] = all(not bool(t.any()) for t in rest)  # chunks that missed: nothing written
        client.end_session(req)
        out.append(row)
    return {"loads": out}


def _run_step(step: dict, seqs: int, shape_spec: str) -> dict:
    config = BenchConfig(
        rpc_url=step["rpc_url"],
        http_url=step["http_url"],
        mode="cpu",
        transfer_mode="lmcache_driven",
        tp_size=1,
        use_mla=False,
        num_tokens=NUM_TOKENS,
        kvcache_shape_spec=shape_spec,
        num_blocks=512,
        block_size=16,
    )
    client = ServerBenchClient(config, print)
    client.start()
    try:
        return (_store if step["action"] == "store" else _load)(client, seqs, step["ref"])
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "plan", help='JSON file: a list of {"name", "action": store|load, "rpc_url", "http_url", "ref"}'
    )
    ap.add_argument("--seqs", type=int, default=3)
    ap.add_argument("--shape-spec", required=True)
    ap.add_argument("--json", required=True, help="where the summary of every step goes (by name)")
    args = ap.parse_args(argv)
    with open(args.plan) as f:
        plan = json.load(f)
    summary = {}
    for step in plan:
        print(f"=== {step['action']} on {step['name']} ({step['rpc_url']})", flush=True)
        summary[step["name"]] = _run_step(step, args.seqs, args.shape_spec)
    with open(args.json, "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
