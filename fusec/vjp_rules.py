"""Vector-Jacobian rules, one per op (the table ``VJP``, keyed by ``Op`` like the op's other
tables): elementwise and broadcast ops, reductions and data movement here; products, norms,
softmax, attention, gathers and the loss in ``fusec.vjp_nn``.

A rule is ``rule(g, node, cts, need) -> [gradient or None per input]``: ``g`` a
``fusec.autodiff.Grad`` to emit with, ``cts`` the cotangents of the node's outputs (None: zero),
``need[i]`` whether input i needs a gradient (a rule may skip the others). A gradient has its
input's exact shape and dtype; None means zero (no contribution). Every rule is checked against
central finite differences of the numpy reference in float64 (tests/test_autodiff_rules.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fusec.autodiff import Rule
from fusec.autodiff import cotangent as _ct
from fusec.dtypes import DType
from fusec.errors import ModelError
from fusec.ir import Node, Value
from fusec.ops import Op

# ---- elementwise, unary -------------------------------------------------------------------------

def _unary(fn: Callable[[Any, Value, Value, Value, Any], Value | None]) -> Rule:
    def rule(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
        return [fn(g, n.inputs[0], n.outputs[0], _ct(g, n, cts), n.attrs)]
    return rule


def _erf(g: Any, x: Value, y: Value, dy: Value, a: Any) -> Value:
    e = g.op(Op.EXP, g.neg(g.mul(x, x)))
    return g.mul(dy, g.mul(e, g.scalar(2.0 / math.sqrt(math.pi), x)))


def _in_f32(fn: Callable[[Any, Value, Value, Value, Any], Value]) -> Callable[[Any, Value, Value, Value, Any], Value]:
    """An activation's gradient computed in fp32 for fp16/bf16 inputs (as the forward kernel does),
    cast back once: the casts fuse into the same elementwise kernel."""
    def rule(g: Any, x: Value, y: Value, dy: Value, a: Any) -> Value:
        if x.dtype not in (DType.F16, DType.BF16):
            return fn(g, x, y, dy, a)
        up = [g.op(Op.CAST, v, to=DType.F32) for v in (x, y, dy)]
        return g.op(Op.CAST, fn(g, *up, a), to=x.dtype)
    return rule


def _gelu(g: Any, x: Value, y: Value, dy: Value, a: Any) -> Value:
    if a.approximate == "tanh":
        c, k = math.sqrt(2.0 / math.pi), 0.044715
        x2 = g.mul(x, x)
        u = g.mul(g.scalar(c, x), g.add(x, g.mul(g.scalar(k, x), g.mul(x2, x))))
        t = g.op(Op.TANH, u)
        du = g.mul(g.scalar(c, x), g.add(g.scalar(1.0, x), g.mul(g.scalar(3.0 * k, x), x2)))
        left = g.mul(g.scalar(0.5, x), g.add(g.scalar(1.0, x), t))
        right = g.mul(g.mul(g.scalar(0.5, x), x), g.mul(g.sub(g.scalar(1.0, x), g.mul(t, t)), du))
        return g.mul(dy, g.add(left, right))
    cdf = g.mul(g.scalar(0.5, x), g.add(g.scalar(1.0, x), g.op(Op.ERF, g.mul(x, g.scalar(1.0 / math.sqrt(2.0), x)))))
    pdf = g.mul(g.op(Op.EXP, g.mul(g.scalar(-0.5, x), g.mul(x, x))), g.scalar(1.0 / math.sqrt(2.0 * math.pi), x))
    return g.mul(dy, g.add(cdf, g.mul(x, pdf)))


def _silu(g: Any, x: Value, y: Value, dy: Value, a: Any) -> Value:
    s = g.op(Op.SIGMOID, x)
    one = g.scalar(1.0, x)
    return g.mul(dy, g.mul(s, g.add(one, g.mul(x, g.sub(one, s)))))


def _cast(g: Any, x: Value, y: Value, dy: Value, a: Any) -> Value | None:
    return g.op(Op.CAST, dy, to=x.dtype) if x.dtype.is_float else None


UNARY: dict[Op, Callable[[Any, Value, Value, Value, Any], Value | None]] = {
    Op.NEG: lambda g, x, y, dy, a: g.neg(dy),
    Op.ABS: lambda g, x, y, dy, a: g.mul(dy, g.op(Op.SIGN, x)),
    Op.EXP: lambda g, x, y, dy, a: g.mul(dy, y),
    Op.LOG: lambda g, x, y, dy, a: g.div(dy, x),
    Op.SQRT: lambda g, x, y, dy, a: g.div(dy, g.mul(y, g.scalar(2.0, y))),
    Op.RECIPROCAL: lambda g, x, y, dy, a: g.neg(g.mul(dy, g.mul(y, y))),
    Op.ERF: _erf,
    Op.TANH: lambda g, x, y, dy, a: g.mul(dy, g.sub(g.scalar(1.0, y), g.mul(y, y))),
    Op.SIGMOID: lambda g, x, y, dy, a: g.mul(dy, g.mul(y, g.sub(g.scalar(1.0, y), y))),
    Op.RELU: lambda g, x, y, dy, a: g.op(Op.WHERE, g.op(Op.GREATER, x, g.scalar(0.0, x)), dy, g.scalar(0.0, dy)),
    Op.COS: lambda g, x, y, dy, a: g.neg(g.mul(dy, g.op(Op.SIN, x))),
    Op.SIN: lambda g, x, y, dy, a: g.mul(dy, g.op(Op.COS, x)),
    Op.CAST: _cast,
    Op.GELU: _in_f32(_gelu),
    Op.SILU: _in_f32(_silu),
    # piecewise constant: zero almost everywhere
    Op.FLOOR: lambda g, x, y, dy, a: None,
    Op.CEIL: lambda g, x, y, dy, a: None,
    Op.ROUND: lambda g, x, y, dy, a: None,
    Op.SIGN: lambda g, x, y, dy, a: None,
}


# ---- elementwise, binary (numpy broadcasting) ---------------------------------------------------

def _binary(fn: Callable[[Any, Value, Value, Value, Value, list[bool]], tuple[Value | None, Value | None]]) -> Rule:
    def rule(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
        a, b = n.inputs
        ga, gb = fn(g, a, b, n.outputs[0], _ct(g, n, cts), need)
        return [g.sum_to(ga, a.shape) if ga is not None and need[0] else None,
                g.sum_to(gb, b.shape) if gb is not None and need[1] else None]
    return rule


def _pow(g: Any, a: Value, b: Value, y: Value, dy: Value, need: list[bool]) -> tuple[Value | None, Value | None]:
    ga = gb = None
    if need[0]:
        bf = b if b.dtype == a.dtype else g.op(Op.CAST, b, to=a.dtype)
        ga = g.mul(dy, g.mul(bf, g.op(Op.POW, a, g.sub(bf, g.scalar(1.0, bf)))))
    if need[1] and b.dtype.is_float:
        gb = g.op(Op.CAST, g.mul(dy, g.mul(y, g.op(Op.LOG, a))), to=b.dtype) if b.dtype != a.dtype \
            else g.mul(dy, g.mul(y, g.op(Op.LOG, a)))
    return ga, gb


def _extremum(wins: Op, loses: Op) -> Callable[..., tuple[Value, Value]]:
    """max/min: the gradient goes to the winning operand; ties split it in halves (as torch)."""
    def fn(g: Any, a: Value, b: Value, y: Value, dy: Value, need: list[bool]) -> tuple[Value, Value]:
        zero, half = g.scalar(0.0, dy), g.mul(dy, g.scalar(0.5, dy))
        tie = g.op(Op.WHERE, g.op(Op.EQUAL, a, b), half, zero)
        return (g.op(Op.WHERE, g.op(wins, a, b), dy, tie), g.op(Op.WHERE, g.op(loses, a, b), dy, tie))
    return fn


BINARY: dict[Op, Callable[..., tuple[Value | None, Value | None]]] = {
    Op.ADD: lambda g, a, b, y, dy, need: (dy, dy),
    Op.SUB: lambda g, a, b, y, dy, need: (dy, g.neg(dy) if need[1] else None),
    Op.MUL: lambda g, a, b, y, dy, need: (g.mul(dy, b) if need[0] else None, g.mul(dy, a) if need[1] else None),
    Op.DIV: lambda g, a, b, y, dy, need: (g.div(dy, b) if need[0] else None,
                                          g.neg(g.div(g.mul(dy, y), b)) if need[1] else None),
    Op.POW: _pow,
    Op.MAX: _extremum(Op.GREATER, Op.LESS),
    Op.MIN: _extremum(Op.LESS, Op.GREATER),
}


def _where(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    c, x, y = n.inputs
    dy = _ct(g, n, cts)
    zero = g.scalar(0.0, dy)
    gx = g.sum_to(g.op(Op.WHERE, c, dy, zero), x.shape) if need[1] else None
    gy = g.sum_to(g.op(Op.WHERE, c, zero, dy), y.shape) if need[2] else None
    return [None, gx, gy]


# ---- reductions -----------------------------------------------------------------------------

def _kept(x: Value, axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if i in axes else d for i, d in enumerate(x.shape))


def _reduce_sum(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    x = n.inputs[0]
    dy = g.reshape(_ct(g, n, cts), _kept(x, n.attrs.axes))
    if n.op == Op.REDUCE_MEAN:
        count = math.prod(x.shape[i] for i in n.attrs.axes)
        dy = g.mul(dy, g.scalar(1.0 / max(count, 1), dy))
    return [g.expand(dy, x.shape)]


def _reduce_extremum(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    """The gradient goes to the elements equal to the extremum, split evenly among ties."""
    x = n.inputs[0]
    kept = _kept(x, n.attrs.axes)
    y, dy = g.reshape(n.outputs[0], kept), g.reshape(_ct(g, n, cts), kept)
    hit = g.op(Op.CAST, g.op(Op.EQUAL, x, y), to=x.dtype)
    count = g.reduce(Op.REDUCE_SUM, hit, n.attrs.axes)
    return [g.mul(hit, g.div(dy, count))]


def _cumsum(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    a = n.attrs
    return [g.op(Op.CUMSUM, _ct(g, n, cts), axis=a.axis, exclusive=a.exclusive, reverse=not a.reverse)]


# ---- data movement --------------------------------------------------------------------------

def _transpose(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    perm = n.attrs.perm
    inv = tuple(sorted(range(len(perm)), key=lambda i: perm[i]))
    return [g.op(Op.TRANSPOSE, _ct(g, n, cts), perm=inv)]


def _slice(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    x, a = n.inputs[0], n.attrs
    if any(st != 1 for st in a.steps):
        raise ModelError(f"slice with a step other than 1 has no gradient rule yet (node {n.describe()})")
    rank = len(x.shape)
    begin, end = [0] * rank, [0] * rank
    for ax, s, e in zip(a.axes, a.starts, a.ends):
        s = min(max(s, 0), x.shape[ax])
        e = min(max(e, s), x.shape[ax])
        begin[ax], end[ax] = s, x.shape[ax] - e
    return [g.op(Op.PAD, _ct(g, n, cts), pads=tuple(begin + end))]


def _concat(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    dy, ax, out = _ct(g, n, cts), n.attrs.axis, []
    start = 0
    for v, nd in zip(n.inputs, need):
        stop = start + v.shape[ax]
        out.append(g.op(Op.SLICE, dy, axes=(ax,), starts=(start,), ends=(stop,), steps=(1,)) if nd else None)
        start = stop
    return out


def _tile(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    x, reps = n.inputs[0], n.attrs.repeats
    split = tuple(d for r, s in zip(reps, x.shape) for d in (r, s))
    dy = g.reshape(_ct(g, n, cts), split)
    return [g.reshape(g.reduce(Op.REDUCE_SUM, dy, range(0, 2 * len(reps), 2), keepdims=False), x.shape)]


def _pad(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    x, a = n.inputs[0], n.attrs
    if a.mode != "constant" or (len(n.inputs) > 1 and need[1]):
        raise ModelError(f"pad in {a.mode} mode, or with a fill value that needs a gradient, has no gradient "
                         f"rule yet (node {n.describe()})")
    rank = len(x.shape)
    dy = _ct(g, n, cts)
    begins, ends = a.pads[:rank], a.pads[rank:]
    axes = tuple(range(rank))
    kept = g.op(Op.SLICE, dy, axes=axes, starts=tuple(max(b, 0) for b in begins),
                ends=tuple(dy.shape[i] - max(e, 0) for i, e in enumerate(ends)), steps=(1,) * rank)
    crop = tuple(-min(b, 0) for b in begins) + tuple(-min(e, 0) for e in ends)
    return [g.op(Op.PAD, kept, pads=crop) if any(crop) else kept] + [None] * (len(n.inputs) - 1)


def _layout(fn: Callable[[Any, Node, Value], Value]) -> Rule:
    def rule(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
        return [fn(g, n, _ct(g, n, cts))]
    return rule


def _table() -> dict[Op, Rule]:
    from fusec import vjp_nn

    table: dict[Op, Rule] = {op: _unary(fn) for op, fn in UNARY.items()}
    table.update({op: _binary(fn) for op, fn in BINARY.items()})
    table.update({
        Op.WHERE: _where,
        Op.REDUCE_SUM: _reduce_sum,
        Op.REDUCE_MEAN: _reduce_sum,
        Op.REDUCE_MAX: _reduce_extremum,
        Op.REDUCE_MIN: _reduce_extremum,
        Op.CUMSUM: _cumsum,
        Op.RESHAPE: _layout(lambda g, n, dy: g.reshape(dy, n.inputs[0].shape)),
        Op.EXPAND: _layout(lambda g, n, dy: g.sum_to(dy, n.inputs[0].shape)),
        Op.TRILU: _layout(lambda g, n, dy: g.op(Op.TRILU, dy, upper=n.attrs.upper, k=n.attrs.k)),
        Op.TRANSPOSE: _transpose,
        Op.SLICE: _slice,
        Op.CONCAT: _concat,
        Op.TILE: _tile,
        Op.PAD: _pad,
    })
    table.update(vjp_nn.RULES)
    return table


VJP: dict[Op, Rule] = _table()
