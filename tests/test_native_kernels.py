"""tiers._native.copy_rows: the host side of every page move. Errors are typed and
nothing is written through a silent temporary."""
from __future__ import annotations

import numpy as np
import pytest

from tiers.native import copy_rows


def rows(n: int, width: int = 48, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, width), dtype=np.uint8)


def test_gather_and_scatter_match_numpy():
    src, dst = rows(32), np.zeros((16, 48), dtype=np.uint8)
    si, di = np.array([5, 0, 31, 7], dtype=np.int64), np.array([3, 15, 0, 9], dtype=np.int64)
    copy_rows(src, si, dst, di)
    want = np.zeros_like(dst)
    want[di] = src[si]
    assert np.array_equal(dst, want)
    copy_rows(src[:16], None, dst, None)
    assert np.array_equal(dst, src[:16])


def test_within_one_buffer():
    buf = rows(8)
    want = buf.copy()
    want[[1, 6]] = buf[[4, 4]]
    copy_rows(buf, np.array([4, 4], dtype=np.int64), buf, np.array([1, 6], dtype=np.int64))
    assert np.array_equal(buf, want)
    copy_rows(buf, np.array([2], dtype=np.int64), buf, np.array([2], dtype=np.int64))  # a row onto itself
    assert np.array_equal(buf, want)


def test_bad_arguments_are_typed_errors_and_write_nothing():
    src, dst = rows(4), np.zeros((4, 48), dtype=np.uint8)
    with pytest.raises(IndexError):
        copy_rows(src, np.array([4], dtype=np.int64), dst, np.array([0], dtype=np.int64))
    with pytest.raises(IndexError):
        copy_rows(src, np.array([0], dtype=np.int64), dst, np.array([-1], dtype=np.int64))
    with pytest.raises(ValueError, match="widths"):
        copy_rows(src, None, np.zeros((4, 40), dtype=np.uint8), None)
    with pytest.raises(ValueError, match="counts"):
        copy_rows(src, np.array([0, 1], dtype=np.int64), dst, np.array([0], dtype=np.int64))
    with pytest.raises(TypeError):              # another index dtype is refused, not converted
        copy_rows(src, np.array([0], dtype=np.int32), dst, None)
    with pytest.raises(TypeError):              # a converted dst would take the writes and vanish
        copy_rows(src, None, np.zeros((4, 48), dtype=np.int16), None)
    overlapping = np.lib.stride_tricks.as_strided(np.zeros(96, dtype=np.uint8), (4, 48), (16, 1))
    with pytest.raises(ValueError, match="overlap"):
        copy_rows(src, None, overlapping, None)
    assert not dst.any()
