"""decode's memory is bounded by the bytes present, never by a size a header declares: header fields at
boundary values (2**40 page sizes, 2**63 dims) decode what the payload holds or raise a CodecError, under a
capped address space."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcodec import CodecError, decode
from tests._helpers import raw_blob
from tests.paths import IMPORT_TESTS, REPO_ROOT


def _backends() -> list[str]:
    from kvcodec.backends import cpu

    return ["torch", "cpu"] if cpu.AVAILABLE else ["torch"]


_BOUNDED = textwrap.dedent(
    """
    import resource, sys, torch, kvcodec
    torch.set_num_threads(1)
    k = torch.randn(2, 1, 8).half(); v = torch.randn(2, 1, 8).half()
    # Allow ~256 MiB more address space than now: a pages*page_size allocation of
    # 2**28 fp32 rows (1 GiB) or more fails with an error, and the test with it.
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
    for backend in sys.argv[1:]:
        for ps in (2**28, 2**40):
            for extra in ({}, {"scale_dtype": torch.float16}, {"nonfinite": "saturate"}):
                blob = kvcodec.encode(k, v, scope="per_page_head", page_size=ps, backend=backend, **extra)
                out = kvcodec.decode(blob, out_v_dtype=torch.float16, backend=backend)
                assert out.v.shape == (2, 1, 8) and torch.equal(out.k, k)
            vonly = kvcodec.encode(None, v, scope="per_page_head", page_size=ps, backend=backend)
            kvcodec.decode(vonly, out_v_dtype=torch.float32, backend=backend)
    print("ok")
    """
)


def test_huge_page_size_allocates_nothing_big() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _BOUNDED, *_backends()],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


_EDGES = [0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**40, 2**48, 2**63 - 1, -(2**63)]


_DIMS = st.sampled_from([1, 2, 4, 8, *_EDGES])  # real sizes too, so that many cases get past the parser


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scope=st.integers(0, 4),
    chunk=_DIMS,
    page=_DIMS,
    heads=_DIMS,
    dim=_DIMS,
    shape=st.lists(_DIMS, max_size=3),
    n_el=st.sampled_from([0, 1, 8, 16]),
    dequant=st.booleans(),
)
def test_boundary_headers_only_raise_codec_errors(
    scope, chunk, page, heads, dim, shape, n_el, dequant
) -> None:
    n_scales = 1
    for d in shape:
        n_scales *= d
    s = bytes(4 * n_scales) if 0 <= n_scales <= 64 else bytes(8)  # a scale payload that can match
    blob = raw_blob(
        scope=scope,
        chunk_size=chunk,
        page_size=page,
        kv_head_count=heads,
        head_dim=dim,
        scale_shape=shape,
        k=bytes(2 * n_el),
        v=bytes(n_el),
        s=s,
    )
    try:
        out = decode(blob, out_v_dtype=torch.float16 if dequant else None)
    except CodecError:
        event("refused")
        return
    event("decoded, dequantized" if dequant and n_el else "decoded")
    assert out.v.numel() == n_el  # what decodes holds exactly the bytes present


@pytest.mark.parametrize("page", [2, 2**28, 2**40])
@pytest.mark.parametrize("chunk", [-1, 4, 2**40])
def test_boundary_fields_that_decode_hold_only_the_bytes_present(page: int, chunk: int) -> None:
    """Cases of the property above that must get past the parser and dequantize."""
    blob = raw_blob(
        scope=2,
        chunk_size=chunk,
        page_size=page,
        kv_head_count=2,
        head_dim=2,
        scale_shape=(1, 2),
        k=bytes(16),
        v=bytes(8),
        s=torch.tensor([1.0, 2.0]).numpy().tobytes(),
    )
    out = decode(blob, out_v_dtype=torch.float16)
    assert out.v.shape == (2, 2, 2) and out.k.shape == (2, 2, 2)


_PROPERTY_UNDER_RLIMIT = textwrap.dedent(
    """
    import resource
    with open("/proc/self/statm") as f:
        import tests.codec.test_decode_memory_bounds as t  # imports torch, hypothesis: counted before the limit
        vm = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
    t.test_boundary_headers_only_raise_codec_errors()
    print("ok")
    """
)


def test_boundary_headers_stay_within_a_fixed_memory_bound() -> None:
    """The property above, run with the address space capped at +256 MiB: a header-driven allocation fails it."""
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_TESTS + _PROPERTY_UNDER_RLIMIT],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
