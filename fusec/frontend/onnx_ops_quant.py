"""ONNX QuantizeLinear / DequantizeLinear for 8- and 16-bit integers, decomposed into IR ops.

Dequantize: (float(x) - float(zero_point)) * scale, in fp32, cast to scale's dtype (or
``output_dtype``). Quantize: clip(round_half_even(x / scale) + zero_point) to the output
integer's range, cast to it (the zero point's dtype, else ``output_dtype``, else uint8). Scales and
zero points are scalars, per-axis [C] vectors, or blocked (``block_size`` along ``axis``: each
value repeated over its block). Constant int4/uint4 tensors (weights) are widened to 8 bits
(exact); a DequantizeLinear of a constant weight read by a MatMul stays packed
(``fusec.frontend.onnx_qweights``). Float8 / 2-bit types are refused: fusec has no such dtype.
"""

from __future__ import annotations

import numpy as np

from fusec.frontend.emit import Const, Sym, np_dtype
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.frontend.onnx_load import np_dtype_of
from fusec.frontend.onnx_ops_act import c
from fusec.frontend.onnx_ops_data import reshape
from fusec.frontend.onnx_ops_norm import cast
from fusec.ops import Op

_INT_RANGES = {np.dtype(t): (np.iinfo(t).min, np.iinfo(t).max) for t in (np.uint8, np.int8, np.uint16, np.int16)}
_FOUR_BIT = {"int4": np.int8, "uint4": np.uint8}  # ml_dtypes' names (onnx's numpy_helper returns them)


def _spread(cx: NodeCtx, p: Sym, x: Sym, axis: int, block: int, what: str) -> Sym:
    """A scale / zero point shaped to broadcast against x (scalar, per-axis or blocked)."""
    rank = len(x.shape)
    if p.shape in ((), (1,)):
        return p
    axis = cx.axis(axis, rank)  # only a per-axis or blocked parameter needs a valid axis
    if block <= 0:
        if tuple(p.shape) != (x.shape[axis],):
            raise cx.fail(f"{what} of shape {list(p.shape)} must be a scalar or [{x.shape[axis]}] (axis {axis})")
        return reshape(cx, p, tuple(x.shape[axis] if i == axis else 1 for i in range(rank)), final=False)
    nb = -(-x.shape[axis] // block)
    want = tuple(nb if i == axis else d for i, d in enumerate(x.shape))
    if tuple(p.shape) != want:
        raise cx.fail(f"{what} of shape {list(p.shape)} does not fit blocks of {block} along axis {axis} "
                      f"of {list(x.shape)} (expected {list(want)})")
    inner = want[:axis + 1] + (1,) + want[axis + 1:]
    rep = cx.emit(Op.EXPAND, reshape(cx, p, inner, final=False), shape=want[:axis + 1] + (block,) + want[axis + 1:])
    rep = reshape(cx, rep, want[:axis] + (nb * block,) + want[axis + 1:], final=False)
    if nb * block != x.shape[axis]:
        rep = cx.emit(Op.SLICE, rep, axes=(axis,), starts=(0,), ends=(x.shape[axis],), steps=(1,))
    return rep


def _axis_block(cx: NodeCtx, x: Sym) -> tuple[int, int]:
    return int(cx.attr("axis", 1)), int(cx.attr("block_size", 0) or 0)


def _widen4(s: Sym) -> Sym:
    """A constant int4/uint4 tensor as int8/uint8 (exact; fusec has no 4-bit dtype)."""
    if isinstance(s, Const) and s.array.dtype.name in _FOUR_BIT:
        return Const(s.array.astype(_FOUR_BIT[s.array.dtype.name]), weight=s.weight, name=s.name)
    return s


@handler("DequantizeLinear")
def _dequantize(cx: NodeCtx) -> list[Sym | None]:
    from fusec.frontend.onnx_qweights import note_dequantized

    x, scale = cx.x(0), cx.x(1)
    bits = 4 if np_dtype(x).name in _FOUR_BIT else 8
    x = _widen4(x)
    if np_dtype(x) not in _INT_RANGES and np_dtype(x) != np.int32:
        raise cx.fail(f"x of dtype {np_dtype(x)} is not supported (4/8/16-bit integers and int32 are; "
                      "4-bit only as a constant)")
    axis, block = _axis_block(cx, x)
    xf = cast(cx, x, np.dtype(np.float32))
    zp = _widen4(cx.x(2)) if cx.has(2) else None
    if zp is not None:
        if np_dtype(zp) != np_dtype(x):
            raise cx.fail(f"zero point dtype {np_dtype(zp)} differs from x's {np_dtype(x)}")
        xf = cx.emit(Op.SUB, xf, _spread(cx, cast(cx, zp, np.dtype(np.float32)), x, axis, block, "x_zero_point"))
    y = cx.emit(Op.MUL, xf, _spread(cx, cast(cx, scale, np.dtype(np.float32)), x, axis, block, "x_scale"))
    out = np_dtype_of(int(cx.attr("output_dtype"))) if cx.attr("output_dtype") else np_dtype(scale)
    y = cast(cx, y, np.dtype(out))
    note_dequantized(cx, y, x, scale, zp, int(cx.attr("axis", 1)), block, bits)  # a MatMul may keep x packed
    return [y]


@handler("QuantizeLinear")
def _quantize(cx: NodeCtx) -> list[Sym | None]:
    x, scale = cx.x(0), cx.x(1)
    axis, block = _axis_block(cx, x)
    zp = cx.x(2) if cx.has(2) else None
    out = np_dtype(zp) if zp is not None else (
        np.dtype(np_dtype_of(int(cx.attr("output_dtype")))) if cx.attr("output_dtype") else np.dtype(np.uint8))
    if out not in _INT_RANGES:
        raise cx.fail(f"quantizing to {out} is not supported (uint8, int8, uint16 and int16 are)")
    precision = cx.attr("precision")
    work = np.dtype(np_dtype_of(int(precision))) if precision else np_dtype(x)
    q = cx.emit(Op.DIV, cast(cx, x, work), _spread(cx, cast(cx, scale, work), x, axis, block, "y_scale"))
    q = cast(cx, cx.emit(Op.ROUND, q), np.dtype(np.float32))
    if zp is not None:
        q = cx.emit(Op.ADD, q, _spread(cx, cast(cx, zp, np.dtype(np.float32)), x, axis, block, "y_zero_point"))
    lo, hi = _INT_RANGES[out]
    q = cx.emit(Op.MIN, cx.emit(Op.MAX, q, c(q, float(lo))), c(q, float(hi)))
    return [cast(cx, q, out)]

