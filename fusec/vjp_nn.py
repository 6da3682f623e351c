"""Vector-Jacobian rules of the network ops: matrix products (with transpose flags), gathers,
softmax, LayerNorm, RMSNorm, attention and the cross-entropy loss (``RULES``, merged into
``fusec.vjp_rules.VJP``). Norms, softmax, attention and the loss compute their gradients in fp32
when their inputs are stored in half precision, as their forward kernels do."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fusec.autodiff import Rule
from fusec.autodiff import cotangent as _ct
from fusec.dtypes import DType
from fusec.ir import Node, Value
from fusec.ops import Op


def _up(g: Any, v: Value) -> Value:
    """``v`` in the precision a high-level op computes in: fp16/bf16 go to fp32."""
    return g.op(Op.CAST, v, to=DType.F32) if v.dtype in (DType.F16, DType.BF16) else v


def _down(g: Any, v: Value, dt: DType) -> Value:
    return v if v.dtype == dt else g.op(Op.CAST, v, to=dt)


# ---- matrix products ----------------------------------------------------------------------------

def _matmul(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    a, b = n.inputs
    ta, tb = bool(getattr(n.attrs, "trans_a", False)), bool(getattr(n.attrs, "trans_b", False))
    dy = _ct(g, n, cts)
    if len(a.shape) == 1 or len(b.shape) == 1:  # as [1, K] / [K, 1] matrices
        a2 = g.reshape(a, (1,) + a.shape) if len(a.shape) == 1 else a
        b2 = g.reshape(b, b.shape + (1,)) if len(b.shape) == 1 else b
        y2 = g.op(Op.MATMUL, a2, b2, trans_a=ta, trans_b=tb)
        da, db = _product_grads(g, a2, b2, ta, tb, g.reshape(dy, y2.shape), need)
        return [g.reshape(da, a.shape) if da is not None else None, g.reshape(db, b.shape) if db is not None else None]
    da, db = _product_grads(g, a, b, ta, tb, dy, need)
    return [da, db]


def _product_grads(g: Any, a: Value, b: Value, ta: bool, tb: bool, dy: Value,
                   need: list[bool]) -> tuple[Value | None, Value | None]:
    """Gradients of y = op_a(a) @ op_b(b) for operands of rank >= 2. Products read their operands
    through the transpose flags; a product that reads A transposed gets operands of one batch
    shape (the lowering folds no batch axis into a transposed A)."""
    if len(b.shape) == 2 and len(a.shape) > 2 and not ta:
        # x [.., M, K] @ W: the weight's gradient is one [K, N] (or [N, K]) product over all rows
        k = a.shape[-1]
        da = g.op(Op.MATMUL, dy, b, trans_b=not tb) if need[0] else None
        db = None
        if need[1]:
            a2, dy2 = g.reshape(a, (a.numel // k, k)), g.reshape(dy, (dy.numel // dy.shape[-1], dy.shape[-1]))
            db = g.op(Op.MATMUL, dy2, a2, trans_a=True) if tb else g.op(Op.MATMUL, a2, dy2, trans_a=True)
        return da, db
    full = tuple(int(d) for d in np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    ae = g.expand(a, full + a.shape[-2:])
    be = g.expand(b, full + b.shape[-2:])
    da = db = None
    if need[0]:
        da = g.op(Op.MATMUL, be, dy, trans_a=tb, trans_b=True) if ta else g.op(Op.MATMUL, dy, be, trans_b=not tb)
        da = g.sum_to(da, a.shape)
    if need[1]:
        db = g.op(Op.MATMUL, dy, ae, trans_a=True, trans_b=ta) if tb else g.op(Op.MATMUL, ae, dy, trans_a=not ta)
        db = g.sum_to(db, b.shape)
    return da, db


# ---- gathers --------------------------------------------------------------------------------

def _gather(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    x, idx = n.inputs
    ax = n.attrs.axis
    return [g.op(Op.SCATTER_ADD, _ct(g, n, cts), idx, axis=ax, size=x.shape[ax]), None]


# ---- softmax, norms ---------------------------------------------------------------------------

def _softmax_grad(g: Any, p: Value, dp: Value, axis: int, scale: float = 1.0) -> Value:
    """d softmax: scale * p * (dp - sum(dp * p)) along ``axis`` (one SOFTMAX_GRAD node)."""
    return g.op(Op.SOFTMAX_GRAD, p, dp, axis=axis, scale=float(scale))


def _softmax(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    x = n.inputs[0]
    p, dy = _up(g, n.outputs[0]), _up(g, _ct(g, n, cts))
    return [_down(g, _softmax_grad(g, p, dy, n.attrs.axis), x.dtype)]


def _layernorm(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    """One LAYERNORM_GRAD node (it recomputes the statistics from x): dx and dy * xhat, whose sums
    over the rows are the scale's gradient (the bias's: the sums of dy)."""
    x, scale = n.inputs[0], n.inputs[1]
    xf, dy = _up(g, x), _up(g, _ct(g, n, cts))
    dx, dyxhat = g.op(Op.LAYERNORM_GRAD, xf, scale, dy, axis=n.attrs.axis, eps=float(n.attrs.eps))
    out: list[Value | None] = [None] * len(n.inputs)
    if need[0]:
        out[0] = _down(g, dx, x.dtype)
    if need[1]:
        out[1] = _down(g, g.sum_to(dyxhat, scale.shape), scale.dtype)
    if len(n.inputs) > 2 and need[2]:
        out[2] = _down(g, g.sum_to(dy, n.inputs[2].shape), n.inputs[2].dtype)
    return out


def _rmsnorm(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    x, w = n.inputs
    axis = len(x.shape) - 1
    xf, dy, wf = _up(g, x), _up(g, _ct(g, n, cts)), _up(g, w)
    ms = g.reduce(Op.REDUCE_MEAN, g.mul(xf, xf), (axis,))
    r = g.op(Op.RECIPROCAL, g.op(Op.SQRT, g.add(ms, g.scalar(n.attrs.eps, ms))))
    out: list[Value | None] = [None, None]
    if need[0]:
        gw = g.mul(dy, g.add(wf, g.scalar(n.attrs.weight_offset, wf)) if n.attrs.weight_offset else wf)
        r3 = g.mul(r, g.mul(r, r))
        corr = g.mul(g.mul(xf, r3), g.reduce(Op.REDUCE_MEAN, g.mul(gw, xf), (axis,)))
        out[0] = _down(g, g.sub(g.mul(gw, r), corr), x.dtype)
    if need[1]:
        out[1] = _down(g, g.sum_to(g.mul(dy, g.mul(xf, r)), w.shape), w.dtype)
    return out


# ---- attention --------------------------------------------------------------------------------

def _repeat_heads(g: Any, x: Value, rep: int) -> Value:
    if rep == 1:
        return x
    b, h, t, d = x.shape
    return g.reshape(g.expand(g.reshape(x, (b, h, 1, t, d)), (b, h, rep, t, d)), (b, h * rep, t, d))


def _attention(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    """Recompute the probabilities (as the reference defines them), then the products' and the
    softmax's gradients; GQA sums the repeated heads' key/value gradients back."""
    a = n.attrs
    q, k, v = (_up(g, x) for x in n.inputs[:3])
    mask = n.inputs[3] if len(n.inputs) > 3 else None
    dy = _up(g, _ct(g, n, cts))
    rep = q.shape[1] // k.shape[1]
    kr, vr = _repeat_heads(g, k, rep), _repeat_heads(g, v, rep)
    s = g.mul(g.op(Op.MATMUL, q, kr, trans_b=True), g.scalar(a.scale, q))
    t = None
    if a.softcap:
        t = g.op(Op.TANH, g.mul(s, g.scalar(1.0 / a.softcap, s)))
        s = g.mul(t, g.scalar(a.softcap, s))
    if mask is not None:
        s = g.op(Op.WHERE, mask, s, g.scalar(-math.inf, s)) if mask.dtype == DType.BOOL else g.add(s, _up(g, mask))
    if a.causal:
        sq, tk = s.shape[-2:]
        keep = g.const(np.tril(np.ones((sq, tk), bool), k=tk - sq), "grad_causal_keep")
        s = g.op(Op.WHERE, keep, s, g.scalar(-math.inf, s))
    p = g.op(Op.SOFTMAX, s, axis=3)
    if a.nan_to_zero:
        p = g.op(Op.WHERE, g.op(Op.ISNAN, p), g.scalar(0.0, p), p)
    out: list[Value | None] = [None] * len(n.inputs)
    if need[2]:
        dvr = g.op(Op.MATMUL, p, dy, trans_a=True)
        out[2] = _down(g, _sum_heads(g, dvr, rep, v.shape), n.inputs[2].dtype)
    if need[0] or need[1] or (mask is not None and need[3]):
        dp = g.op(Op.MATMUL, dy, vr, trans_b=True)
        if (mask is not None and need[3]) or t is not None:
            ds = _softmax_grad(g, p, dp, 3)
            if mask is not None and need[3]:
                out[3] = _down(g, g.sum_to(ds, mask.shape), mask.dtype)
            if t is not None:
                ds = g.mul(ds, g.sub(g.scalar(1.0, t), g.mul(t, t)))
            ds = g.mul(ds, g.scalar(a.scale, ds))
        else:  # the score scale folded into the softmax gradient's kernel
            ds = _softmax_grad(g, p, dp, 3, a.scale)
        if need[0]:
            out[0] = _down(g, g.op(Op.MATMUL, ds, kr), n.inputs[0].dtype)
        if need[1]:
            dkr = g.op(Op.MATMUL, ds, q, trans_a=True)
            out[1] = _down(g, _sum_heads(g, dkr, rep, k.shape), n.inputs[1].dtype)
    return out


def _sum_heads(g: Any, x: Value, rep: int, shape: tuple[int, ...]) -> Value:
    if rep == 1:
        return x
    b, h, t, d = shape
    return g.reduce(Op.REDUCE_SUM, g.reshape(x, (b, h, rep, t, d)), (2,), keepdims=False)


# ---- the loss ---------------------------------------------------------------------------------

def _cross_entropy(g: Any, n: Node, cts: list[Value | None], need: list[bool]) -> list[Value | None]:
    """(softmax(x) - onehot(label)) * dy per row, ignored rows none: one CROSS_ENTROPY_GRAD node."""
    x, labels = n.inputs
    dy = _ct(g, n, cts)
    return [g.op(Op.CROSS_ENTROPY_GRAD, x, labels, dy, ignore_index=n.attrs.ignore_index), None]


RULES: dict[Op, Rule] = {
    Op.MATMUL: _matmul,
    Op.GATHER: _gather,
    Op.SOFTMAX: _softmax,
    Op.LAYERNORM: _layernorm,
    Op.RMSNORM: _rmsnorm,
    Op.ATTENTION: _attention,
    Op.CROSS_ENTROPY: _cross_entropy,
}
