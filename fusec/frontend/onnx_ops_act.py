"""ONNX activations and elementwise math without an IR op of their own, decomposed into IR ops.

Each handler writes the ONNX formula with IR elementwise ops (the fusion pass joins them into one
kernel). Constants take the input's dtype. Softplus and LogSoftmax use their overflow-safe forms
(``max(x, 0) + log(1 + exp(-|x|))``; ``x - max - log(sum(exp(x - max)))``), equal to ONNX's
formulas wherever those are finite.
"""

from __future__ import annotations

import math

import numpy as np

from fusec.frontend.emit import Const, Sym, np_dtype
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.ops import Op


class InexactConstant(ValueError):
    """An attribute value the input's integer dtype cannot hold (the importer names the node)."""


def c(x: Sym, v: float) -> Const:
    """A scalar constant of ``x``'s dtype; for an integer dtype, only a value it holds exactly
    (a fractional bias on an int32 input would silently become another number)."""
    dt = np_dtype(x)
    arr = np.asarray(v).astype(dt)
    if dt.kind in "iub" and float(arr) != float(v):
        raise InexactConstant(f"value {v:g} cannot be held exactly by the input's dtype {dt.name}")
    return Const(arr)


def _far(x: Sym) -> float:
    """Where the inverse hyperbolic functions switch to log(|x|) + ln 2: x^2 must not overflow before
    it (fp16: past 255), and the dropped 1/(4x^2) term must be below the dtype's precision."""
    return 64.0 if np_dtype(x) == np.float16 else 1e4


def is_float(dt: np.dtype) -> bool:
    """fp16/32/64 or bf16 (ml_dtypes' bfloat16 is not of numpy kind 'f')."""
    return dt.kind == "f" or dt.name == "bfloat16"


def _float_input(cx: NodeCtx, i: int = 0) -> Sym:
    x = cx.x(i)
    if not is_float(np_dtype(x)):
        raise cx.fail(f"input {i} has dtype {np_dtype(x)}; this op takes floating-point tensors")
    return x


def softplus(cx: NodeCtx, x: Sym, final: bool = False) -> Sym:
    """log(1 + exp(x)) as max(x, 0) + log(1 + exp(-|x|)): no overflow for large x."""
    tail = cx.emit(Op.LOG, cx.emit(Op.ADD, c(x, 1.0), cx.emit(Op.EXP, cx.emit(Op.NEG, cx.emit(Op.ABS, x)))))
    return cx.emit(Op.ADD, cx.emit(Op.RELU, x), tail, final=final)


def hard_sigmoid(cx: NodeCtx, x: Sym, alpha: float, beta: float, final: bool = False) -> Sym:
    """max(0, min(1, alpha * x + beta))."""
    lin = cx.emit(Op.ADD, cx.emit(Op.MUL, x, c(x, alpha)), c(x, beta))
    return cx.emit(Op.MAX, cx.emit(Op.MIN, lin, c(x, 1.0)), c(x, 0.0), final=final)


def log_softmax(cx: NodeCtx, x: Sym, axis: int, final: bool = False) -> Sym:
    """x - max - log(sum(exp(x - max))) along ``axis``."""
    shifted = cx.emit(Op.SUB, x, cx.emit(Op.REDUCE_MAX, x, axes=(axis,), keepdims=True))
    total = cx.emit(Op.REDUCE_SUM, cx.emit(Op.EXP, shifted), axes=(axis,), keepdims=True)
    return cx.emit(Op.SUB, shifted, cx.emit(Op.LOG, total), final=final)


@handler("LogSoftmax")
def _log_softmax(cx: NodeCtx) -> list[Sym | None]:
    x = _float_input(cx)
    return [log_softmax(cx, x, cx.axis(int(cx.attr("axis", -1)), len(x.shape)), final=True)]


@handler("Softplus")
def _softplus(cx: NodeCtx) -> list[Sym | None]:
    return [softplus(cx, _float_input(cx), final=True)]


@handler("Softsign")
def _softsign(cx: NodeCtx) -> list[Sym | None]:
    x = _float_input(cx)
    return [cx.emit(Op.DIV, x, cx.emit(Op.ADD, c(x, 1.0), cx.emit(Op.ABS, x)), final=True)]


@handler("Mish")
def _mish(cx: NodeCtx) -> list[Sym | None]:
    x = _float_input(cx)
    return [cx.emit(Op.MUL, x, cx.emit(Op.TANH, softplus(cx, x)), final=True)]


def _negative_part(cx: NodeCtx, x: Sym, neg: Sym, final: bool = True) -> Sym:
    """x where x > 0 (x >= 0 is the same value), ``neg`` elsewhere."""
    return cx.emit(Op.WHERE, cx.emit(Op.GREATER, x, c(x, 0.0)), x, neg, final=final)


@handler("Elu")
def _elu(cx: NodeCtx) -> list[Sym | None]:
    x = _float_input(cx)
    alpha = float(cx.attr("alpha", 1.0))
    em1 = cx.emit(Op.SUB, cx.emit(Op.EXP, x), c(x, 1.0))
    return [_negative_part(cx, x, cx.emit(Op.MUL, em1, c(x, alpha)))]


@handler("Selu")
def _selu(cx: NodeCtx) -> list[Sym | None]:
    x = _float_input(cx)
    alpha = float(cx.attr("alpha", 1.6732632423543772848170429916717))
    gamma = float(cx.attr("gamma", 1.0507009873554804934193349852946))
    neg = cx.emit(Op.SUB, cx.emit(Op.MUL, cx.emit(Op.EXP, x), c(x, alpha)), c(x, alpha))
    y = _negative_part(cx, x, neg, final=False)
    return [cx.emit(Op.MUL, y, c(x, gamma), final=True)]


@handler("Celu")
def _celu(cx: NodeCtx) -> list[Sym | None]:
    x = _float_input(cx)
    alpha = float(cx.attr("alpha", 1.0))
    if alpha == 0:
        raise cx.fail("alpha must not be 0")
    em1 = cx.emit(Op.SUB, cx.emit(Op.EXP, cx.emit(Op.DIV, x, c(x, alpha))), c(x, 1.0))
    neg = cx.emit(Op.MIN, cx.emit(Op.MUL, em1, c(x, alpha)), c(x, 0.0))
    return [cx.emit(Op.ADD, cx.emit(Op.RELU, x), neg, final=True)]


@handler("LeakyRelu")
def _leaky_relu(cx: NodeCtx) -> list[Sym | None]:
    x = _float_input(cx)
    return [_negative_part(cx, x, cx.emit(Op.MUL, x, c(x, float(cx.attr("alpha", 0.01)))))]


@handler("PRelu")
def _prelu(cx: NodeCtx) -> list[Sym | None]:
    x, slope = cx.x(0), cx.x(1)
    if np_dtype(slope) != np_dtype(x):
        raise cx.fail(f"slope dtype {np_dtype(slope)} differs from X's {np_dtype(x)}")
    try:
        shape = tuple(int(d) for d in np.broadcast_shapes(tuple(x.shape), tuple(slope.shape)))
    except ValueError:
        shape = ()
    if shape != tuple(x.shape):
        raise cx.fail(f"slope of shape {list(slope.shape)} does not broadcast to X's {list(x.shape)}")
    return [cx.emit(Op.WHERE, cx.emit(Op.LESS, x, c(x, 0.0)), cx.emit(Op.MUL, x, slope), x, final=True)]


@handler("ThresholdedRelu")
def _thresholded_relu(cx: NodeCtx) -> list[Sym | None]:
    x = _float_input(cx)
    keep = cx.emit(Op.GREATER, x, c(x, float(cx.attr("alpha", 1.0))))
    return [cx.emit(Op.WHERE, keep, x, c(x, 0.0), final=True)]


@handler("HardSigmoid")
def _hard_sigmoid(cx: NodeCtx) -> list[Sym | None]:
    x = _float_input(cx)
    return [hard_sigmoid(cx, x, float(cx.attr("alpha", 0.2)), float(cx.attr("beta", 0.5)), final=True)]


@handler("HardSwish")
def _hard_swish(cx: NodeCtx) -> list[Sym | None]:
    x = _float_input(cx)
    return [cx.emit(Op.MUL, x, hard_sigmoid(cx, x, 1.0 / 6.0, 0.5), final=True)]


@handler("Shrink")
def _shrink(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    lambd, bias = float(cx.attr("lambd", 0.5)), float(cx.attr("bias", 0.0))
    lo, hi = -lambd, lambd
    if not is_float(np_dtype(x)):  # integer x: x < -1.5 is x < -1, x > 1.5 is x > 1
        lo, hi = math.ceil(lo), math.floor(hi)
    low = cx.emit(Op.WHERE, cx.emit(Op.LESS, x, c(x, lo)), cx.emit(Op.ADD, x, c(x, bias)), c(x, 0.0))
    high = cx.emit(Op.GREATER, x, c(x, hi))
    return [cx.emit(Op.WHERE, high, cx.emit(Op.SUB, x, c(x, bias)), low, final=True)]


@handler("SwiGLU")
def _swiglu(cx: NodeCtx) -> list[Sym | None]:
    a, b = _float_input(cx, 0), cx.x(1)
    if tuple(a.shape) != tuple(b.shape) or np_dtype(a) != np_dtype(b):
        raise cx.fail(f"A and B must have one shape and dtype, got {list(a.shape)} and {list(b.shape)}")
    alpha = float(cx.attr("alpha", 1.0))
    if alpha == 1.0:
        gate = cx.emit(Op.SILU, a)
    else:
        gate = cx.emit(Op.MUL, a, cx.emit(Op.SIGMOID, cx.emit(Op.MUL, a, c(a, alpha))))
    return [cx.emit(Op.MUL, gate, b, final=True)]


@handler("Mean")
def _mean(cx: NodeCtx) -> list[Sym | None]:
    xs = [cx.x(i) for i in range(len(cx.ins))]
    acc = xs[0]
    for x in xs[1:]:
        acc = cx.emit(Op.ADD, acc, x)
    if len(xs) == 1:
        return [acc]
    return [cx.emit(Op.DIV, acc, c(acc, float(len(xs))), final=True)]


# ---- hyperbolic and tangent functions from exp / log / sqrt / sin / cos ---------------------


@handler("Sinh", "Cosh")
def _sinh_cosh(cx: NodeCtx) -> list[Sym | None]:
    """With h = exp(|x| - ln 2) = e^|x| / 2 (finite up to |x| ~ 89.4, where e^|x| alone overflows):
    cosh = h + 1/(4h), sinh = sign(x) (h - 1/(4h)); sinh below |x| = 0.5 by its series to x^7
    (the difference cancels there)."""
    x = _float_input(cx)
    h = cx.emit(Op.EXP, cx.emit(Op.SUB, cx.emit(Op.ABS, x), c(x, float(np.log(2.0)))))
    quarter = cx.emit(Op.DIV, c(x, 0.25), h)
    if cx.node.op_type == "Cosh":
        return [cx.emit(Op.ADD, h, quarter, final=True)]
    big = cx.emit(Op.MUL, cx.emit(Op.SIGN, x), cx.emit(Op.SUB, h, quarter))
    x2 = cx.emit(Op.MUL, x, x)
    poly: Sym = c(x, 1.0 / 5040)
    for k in (1.0 / 120, 1.0 / 6, 1.0):
        poly = cx.emit(Op.ADD, cx.emit(Op.MUL, poly, x2), c(x, k))
    small = cx.emit(Op.MUL, x, poly)
    return [cx.emit(Op.WHERE, cx.emit(Op.LESS, cx.emit(Op.ABS, x), c(x, 0.5)), small, big, final=True)]


def _log1p(cx: NodeCtx, y: Sym) -> Sym:
    """log(1 + y) without losing a small y: log(u) * y / (u - 1) with u = 1 + y rounded (y itself
    where u - 1 is 0); log(u) alone from u = 2^24 on (1 + y is y there, and y / (u - 1) could be
    inf / inf)."""
    u = cx.emit(Op.ADD, c(y, 1.0), y)
    d = cx.emit(Op.SUB, u, c(y, 1.0))
    lg = cx.emit(Op.LOG, u)
    near = cx.emit(Op.WHERE, cx.emit(Op.EQUAL, d, c(y, 0.0)), y, cx.emit(Op.MUL, lg, cx.emit(Op.DIV, y, d)))
    return cx.emit(Op.WHERE, cx.emit(Op.LESS, u, c(y, float(2**24))), near, lg)


@handler("Tan")
def _tan(cx: NodeCtx) -> list[Sym | None]:
    x = _float_input(cx)
    return [cx.emit(Op.DIV, cx.emit(Op.SIN, x), cx.emit(Op.COS, x), final=True)]


@handler("Acosh")
def _acosh(cx: NodeCtx) -> list[Sym | None]:
    """log1p(t + sqrt(t (t + 2))) with t = x - 1 (no cancellation near 1); log(x) + ln 2 from x = 1e4
    on (fp16: 64), where t (t + 2) could overflow and the 1/x^2 terms are below the precision."""
    x = _float_input(cx)
    t = cx.emit(Op.SUB, x, c(x, 1.0))
    near = _log1p(cx, cx.emit(Op.ADD, t, cx.emit(Op.SQRT, cx.emit(Op.MUL, t, cx.emit(Op.ADD, t, c(x, 2.0))))))
    far = cx.emit(Op.ADD, cx.emit(Op.LOG, x), c(x, float(np.log(2.0))))
    return [cx.emit(Op.WHERE, cx.emit(Op.LESS, x, c(x, _far(x))), near, far, final=True)]


@handler("Asinh")
def _asinh(cx: NodeCtx) -> list[Sym | None]:
    """sign(x) * log1p(a + a^2 / (1 + sqrt(1 + a^2))) with a = |x| (odd; no cancellation for small
    a); sign(x) * (log(a) + ln 2) from a = 1e4 on (fp16: 64), where a^2 could overflow."""
    x = _float_input(cx)
    a = cx.emit(Op.ABS, x)
    a2 = cx.emit(Op.MUL, a, a)
    root = cx.emit(Op.ADD, c(x, 1.0), cx.emit(Op.SQRT, cx.emit(Op.ADD, a2, c(x, 1.0))))
    near = _log1p(cx, cx.emit(Op.ADD, a, cx.emit(Op.DIV, a2, root)))
    far = cx.emit(Op.ADD, cx.emit(Op.LOG, a), c(x, float(np.log(2.0))))
    y = cx.emit(Op.WHERE, cx.emit(Op.LESS, a, c(x, _far(x))), near, far)
    return [cx.emit(Op.MUL, cx.emit(Op.SIGN, x), y, final=True)]


@handler("Atanh")
def _atanh(cx: NodeCtx) -> list[Sym | None]:
    """sign(x) * 0.5 * log1p(2a / (1 - a)) with a = |x| (no cancellation for small a)."""
    x = _float_input(cx)
    a = cx.emit(Op.ABS, x)
    ratio = cx.emit(Op.DIV, cx.emit(Op.ADD, a, a), cx.emit(Op.SUB, c(x, 1.0), a))
    y = cx.emit(Op.MUL, _log1p(cx, ratio), c(x, 0.5))
    return [cx.emit(Op.MUL, cx.emit(Op.SIGN, x), y, final=True)]
