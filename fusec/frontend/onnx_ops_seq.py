"""ONNX OneHot, CumProd and the window functions (Hann, Hamming, Blackman) on IR ops.

OneHot compares the indices with an iota along the new axis (its depth must be known at import:
it decides the shape). CumProd is unrolled along its axis (one product per position, at most
``MAX_CUMPROD``): the IR has no multiplicative scan. A window depends only on its size, so it is an
import-time constant.
"""

from __future__ import annotations

import numpy as np

from fusec.dtypes import DType
from fusec.frontend.emit import Const, Sym, np_dtype
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.frontend.onnx_load import np_dtype_of
from fusec.frontend.onnx_ops_data import reshape
from fusec.ops import Op

MAX_CUMPROD = 1024


@handler("OneHot")
def _one_hot(cx: NodeCtx) -> list[Sym | None]:
    idx, values = cx.x(0), cx.x(2)
    depth = cx.const(1)
    assert depth is not None
    if np.asarray(depth).size != 1 or tuple(values.shape) != (2,):
        raise cx.fail(f"depth must be one number and values [off, on], got {list(np.shape(depth))} and "
                      f"{list(values.shape)}")
    n = int(np.asarray(depth).reshape(-1)[0])
    if n < 1:
        raise cx.fail(f"depth must be positive, got {n}")
    rank = len(idx.shape) + 1
    axis = cx.axis(int(cx.attr("axis", -1)), rank)
    i64 = idx if np_dtype(idx) == np.int64 else cx.emit(Op.CAST, idx, to=DType.I64)
    i64 = cx.emit(Op.WHERE, cx.emit(Op.LESS, i64, Const(np.zeros((), np.int64))),
                  cx.emit(Op.ADD, i64, Const(np.asarray(n, np.int64))), i64)
    i64 = reshape(cx, i64, tuple(idx.shape[:axis]) + (1,) + tuple(idx.shape[axis:]), final=False)
    iota = Const(np.arange(n, dtype=np.int64).reshape(tuple(n if i == axis else 1 for i in range(rank))))
    hit = cx.emit(Op.EQUAL, iota, i64)
    off, on = (cx.emit(Op.SLICE, values, axes=(0,), starts=(k,), ends=(k + 1,), steps=(1,)) for k in (0, 1))
    return [cx.emit(Op.WHERE, hit, on, off, final=True)]


@handler("CumProd")
def _cum_prod(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    ax = cx.ints(1)
    if not ax or len(ax) != 1:
        raise cx.fail("axis must be a scalar")
    axis = cx.axis(ax[0], len(x.shape))
    n = x.shape[axis]
    if n > MAX_CUMPROD:
        raise cx.fail(f"CumProd over {n} elements is unrolled here, at most {MAX_CUMPROD}")
    if n == 0:
        return [x]
    parts = [cx.emit(Op.SLICE, x, axes=(axis,), starts=(i,), ends=(i + 1,), steps=(1,)) for i in range(n)]
    order = list(range(n))[::-1] if cx.attr("reverse", 0) else list(range(n))
    exclusive = bool(cx.attr("exclusive", 0))
    out: dict[int, Sym] = {}
    acc: Sym | None = None
    for i in order:
        if exclusive:
            out[i] = acc if acc is not None else Const(np.ones(parts[i].shape, np_dtype(x)))
            acc = parts[i] if acc is None else cx.emit(Op.MUL, acc, parts[i])
        else:
            acc = parts[i] if acc is None else cx.emit(Op.MUL, acc, parts[i])
            out[i] = acc
    if n == 1:
        return [out[0]]
    return [cx.emit(Op.CONCAT, *(out[i] for i in range(n)), final=True, axis=axis)]


def _window(cx: NodeCtx, n: np.ndarray, denom: int) -> np.ndarray:
    w = 2.0 * np.pi * n / denom
    if cx.node.op_type == "HannWindow":
        return np.sin(np.pi * n / denom) ** 2
    if cx.node.op_type == "HammingWindow":
        return 25.0 / 46.0 - (1.0 - 25.0 / 46.0) * np.cos(w)
    return 0.42 - 0.5 * np.cos(w) + 0.08 * np.cos(2.0 * w)


@handler("HannWindow", "HammingWindow", "BlackmanWindow")
def _windows(cx: NodeCtx) -> list[Sym | None]:
    size = cx.ints(0)
    if not size or len(size) != 1 or size[0] < 0:
        raise cx.fail(f"size must be one non-negative integer, got {size}")
    n = size[0]
    cx.em.check_size((n,), f"node {cx.node.name!r} ({cx.node.op_type})", 8)
    periodic = bool(cx.attr("periodic", 1))
    denom = n if periodic else n - 1
    dt = np_dtype_of(int(cx.attr("output_datatype", 1)))
    with np.errstate(all="ignore"):
        w = _window(cx, np.arange(n, dtype=np.float64), denom) if denom > 0 else np.ones(n)
    return [Const(w.astype(dt))]
