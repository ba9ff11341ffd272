"""planes.c (the lossless payload's K byte planes) and nibbles.c (its split V codes) against numpy and
the format, and their argument checks."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvcodec import backends
from kvcodec.backends.cpu import AVAILABLE
from kvcodec.errors import UnsupportedConfigError

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="kvcodec._cpu is not built")


@pytest.mark.parametrize(
    "shape",
    [
        (0, 2, 3),
        (1, 1, 1),
        (7, 3, 5),
        (8, 2, 4),
        (19, 3, 5),
        (33, 3, 8),
        (9, 1, 12),
        (27, 2, 10),
        (256, 8, 128),
    ],
)
def test_split_and_merge_match_numpy(shape) -> None:
    t, h, d = shape
    k = np.random.default_rng(t).integers(0, 1 << 16, shape, dtype=np.uint16)
    hi, lo = np.empty(t * h * d, np.uint8), np.empty(t * h * d, np.uint8)
    assert backends.k_planes(k, hi, lo, t, h, d, merge=False)
    kb = k.view(np.uint8).reshape(t, h, d, 2)
    np.testing.assert_array_equal(hi.reshape(h, d, t), kb[..., 1].transpose(1, 2, 0))
    np.testing.assert_array_equal(lo.reshape(t, h, d), kb[..., 0])
    back = np.zeros_like(k)
    assert backends.k_planes(back, hi, lo, t, h, d, merge=True)
    np.testing.assert_array_equal(back, k)


def test_wrong_lengths_overlap_and_read_only_are_refused() -> None:
    k = np.zeros((4, 2, 3), np.uint16)
    hi, lo = np.empty(24, np.uint8), np.empty(24, np.uint8)
    with pytest.raises(UnsupportedConfigError, match="hi is 23 bytes"):
        backends.k_planes(k, hi[:23], lo, 4, 2, 3, merge=False)
    with pytest.raises(UnsupportedConfigError, match="share memory"):
        backends.k_planes(k, k.reshape(-1).view(np.uint8)[:24], lo, 4, 2, 3, merge=False)
    with pytest.raises(UnsupportedConfigError):
        backends.k_planes(bytes(48), hi, lo, 4, 2, 3, merge=True)  # K read-only
    with pytest.raises(UnsupportedConfigError, match=">= 0"):
        backends.k_planes(k, hi, lo, -4, 2, 3, merge=False)
    with pytest.raises(UnsupportedConfigError, match="fit"):
        backends.k_planes(k, hi, lo, 1 << 62, 1 << 30, 1 << 30, merge=False)


def _nibbles_oracle(v: np.ndarray, t: int, h: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """docs/FORMAT.md's "Split V codes" in plain numpy: each head's exponents, then the nibble plane."""
    exp = ((v.reshape(t, h, d) >> 3) & 15).transpose(1, 0, 2).reshape(-1)
    s = [*(((v >> 4) & 8) | (v & 7)).tolist(), 0]
    return exp, np.array([s[i] | s[i + 1] << 4 for i in range(0, v.size, 2)], np.uint8)


# head_dim 32 and 64: the AVX2 rows (where the CPU has them); 8, 24: 8 codes a word; 5, 3, 1: one at a time
NIBBLE_SHAPES = [(0, 2, 8), (1, 1, 1), (7, 3, 5), (5, 1, 3), (4, 2, 8), (3, 3, 24), (9, 2, 32), (16, 8, 128)]


@pytest.mark.parametrize("shape", NIBBLE_SHAPES)
def test_v_nibbles_split_and_merge_match_the_format(shape) -> None:
    t, h, d = shape
    n = t * h * d
    v = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    exp, nib = np.empty(n, np.uint8), np.full((n + 1) // 2, 0xEE, np.uint8)
    assert backends.v_nibbles(v, exp, nib, t, h, d, merge=False)
    want_exp, want_nib = _nibbles_oracle(v, t, h, d)
    np.testing.assert_array_equal(exp, want_exp)
    np.testing.assert_array_equal(nib, want_nib)
    back = np.zeros_like(v)
    assert backends.v_nibbles(back, exp, nib, t, h, d, merge=True)
    np.testing.assert_array_equal(back, v)


def test_v_nibbles_merge_keeps_an_exponent_to_its_4_bits() -> None:
    """Exponents are at most 15 in a blob the parser took; a larger byte still touches no other code."""
    exp, nib = np.full(32, 0xFF, np.uint8), np.zeros(16, np.uint8)
    v = np.empty(32, np.uint8)
    assert backends.v_nibbles(v, exp, nib, 1, 1, 32, merge=True)
    np.testing.assert_array_equal(v, np.full(32, 15 << 3, np.uint8))


def test_v_nibbles_at_the_scalar_level_match_the_format() -> None:
    """KVCODEC_CPU_LEVEL=scalar: the rows of 32 go 8 codes a word instead of through AVX2; the same bytes."""
    code = (
        "import numpy as np; from kvcodec import backends; "
        "v = np.arange(4 * 2 * 64, dtype=np.uint32).astype(np.uint8) * 37; "
        "e = np.empty(v.size, np.uint8); s = np.empty(v.size // 2, np.uint8); "
        "backends.v_nibbles(v, e, s, 4, 2, 64, merge=False); b = np.empty_like(v); "
        "backends.v_nibbles(b, e, s, 4, 2, 64, merge=True); print(e.tobytes().hex(), s.tobytes().hex(), (b == v).all())"
    )
    env = {**os.environ, "KVCODEC_CPU_LEVEL": "scalar"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    exp, nib, same = out.stdout.split()
    v = (np.arange(4 * 2 * 64, dtype=np.uint32).astype(np.uint8) * 37).astype(np.uint8)
    want_exp, want_nib = _nibbles_oracle(v, 4, 2, 64)
    assert (exp, nib, same) == (want_exp.tobytes().hex(), want_nib.tobytes().hex(), "True")


def test_v_nibbles_refuses_wrong_lengths_and_overlap() -> None:
    v, exp, nib = np.zeros(24, np.uint8), np.empty(24, np.uint8), np.empty(12, np.uint8)
    with pytest.raises(UnsupportedConfigError, match="nib is 11 bytes"):
        backends.v_nibbles(v, exp, nib[:11], 4, 2, 3, merge=False)
    with pytest.raises(UnsupportedConfigError, match="share memory"):
        backends.v_nibbles(v, v, nib, 4, 2, 3, merge=False)
    with pytest.raises(UnsupportedConfigError):
        backends.v_nibbles(bytes(24), exp, nib, 4, 2, 3, merge=True)  # V read-only
    with pytest.raises(UnsupportedConfigError, match=">= 0"):
        backends.v_nibbles(v, exp, nib, 4, -2, 3, merge=False)


@pytest.mark.parametrize("shape", [(4, 2, 8), (3, 3, 24), (9, 2, 32), (16, 8, 128), (5, 1, 6), (7, 3, 2)])
def test_v_nibbles_pairs_split_the_same_exponents_two_a_byte(shape) -> None:
    """The encode's split (each head's exponents two a byte, for huff_encode_pairs): the same nibbles, and
    the exponents of the plain split packed low nibble first."""
    t, h, d = shape
    n = t * h * d
    v = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    want_exp, want_nib = _nibbles_oracle(v, t, h, d)
    exp2, nib = np.full(n // 2, 0xEE, np.uint8), np.full(n // 2, 0xEE, np.uint8)
    assert backends.v_nibbles_pairs(v, exp2, nib, t, h, d)
    np.testing.assert_array_equal(nib, want_nib)
    np.testing.assert_array_equal(exp2, want_exp[0::2] | (want_exp[1::2] << 4))


def test_v_nibbles_pairs_refuses_an_odd_count_and_wrong_lengths() -> None:
    v = np.zeros(15, np.uint8)
    with pytest.raises(UnsupportedConfigError, match="even count"):
        backends.v_nibbles_pairs(v, np.empty(8, np.uint8), np.empty(8, np.uint8), 5, 1, 3)
    v = np.zeros(6, np.uint8)  # an even count, but each head's 3 codes odd: a byte would hold two heads
    with pytest.raises(UnsupportedConfigError, match="even count of codes a head"):
        backends.v_nibbles_pairs(v, np.empty(3, np.uint8), np.empty(3, np.uint8), 3, 2, 1)
    v = np.zeros(16, np.uint8)
    with pytest.raises(UnsupportedConfigError, match="exp2 is 16 bytes"):
        backends.v_nibbles_pairs(v, np.empty(16, np.uint8), np.empty(8, np.uint8), 4, 1, 4)
