"""K's byte planes of the lossless payload on the device (kernels/planes_triton.py) vs the C planes and numpy.

The split must give the bytes ``kvcodec.backends.k_planes`` (kvcodec/csrc/planes.c) gives and a numpy
oracle of docs/FORMAT.md's layout (high plane ``[H, D, T]``, low plane ``[T, H, D]``); the merge must
give K back bit for bit. Every 16-bit pattern may occur (NaN, Inf, subnormals): K is random bits.
Without a GPU these run in Triton's interpreter; sizes are small.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.conftest import CUDA, DEVICE, KERNEL_MARKS, require_kernels

require_kernels()

from kvcodec.kernels import configs, planes_triton  # noqa: E402

from kvcodec import backends, decode, encode  # noqa: E402
from kvcodec.backends import Declined  # noqa: E402
from kvcodec.codec import huffman, lossless, lossless_device  # noqa: E402
from kvcodec.errors import UnsupportedConfigError  # noqa: E402
from kvcodec.format import parse, read_coding  # noqa: E402

pytestmark = KERNEL_MARKS

DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
SHAPES = [
    pytest.param((1, 1, 64), id="1x1x64"),
    pytest.param((37, 3, 80), id="37x3x80"),
    pytest.param((19, 8, 128), id="19x8x128"),
    pytest.param((64, 1, 128), id="64x1x128"),
]


def rand_k(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random 16-bit patterns (every class of value) as ``dtype``, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-32768, 32768, shape, generator=g, dtype=torch.int32).to(torch.int16).view(dtype)


def oracle(k: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """docs/FORMAT.md's planes in numpy: byte 1 of each element channel by channel, byte 0 token-major."""
    t, h, d = k.shape
    kb = k.contiguous().view(torch.uint8).numpy().reshape(t, h, d, 2)
    return np.ascontiguousarray(kb[..., 1].transpose(1, 2, 0)).reshape(-1), kb[..., 0].reshape(-1).copy()


def c_split(k: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """The C loops' planes (None when kvcodec._cpu is not built)."""
    t, h, d = k.shape
    hi, lo = np.empty(k.numel(), np.uint8), np.empty(k.numel(), np.uint8)
    kb = memoryview(k.contiguous().view(torch.uint8).numpy()).cast("B")
    return (hi, lo) if backends.k_planes(kb, hi, lo, t, h, d, merge=False) else None


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().cpu().contiguous().view(torch.int16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_split_equals_c_and_numpy(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    k = rand_k(shape, dtype)
    hi, lo = planes_triton.split_k_planes(k.to(DEVICE))
    want_hi, want_lo = oracle(k)
    assert np.array_equal(hi.cpu().numpy(), want_hi) and np.array_equal(lo.cpu().numpy(), want_lo)
    c = c_split(k)
    if c is not None:
        assert np.array_equal(hi.cpu().numpy(), c[0]) and np.array_equal(lo.cpu().numpy(), c[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_merge_gives_k_back(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    k = rand_k(shape, dtype, seed=1)
    hi, lo = oracle(k)
    out = torch.full(shape, 7, dtype=torch.int16).view(dtype).to(DEVICE)
    got = planes_triton.merge_k_planes(torch.from_numpy(hi).to(DEVICE), torch.from_numpy(lo).to(DEVICE), out)
    assert got is out and torch.equal(bits(out), bits(k))


def test_many_tiles_with_a_partial_last_one() -> None:
    """BLOCK_T forced to 16: 37 tokens take three programs per head, the last one 5 rows."""
    k = rand_k((37, 3, 80), torch.bfloat16, seed=2)
    with configs.override("_planes_split_kernel", configs.TileConfig(16, 1)):
        hi, lo = planes_triton.split_k_planes(k.to(DEVICE))
    want_hi, want_lo = oracle(k)
    assert np.array_equal(hi.cpu().numpy(), want_hi) and np.array_equal(lo.cpu().numpy(), want_lo)
    out = torch.empty_like(k).to(DEVICE)
    with configs.override("_planes_merge_kernel", configs.TileConfig(16, 1)):
        planes_triton.merge_k_planes(hi, lo, out)
    assert torch.equal(bits(out), bits(k))


def test_strided_k_in_and_out() -> None:
    """K read and written through any strides: a head-major buffer seen token-major, every other channel."""
    base = rand_k((3, 21, 128), torch.float16, seed=3)
    k = base.to(DEVICE).permute(1, 0, 2)[:, :, ::2]  # [21, 3, 64], strides (128, 2688, 2)
    hi, lo = planes_triton.split_k_planes(k)
    want_hi, want_lo = oracle(k.cpu().contiguous())
    assert np.array_equal(hi.cpu().numpy(), want_hi) and np.array_equal(lo.cpu().numpy(), want_lo)
    dst = torch.zeros(3, 21, 128, dtype=torch.float16, device=DEVICE)
    out = dst.permute(1, 0, 2)[:, :, 1::2]
    planes_triton.merge_k_planes(hi, lo, out)
    assert torch.equal(bits(out), bits(k)) and not bits(dst.permute(1, 0, 2)[:, :, ::2]).any()


def test_given_planes_empty_k_and_refusals() -> None:
    k = rand_k((5, 2, 64), torch.float16, seed=4).to(DEVICE)
    n = k.numel()
    hi, lo = (
        torch.empty(2, n // 2, dtype=torch.uint8, device=DEVICE),
        torch.empty(n, dtype=torch.uint8, device=DEVICE),
    )
    got = planes_triton.split_k_planes(k, hi=hi, lo=lo)
    assert got[0] is hi and got[1] is lo
    assert np.array_equal(hi.cpu().numpy().reshape(-1), oracle(k.cpu())[0])
    e_hi, e_lo = planes_triton.split_k_planes(torch.empty(0, 2, 64, dtype=torch.bfloat16, device=DEVICE))
    assert e_hi.numel() == e_lo.numel() == 0
    with pytest.raises(UnsupportedConfigError, match="dtype"):
        planes_triton.split_k_planes(k.float())
    with pytest.raises(UnsupportedConfigError, match=f"{n} bytes"):
        planes_triton.split_k_planes(k, hi=hi.reshape(-1)[1:])
    with pytest.raises(UnsupportedConfigError, match="not contiguous"):
        planes_triton.merge_k_planes(hi.t(), lo, torch.empty_like(k))
    with pytest.raises(UnsupportedConfigError, match="uint8"):
        planes_triton.merge_k_planes(hi, lo.view(torch.int8), torch.empty_like(k))


def test_planes_lane_through_the_backend() -> None:
    be = backends.select("triton", DEVICE)
    assert {"split_k_planes", "merge_k_planes"} <= be.lanes
    k = rand_k((9, 2, 80), torch.bfloat16, seed=5).to(DEVICE)
    hi, lo = backends.call(be, "split_k_planes", k, fallback=lambda: None)
    out = torch.empty_like(k)
    assert backends.call(be, "merge_k_planes", hi, lo, out, fallback=lambda: None) is out
    assert torch.equal(bits(out), bits(k))
    with pytest.raises(Declined, match="fp16/bf16"):
        be.split_k_planes(k.float())
    assert backends.call(be, "split_k_planes", k.float(), fallback=lambda: "host") == "host"
    with pytest.raises(Declined, match="no split_k_planes lane"):
        backends.reference_backend().split_k_planes(k)


def test_device_planes_are_the_lossless_blobs_planes() -> None:
    """The split the host Huffman stage would code is the one a lossless blob stores: its low plane raw,
    its high plane per head in the Huffman streams; and a merge from them gives the decoded K."""
    t, h, d = 21, 3, 64
    k = rand_k((t, h, d), torch.float16, seed=6).view(torch.int16)
    k = torch.where((k.view(torch.float16)).isfinite(), k, torch.zeros_like(k)).view(torch.float16)
    v = torch.randn(t, h, d).half()
    blob = encode(k, v, compression="lossless", scope="per_layer_head")
    p = parse(blob)
    c = read_coding(p.header, p.k, p.v)
    got = lossless_device.split_to_host(k.to(DEVICE), backend="triton")
    assert got is not None
    hi, lo = got
    raw = t * d
    assert bytes(p.k[c.k.raw_at : c.k.raw_at + k.numel()]) == lo.tobytes()
    for i, (at, n) in enumerate(c.k.streams):
        assert np.array_equal(huffman.decode(p.k[at : at + n], raw), hi[i * raw : (i + 1) * raw])
    out = torch.empty(t, h, d, dtype=torch.float16, device=DEVICE)
    low = bytes(p.k[c.k.raw_at : c.k.raw_at + k.numel()])  # read-only: only copied from
    assert lossless_device.merge_on_device(hi, low, out, backend="triton")
    assert torch.equal(bits(out), bits(decode(blob).k))


def test_device_helpers_leave_host_tensors_to_the_host_path() -> None:
    k = rand_k((4, 1, 64), torch.float16)
    assert lossless_device.split_to_host(k) is None
    assert lossless_device.merge_on_device(*oracle(k), torch.empty_like(k)) is False
    assert lossless_device.split_to_host(k.to(DEVICE).float().reshape(4, 1, 64), backend="triton") is None


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_default_backend_takes_the_planes_lane() -> None:
    """On a GPU no backend need be named: auto picks Triton for CUDA tensors."""
    k = rand_k((300, 8, 128), torch.bfloat16, seed=7)
    got = lossless_device.split_to_host(k.cuda())
    assert got is not None
    want = oracle(k)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    out = torch.empty_like(k).cuda()
    assert lossless_device.merge_on_device(*want, out)
    assert torch.equal(bits(out), bits(k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scope", ["per_page_head", "per_layer_head"])
def test_lossless_encode_through_device_planes_is_the_host_blob(dtype: torch.dtype, scope: str) -> None:
    """``encode(..., compression="lossless")`` with Triton splitting K's planes where K lives (the
    interpreter here, the GPU on one; K's bytes then never copied to the host) writes the blob the host
    path writes, byte for byte, and it decodes to K exactly."""
    t, h, d = 40, 3, 64
    k = torch.randn(t, h, d).to(dtype)
    v = torch.randn(t, h, d).to(dtype)
    opts = {"scope": scope, "page_size": 16, "compression": "lossless"}
    host = encode(k, v, **opts)
    got = encode(k.to(DEVICE), v.to(DEVICE), backend="triton", **opts)
    assert bytes(got) == bytes(host)
    assert torch.equal(bits(decode(got).k), bits(k))


def test_compress_blob_refuses_planes_of_the_wrong_size() -> None:
    k, v = torch.randn(8, 2, 64).half(), torch.randn(8, 2, 64).half()
    plain = encode(k, v, scope="per_layer_head")
    hi, lo = oracle(k)
    assert bytes(lossless.compress_blob(plain, k_planes=(hi, lo))) == bytes(lossless.compress_blob(plain))
    with pytest.raises(UnsupportedConfigError, match="k_planes"):
        lossless.compress_blob(plain, k_planes=(hi[:-1], lo))
    with pytest.raises(UnsupportedConfigError, match="k_planes"):
        lossless.compress_blob(plain, k_planes=(hi.astype(np.int8), lo))
