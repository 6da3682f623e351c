"""``cache_write`` with destination rows (its optional fourth input): the reference, shape
inference and the head_rope fusion leaving it alone. The kernel: tests/test_decode_kernels*.py."""

from __future__ import annotations

import numpy as np
import pytest

from fusec import ops as O
from fusec import reference as R
from fusec.dtypes import DType
from fusec.builder import GraphBuilder
from fusec.ops import Op


def test_rows_go_to_their_destination_and_the_rest_is_untouched():
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((4, 2, 6, 3)).astype(np.float32)
    new = rng.standard_normal((3, 2, 4, 3)).astype(np.float32)
    pos, rows = np.array([0, 4, 1]), np.array([2, 0, 7])  # row 0 of the cache gets 2 of 4 positions; 7: dropped
    got = R.IMPL[Op.CACHE_WRITE](O.CacheWriteAttrs(2), cache, new, pos, rows)
    want = cache.copy()
    want[2, :, 0:4] = new[0]
    want[0, :, 4:6] = new[1, :, :2]
    assert np.array_equal(got, want)
    plain = R.IMPL[Op.CACHE_WRITE](O.CacheWriteAttrs(2), cache, new[:1].repeat(4, 0), np.array([0, 6, 6, 6]))
    assert np.array_equal(plain[0, :, :4], new[0]) and np.array_equal(plain[1:], cache[1:])


def _graph(new_rows: int, pos_rows: int, rows_shape: tuple[int, ...] | None):
    b = GraphBuilder("g")
    cache = b.state("k", (4, 2, 6, 3), DType.F32)
    new = b.input("new", (new_rows, 2, 4, 3), DType.F32)
    pos = b.input("pos", (pos_rows,), DType.I64)
    ins = [cache, new, pos] + ([b.input("rows", rows_shape, DType.I64)] if rows_shape else [])
    return b, b.emit(Op.CACHE_WRITE, *ins, axis=2)


def test_shapes_follow_the_rows():
    _, out = _graph(3, 3, (3,))
    assert out.shape == (4, 2, 6, 3)
    with pytest.raises(ValueError, match=r"positions must be integers of shape \[3\]"):
        _graph(3, 4, (3,))
    with pytest.raises(ValueError, match="does not fit"):
        _graph(3, 4, None)  # without rows, new has the cache's rows
    with pytest.raises(ValueError, match="rows must be integers of shape"):
        _graph(3, 3, (3, 1))
