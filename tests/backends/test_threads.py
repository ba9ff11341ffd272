"""kvcodec starts no threads of its own: a caller's pool of 4 grows the process by 4 threads, no more."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT

_POOL = textwrap.dedent(
    """
    import os, torch, kvcodec
    from concurrent.futures import ThreadPoolExecutor

    def tasks():
        return len(os.listdir("/proc/self/task"))

    g = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(256, 8, 128, generator=g).half(), torch.randn(256, 8, 128, generator=g).half())
              for _ in range(16)]
    def work(kv):
        blob = kvcodec.encode(kv[0], kv[1], scope="per_page_head", page_size=16)
        kvcodec.decode(bytes(blob))
        kvcodec.decode(bytes(blob), out_v_dtype=torch.float16)
        # Calls the C loops decline run the torch reference: it must stay on this thread too.
        kvcodec.encode(kv[0], kv[1], scope="per_layer_head", nonfinite="saturate")
        e5 = kvcodec.encode(kv[0], kv[1], scope="per_tensor", v_dtype=torch.float8_e5m2, allow_e5m2=True)
        kvcodec.decode(e5, out_v_dtype=torch.float32)
        paged = kv[1].view(16, 16, 8, 128).transpose(0, 1)  # pages and slots swapped: not viewable as tokens
        kvcodec.encode(paged, paged, page_axis=1)
        return len(blob)
    work(chunks[0])  # imports, first-call setup
    before = tasks()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, chunks * 4))
        during = tasks()
    print(before, during)
    """
)


def test_a_pool_of_four_starts_no_threads_beyond_its_own() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _POOL], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, during = map(int, proc.stdout.split())
    assert during - before <= 4, f"{before} threads before, {during} with a pool of 4"
