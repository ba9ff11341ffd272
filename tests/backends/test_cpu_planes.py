"""planes.c (the lossless payload's K byte planes) against numpy, and its argument checks."""

from __future__ import annotations

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
