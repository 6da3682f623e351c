"""Recognize decomposed normalizations and replace each by one LAYERNORM or RMSNORM op.

Both are found from their distinctive core, ``1 / sqrt(reduce_mean(...) + eps)``, reached as a
divisor of a product (``x * reciprocal(sqrt(.))``, ``x * (1 / sqrt(.))``, ``x / sqrt(.)``: the
flattener in ``match.factors`` makes the order and grouping of the factors irrelevant):

- RMSNorm (HF Llama/Qwen/Mistral/Gemma): ``w * cast(h * rsqrt(mean(h^2) + eps))`` with ``h = cast(x,
  f32)``; the casts are optional; ``w`` a [D] weight (Gemma's ``1 + w`` is that after constant
  folding), absent -> ones.
- LayerNorm decomposed (ReduceMean/Sub/Pow/Sqrt/Div, opset < 17 exports):
  ``(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) * gamma + beta``.

The already-fused forms (LAYERNORM from ONNX LayerNormalization) are counted as they are.
Pattern / check / rewrite: ``_match_*`` return a match or a decline reason; only near matches
(the core was found) log a decline.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fusec.ir import Graph, Node, Value
from fusec.ops import CastAttrs, LayerNormAttrs, Op, RMSNormAttrs, infer
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter, factors, recognize, terms

NAME = "recognize_norms"
REQUIRES = ("constant_fold",)  # eps, weights and (1 + w) must be constants


@dataclasses.dataclass
class _Core:
    """``1 / sqrt(mean(stat_in) + eps)`` over the last axis; ``nodes`` = the nodes it consumed."""

    stat_in: Value
    eps: float
    nodes: list[Node]


def _strip_cast(ctx: Ctx, v: Value) -> Value:
    n = ctx.prod(v, Op.CAST)
    return n.inputs[0] if n is not None and n.inputs[0].dtype.is_float and v.dtype.is_float else v


def _square_of(ctx: Ctx, v: Value) -> tuple[Value, Node] | None:
    n = ctx.prod(v)
    if n is not None and n.op == Op.POW and ctx.scalar(n.inputs[1]) == 2.0:
        return n.inputs[0], n
    if n is not None and n.op == Op.MUL and n.inputs[0] is n.inputs[1]:
        return n.inputs[0], n
    return None


def _core(ctx: Ctx, q: Value) -> _Core | None:
    """Match the divisor ``q = sqrt(mean(s) + eps)`` (or ``q^-0.5`` handled by the caller)."""
    sq = ctx.prod(q, Op.SQRT)
    if sq is None or not ctx.single_use(q):
        return None
    nodes = [sq]
    if not ctx.single_use(sq.inputs[0]):
        return None
    eps, ts = terms(ctx, sq.inputs[0], nodes)
    if len(ts) != 1 or not 0 <= eps < float("inf"):  # the row kernels take a finite eps >= 0
        return None
    red = ctx.prod(ts[0], Op.REDUCE_MEAN)
    if red is None or not ctx.single_use(ts[0]):
        return None
    rank = len(red.inputs[0].shape)
    if red.attrs.axes != (rank - 1,) or not red.attrs.keepdims:
        return None
    nodes.append(red)
    return _Core(red.inputs[0], eps, nodes)


def _weight(leaves: list[Value], dim: int) -> tuple[Value | None, list[Value]]:
    """Split off the [D] weight leaf (a constant that broadcasts along the last axis only)."""
    rest, w = [], None
    for v in leaves:
        if w is None and v.data is not None and v.numel == dim and v.shape[-1:] == (dim,):
            w = v
        else:
            rest.append(v)
    return w, rest


def _match(ctx: Ctx, rw: Rewriter, root: Node, opts: PassOptions) -> list[Node] | None:
    out = root.outputs[0]
    if not out.dtype.is_float or len(out.shape) == 0:
        return None
    nodes: list[Node] = []
    bias: Value | None = None
    prod_root = out
    if root.op == Op.ADD:  # LayerNorm's "+ beta"
        c, ts = terms(ctx, out, nodes)
        consts = [t for t in ts if t.data is not None]
        if c != 0.0 or len(ts) != 2 or len(consts) != 1:
            return None
        bias = consts[0]
        prod_root = ts[0] if ts[1] is bias else ts[1]
        if ctx.prod(prod_root) is None or not ctx.single_use(prod_root):
            return None
    elif root.op not in (Op.MUL, Op.DIV):
        return None
    inv: list[Value] = []
    coef, leaves = factors(ctx, prod_root, nodes, root=prod_root is out, inv=inv, through_cast=True)
    if len(inv) != 1:
        return None
    core = _core(ctx, inv[0])
    if core is None:
        return None
    nodes += core.nodes
    where = ctx.where(root)
    dim = out.shape[-1]
    sq = _square_of(ctx, core.stat_in)
    if sq is None:
        opts.decline("norm", where, "the mean under the square root is not over a square (x*x or x^2)")
        return None
    base, sq_node = sq
    centred = ctx.prod(base, Op.SUB)
    kind = "layernorm" if centred is not None and ctx.prod(centred.inputs[1], Op.REDUCE_MEAN) else "rmsnorm"
    if not ctx.single_use(core.stat_in):
        opts.decline(kind, where, f"the squared value {core.stat_in.name!r} has other readers")
        return None
    nodes.append(sq_node)
    if coef != 1.0:
        opts.decline(kind, where, f"an extra constant factor {coef:g} multiplies the normalized value")
        return None
    w, rest = _weight(leaves, dim)
    if len(rest) != 1:
        opts.decline(kind, where, f"normalized product has {len(rest)} non-weight factors, expected 1 (x)")
        return None
    x_leaf = rest[0]

    if kind == "rmsnorm":
        x = _strip_cast(ctx, base)
        if _strip_cast(ctx, x_leaf) is not x:
            opts.decline("rmsnorm", where, "the value normalized is not the value whose square is averaged")
            return None
        for v in (base, x_leaf):  # an upcast that nothing else reads goes with the pattern
            c = ctx.prod(v, Op.CAST)
            if c is not None and v is not x:
                nodes.append(c)
        # An upcast with other readers (the residual add, in torch's export) stays alive for them;
        # RMSNORM reads x itself and upcasts internally.
        if tuple(out.shape) != tuple(x.shape):
            opts.decline("rmsnorm", where, f"the weight broadcasts {list(x.shape)} to {list(out.shape)}")
            return None
        if rw.claimed(nodes):
            return None
        new = _typed(rw, Op.RMSNORM, [x, _as_vector(rw, w, dim, out, "rmsnorm_weight")],
                     RMSNormAttrs(eps=float(core.eps)), out)
        rw.replace(root, new, nodes)
        return new

    # layernorm: x_leaf is d = x - mean(x), which the variance also squares
    d_node = ctx.prod(x_leaf, Op.SUB)
    if x_leaf is not base or d_node is None:
        opts.decline("layernorm", where, "the numerator is not the centred value whose square is averaged")
        return None
    mu = ctx.prod(d_node.inputs[1], Op.REDUCE_MEAN)
    x = d_node.inputs[0]
    if mu is None or mu.inputs[0] is not x or mu.attrs.axes != (len(x.shape) - 1,) or not mu.attrs.keepdims:
        opts.decline("layernorm", where, "the centred value is not x - mean(x) over the last axis")
        return None
    nodes += [d_node, mu]
    for v in (x_leaf, d_node.inputs[1]):
        if not ctx.only_used_by(v, nodes):
            opts.decline("layernorm", where, f"intermediate {v.name!r} has readers outside the norm")
            return None
    if tuple(out.shape) != tuple(x.shape):
        opts.decline("layernorm", where, f"the weight or bias broadcasts {list(x.shape)} to {list(out.shape)}")
        return None
    if rw.claimed(nodes):
        return None
    ins = [x, _as_vector(rw, w, dim, out, "layernorm_weight")]
    if bias is not None:
        if bias.numel != dim or bias.shape[-1:] != (dim,):  # (1, ..., 1, D): the last axis only
            opts.decline("layernorm", where, f"bias {list(bias.shape)} is not a [{dim}] vector")
            return None
        ins.append(_as_vector(rw, bias, dim, out, "layernorm_bias"))
    new = _typed(rw, Op.LAYERNORM, ins, LayerNormAttrs(axis=len(x.shape) - 1, eps=float(core.eps)), out)
    rw.replace(root, new, nodes)
    return new


def _as_vector(rw: Rewriter, w: Value | None, dim: int, like: Value, base: str) -> Value:
    if w is None:
        return rw.const(np.ones((dim,), like.dtype.np), base)
    if w.shape == (dim,):
        return w
    assert w.data is not None
    return rw.const(w.data.reshape(dim), w.name)


def _typed(rw: Rewriter, op: Op, ins: list[Value], attrs: object, out: Value) -> list[Node]:
    """``op`` producing ``out``, with a CAST when the op's own output dtype differs."""
    (shape, dt), = infer(op, attrs, [(v.shape, v.dtype) for v in ins])
    if dt == out.dtype:
        return [rw.node(op, ins, attrs, out=out)]
    first = rw.node(op, ins, attrs, base=f"{out.name}_{op.value}")
    return [first, rw.node(Op.CAST, [first.outputs[0]], CastAttrs(out.dtype), out=out)]


def run(graph: Graph, options: PassOptions) -> PassResult:
    # Outermost first: the weight multiply (or "+ beta") claims the inner product before the
    # inner product could be matched as a weightless norm.
    return recognize(graph, options, (Op.MUL, Op.DIV, Op.ADD),
                     lambda ctx, rw, n, o: _match(ctx, rw, n, o) is not None,
                     {"layernorm": Op.LAYERNORM, "rmsnorm": Op.RMSNORM}, "norms_recognized", outermost_first=True)
