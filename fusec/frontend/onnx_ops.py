"""ONNX op handlers, part 1: elementwise math, comparisons, casts, reductions, norms and matmuls.

Data movement and shape ops live in ``onnx_ops_data.py``; Einsum in ``onnx_einsum.py``. Every
handler maps ONNX semantics (attribute defaults, opset differences) onto the closed IR vocabulary.
"""

from __future__ import annotations

import numpy as np

from fusec.dtypes import DType
from fusec.frontend.emit import Const, Sym, np_dtype
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.frontend.onnx_ops_act import c
from fusec.frontend.onnx_load import np_dtype_of
from fusec.ops import Op

_UNARY = {
    "Neg": Op.NEG, "Abs": Op.ABS, "Exp": Op.EXP, "Log": Op.LOG, "Sqrt": Op.SQRT, "Reciprocal": Op.RECIPROCAL,
    "Erf": Op.ERF, "Tanh": Op.TANH, "Sigmoid": Op.SIGMOID, "Relu": Op.RELU, "Cos": Op.COS, "Sin": Op.SIN,
    "Not": Op.NOT, "IsNaN": Op.ISNAN,
}
_BINARY = {
    "Add": Op.ADD, "Sub": Op.SUB, "Mul": Op.MUL, "Div": Op.DIV, "Pow": Op.POW, "Equal": Op.EQUAL,
    "Less": Op.LESS, "LessOrEqual": Op.LESS_EQUAL, "Greater": Op.GREATER, "GreaterOrEqual": Op.GREATER_EQUAL,
    "And": Op.AND, "Or": Op.OR,
}


@handler(*_UNARY)
def _unary(cx: NodeCtx) -> list[Sym | None]:
    return [cx.emit(_UNARY[cx.node.op_type], cx.x(0), final=True)]


@handler(*_BINARY)
def _binary(cx: NodeCtx) -> list[Sym | None]:
    return [cx.emit(_BINARY[cx.node.op_type], cx.x(0), cx.x(1), final=True)]


@handler("IsInf")
def _isinf(cx: NodeCtx) -> list[Sym | None]:
    return [cx.emit(Op.ISINF, cx.x(0), final=True, detect_positive=bool(cx.attr("detect_positive", 1)),
                    detect_negative=bool(cx.attr("detect_negative", 1)))]


@handler("Gelu")
def _gelu(cx: NodeCtx) -> list[Sym | None]:
    return [cx.emit(Op.GELU, cx.x(0), final=True, approximate=cx.attr("approximate", "none"))]


@handler("Where")
def _where(cx: NodeCtx) -> list[Sym | None]:
    return [cx.emit(Op.WHERE, cx.x(0), cx.x(1), cx.x(2), final=True)]


def _chain(cx: NodeCtx, op: Op, xs: list[Sym]) -> Sym:
    """Variadic Max/Min/Sum as a left fold of binary ops (numpy broadcasting is associative)."""
    acc = xs[0]
    for i, x in enumerate(xs[1:]):
        acc = cx.emit(op, acc, x, final=(i == len(xs) - 2))
    return acc


@handler("Max", "Min", "Sum")
def _variadic(cx: NodeCtx) -> list[Sym | None]:
    op = {"Max": Op.MAX, "Min": Op.MIN, "Sum": Op.ADD}[cx.node.op_type]
    xs = [cx.x(i) for i in range(len(cx.ins))]
    return [_chain(cx, op, xs)]


@handler("Clip")
def _clip(cx: NodeCtx) -> list[Sym | None]:
    y = cx.x(0)
    if cx.has(1):
        y = cx.emit(Op.MAX, y, cx.x(1), final=not cx.has(2))
    if cx.has(2):
        y = cx.emit(Op.MIN, y, cx.x(2), final=True)
    return [y]


def _cast_to(cx: NodeCtx, x: Sym, target: np.dtype) -> Sym:
    if np_dtype(x) == target:
        return x
    if isinstance(x, Const) and not x.weight:
        # shape arithmetic may pass through float64/int32/...: fold in numpy with any dtype
        return Const(np.asarray(x.array).astype(target))
    try:
        dt = DType.from_np(target)
    except ValueError:
        raise cx.fail(f"cast of {cx.node.input[0]!r} to {target}, which fusec does not support "
                      "on a run-time tensor") from None
    return cx.emit(Op.CAST, x, final=True, to=dt)


@handler("Cast")
def _cast(cx: NodeCtx) -> list[Sym | None]:
    return [_cast_to(cx, cx.x(0), np_dtype_of(int(cx.attr("to"))))]


@handler("CastLike")
def _cast_like(cx: NodeCtx) -> list[Sym | None]:
    return [_cast_to(cx, cx.x(0), np_dtype(cx.x(1)))]


@handler("Identity")
def _identity(cx: NodeCtx) -> list[Sym | None]:
    return [cx.x(0)]


@handler("Dropout")
def _dropout(cx: NodeCtx) -> list[Sym | None]:
    training = cx.const(2)
    if training is not None and bool(np.asarray(training).reshape(-1)[0]):
        raise cx.fail("Dropout in training mode is not supported (export the model in eval mode)")
    x = cx.x(0)
    mask = Const(np.ones(x.shape, np.bool_)) if cx.used(1) else None
    return [x, mask]


@handler("Softmax")
def _softmax(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    return [cx.emit(Op.SOFTMAX, x, final=True, axis=cx.axis(int(cx.attr("axis", -1)), len(x.shape)))]


@handler("LayerNormalization")
def _layernorm(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    axis = cx.axis(int(cx.attr("axis", -1)), len(x.shape))
    ins = [x, cx.x(1)] + ([cx.x(2)] if cx.has(2) else [])
    norm_shape = tuple(x.shape[axis:])
    for p in ins[1:]:
        try:
            fits_x = tuple(np.broadcast_shapes(tuple(p.shape), tuple(x.shape))) == tuple(x.shape)
        except ValueError:
            fits_x = False
        if not fits_x:
            raise cx.fail(f"scale/bias of shape {list(p.shape)} does not broadcast to the input's {list(x.shape)}")
    fits = all(tuple(np.broadcast_shapes(tuple(p.shape), norm_shape)) == norm_shape for p in ins[1:])
    if cx.used(1) or cx.used(2) or not fits:
        # Mean / InvStdDev used, or a scale/bias that also spans the outer axes: decomposed
        from fusec.frontend.onnx_ops_norm import layernorm_with_stats

        return layernorm_with_stats(cx)
    return [cx.emit(Op.LAYERNORM, *ins, final=True, axis=axis, eps=float(cx.attr("epsilon", 1e-5))), None, None]


_REDUCE = {"ReduceSum": Op.REDUCE_SUM, "ReduceMean": Op.REDUCE_MEAN, "ReduceMax": Op.REDUCE_MAX,
           "ReduceMin": Op.REDUCE_MIN, "ReduceProd": Op.REDUCE_PROD}


@handler(*_REDUCE)
def _reduce(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    rank = len(x.shape)
    # ReduceSum takes axes as an input from opset 13, the others from opset 18
    axes_as_input = cx.node.op_type == "ReduceSum" or cx.opset >= 18
    axes = cx.ints(1) if axes_as_input else cx.attr("axes")
    keep = bool(cx.attr("keepdims", 1))
    if not axes:
        if cx.attr("noop_with_empty_axes", 0):
            return [x]
        axes = list(range(rank))
    norm = tuple(sorted({cx.axis(int(a), rank, "reduce axis") for a in axes}))
    return [cx.emit(_REDUCE[cx.node.op_type], x, final=True, axes=norm, keepdims=keep)]


@handler("MatMul")
def _matmul(cx: NodeCtx) -> list[Sym | None]:
    from fusec.frontend.onnx_qweights import qdq_matmul

    packed = qdq_matmul(cx, cx.x(0), cx.x(1))  # B dequantized from a constant weight: keep it packed
    return [packed if packed is not None else cx.emit(Op.MATMUL, cx.x(0), cx.x(1), final=True)]


@handler("Gemm")
def _gemm(cx: NodeCtx) -> list[Sym | None]:
    """Y = alpha * A' @ B' + beta * C: MATMUL, with TRANSPOSE / MUL / ADD only where needed."""
    a, b = cx.x(0), cx.x(1)
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise cx.fail(f"Gemm needs 2-D A and B, got {list(a.shape)} and {list(b.shape)}")
    if cx.attr("transA", 0):
        a = cx.emit(Op.TRANSPOSE, a, perm=(1, 0))
    if cx.attr("transB", 0):
        b = cx.emit(Op.TRANSPOSE, b, perm=(1, 0))
    alpha, beta = float(cx.attr("alpha", 1.0)), float(cx.attr("beta", 1.0))
    has_c = cx.has(2) and beta != 0.0
    y = cx.emit(Op.MATMUL, a, b, final=(alpha == 1.0 and not has_c))
    if alpha != 1.0:
        y = cx.emit(Op.MUL, y, c(y, alpha), final=not has_c)
    if has_c:
        cin = cx.x(2)
        if beta != 1.0:
            cin = cx.emit(Op.MUL, cin, c(cin, beta))
        y = cx.emit(Op.ADD, y, cin, final=True)
    return [y]


@handler("Swish")
def _swish(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    alpha = float(cx.attr("alpha", 1.0))
    if alpha == 1.0:
        return [cx.emit(Op.SILU, x, final=True)]
    s = cx.emit(Op.SIGMOID, cx.emit(Op.MUL, x, c(x, alpha)))
    return [cx.emit(Op.MUL, x, s, final=True)]
