"""ONNX op handlers: pooling as reductions over the windows ``onnx_ops_conv.window_taps`` gathers
([N, C, K, P]: K taps of P output positions; padded taps read a fill value):

- ``MaxPool``: REDUCE_MAX (fill -inf; ints allowed); its ``Indices`` output through ARGMAX over the
  taps and the constant tap -> input index table (row- or column-major per ``storage_order``);
- ``AveragePool``: REDUCE_SUM times a constant 1 / count per output position (``count_include_pad``
  and ``ceil_mode`` decide which taps count);
- ``LpPool``: (sum |x|^p)^(1/p); ``MaxUnpool``: a scatter into zeros;
  ``GlobalAveragePool``/``GlobalMaxPool``: a reduction over the spatial axes.
"""

from __future__ import annotations

import math

import numpy as np

from fusec.dtypes import DType
from fusec.frontend.emit import Const, Sym, np_dtype
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.frontend.onnx_ops_conv import Window, check_input, kernel_shape_of, reshape_to, window_taps
from fusec.ops import Op


def _pool_window(cx: NodeCtx, x: Sym, ints: bool = False) -> Window:
    check_input(cx, x, ints)
    r = len(x.shape) - 2
    return Window(cx, tuple(x.shape[2:]), kernel_shape_of(cx, None, r), ceil_mode=bool(cx.attr("ceil_mode", 0)))


@handler("MaxPool")
def _maxpool(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    order = int(cx.attr("storage_order", 0))
    if order not in (0, 1):
        raise cx.fail(f"attribute storage_order={order} is not 0 or 1")
    win = _pool_window(cx, x, ints=True)
    n, c = x.shape[:2]
    lowest = -np.inf if np_dtype(x).kind == "f" else np.iinfo(np_dtype(x)).min
    taps = window_taps(cx, x, win.coords(), lowest)
    y = cx.emit(Op.REDUCE_MAX, taps, axes=(2,), keepdims=False)
    out = reshape_to(cx, y, (n, c) + win.out, final=True)
    if not cx.used(1):
        return [out, None]
    # Indices: the flat input index (over N, C and the spatial axes, the latter column-major with
    # storage_order=1) of the window's first maximum; a padded tap (-inf) is never the first one
    table = win.table()  # [K, P]
    kk, p = table.shape
    size = math.prod(win.spatial)
    if order:
        inside = table < size
        table[inside] = np.ravel_multi_index(np.unravel_index(table[inside], win.spatial), win.spatial, order="F")
    k = cx.emit(Op.ARGMAX, taps, axis=2, keepdims=False)  # [N, C, P]: the tap of each maximum
    flat = cx.emit(Op.ADD, cx.emit(Op.MUL, k, Const(np.asarray(p, np.int64))), Const(np.arange(p, dtype=np.int64)))
    spatial = cx.emit(Op.GATHER, Const(table.reshape(-1)), flat, axis=0)
    base = Const((np.arange(n * c, dtype=np.int64) * size).reshape(n, c, 1))
    return [out, reshape_to(cx, cx.emit(Op.ADD, spatial, base), (n, c) + win.out)]


@handler("AveragePool")
def _avgpool(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    win = _pool_window(cx, x)
    n, c = x.shape[:2]
    taps = window_taps(cx, x, win.coords(), 0.0)
    s = cx.emit(Op.REDUCE_SUM, taps, axes=(2,), keepdims=False)  # [N, C, P]
    table = win.table()
    size = math.prod(win.spatial)
    if cx.attr("count_include_pad", 0):
        # explicit pads count; what ceil_mode adds past the padded input does not
        limit = tuple(nn + b + e for nn, b, e in zip(win.spatial, win.begin, win.end))
        count = _count_in(win, limit)
    else:
        count = (table != size).sum(axis=0)
    inv = Const((1.0 / np.maximum(count, 1)).astype(np_dtype(x)))
    y = cx.emit(Op.MUL, s, inv)
    return [reshape_to(cx, y, (n, c) + win.out, final=True)]


def _count_in(win: Window, limit: tuple[int, ...]) -> np.ndarray:
    """[P] how many taps of each window fall in [0, limit) of the padded input, per output position."""
    per_axis = []
    for ax in range(len(win.spatial)):
        start = np.arange(win.out[ax]) * win.strides[ax]
        taps = start[:, None] + np.arange(win.kernel[ax])[None, :] * win.dilations[ax]
        per_axis.append(((taps >= 0) & (taps < limit[ax])).sum(axis=1))
    grid = per_axis[0]
    for a in per_axis[1:]:
        grid = np.multiply.outer(grid, a)
    return np.asarray(grid).reshape(-1)


@handler("LpPool")
def _lppool(cx: NodeCtx) -> list[Sym | None]:
    """(sum over the window of |x|^p)^(1/p); padded taps add 0."""
    x = cx.x(0)
    win = _pool_window(cx, x)
    n, c = x.shape[:2]
    p = float(cx.attr("p", 2))
    if p <= 0:
        raise cx.fail(f"attribute p={p} must be positive")
    dt = np_dtype(x)
    taps = cx.emit(Op.POW, cx.emit(Op.ABS, window_taps(cx, x, win.coords(), 0.0)), Const(np.asarray(p, dt)))
    s = cx.emit(Op.REDUCE_SUM, taps, axes=(2,), keepdims=False)
    y = cx.emit(Op.POW, s, Const(np.asarray(1.0 / p, dt)))
    return [reshape_to(cx, y, (n, c) + win.out, final=True)]


@handler("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    check_input(cx, x)
    op = Op.REDUCE_MEAN if cx.node.op_type == "GlobalAveragePool" else Op.REDUCE_MAX
    return [cx.emit(op, x, final=True, axes=tuple(range(2, len(x.shape))), keepdims=True)]


@handler("MaxUnpool")
def _max_unpool(cx: NodeCtx) -> list[Sym | None]:
    """Zeros with each X written at its flat index I (over the whole output, as MaxPool's Indices
    count): one SCATTER_ND into a zero tensor of the output's size."""
    x, idx = cx.x(0), cx.x(1)
    check_input(cx, x)
    r = len(x.shape) - 2
    if tuple(idx.shape) != tuple(x.shape) or np_dtype(idx).kind not in "iu":
        raise cx.fail(f"indices I {list(idx.shape)} must be integers shaped like X {list(x.shape)}")
    kernel = kernel_shape_of(cx, None, r)
    strides = [int(s) for s in (cx.attr("strides") or [1] * r)]
    pads = [int(p) for p in (cx.attr("pads") or [0] * (2 * r))]
    if len(strides) != r or len(pads) != 2 * r or min(strides) < 1 or min(pads) < 0:
        raise cx.fail(f"attributes strides={strides} / pads={pads} do not fit {r} spatial axes")
    shape = cx.ints(2)
    if shape is None:
        shape = list(x.shape[:2]) + [(n - 1) * s + k - b - e for n, s, k, b, e in
                                     zip(x.shape[2:], strides, kernel, pads[:r], pads[r:])]
    if len(shape) != r + 2 or tuple(shape[:2]) != tuple(x.shape[:2]) or min(shape) < 1:
        raise cx.fail(f"output shape {shape} does not fit X {list(x.shape)}")
    cx.em.check_size(shape, f"node {cx.node.name!r}: the unpooled output", np_dtype(x).itemsize)
    size = math.prod(shape)
    flat = cx.emit(Op.SCATTER_ND, Const(np.zeros(size, np_dtype(x))),
                   reshape_to(cx, cx.emit(Op.CAST, idx, to=DType.I64) if np_dtype(idx) != np.int64 else idx,
                              (math.prod(idx.shape), 1)),
                   reshape_to(cx, x, (math.prod(x.shape),)))
    return [reshape_to(cx, flat, tuple(shape), final=True)]
