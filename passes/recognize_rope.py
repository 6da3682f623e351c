"""Recognize rotate-half rotary position embedding and replace it by one ROPE op.

HF ``apply_rotary_pos_emb``: ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2], -1)``. Partial rotary (GPT-NeoX, Phi):
``cat(rope(x[..., :rd]), x[..., rd:], -1)`` becomes one ROPE with ``rotary_dim = rd``.
cos/sin are whatever tensors the model computes (constant tables, or gathered by position ids);
they must broadcast to the rotated part. The negation may be NEG or a multiply by -1.
"""

from __future__ import annotations

from fusec.ir import Graph, Node, Value
from fusec.ops import Op, RopeAttrs
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter, factors, recognize, terms

NAME = "recognize_rope"
REQUIRES = ("constant_fold",)


def _last_axis_slice(ctx: Ctx, v: Value) -> tuple[Value, int, int] | None:
    """(source, start, end) if ``v`` is a unit-step slice of the last axis only."""
    n = ctx.prod(v, Op.SLICE)
    if n is None:
        return None
    a, last = n.attrs, len(v.shape) - 1
    if a.axes != (last,) or a.steps != (1,):
        return None
    return n.inputs[0], a.starts[0], a.ends[0]


def _rotate_half_of(ctx: Ctx, rh: Value, nodes: list[Node]) -> Value | None:
    """The x with ``rh == rotate_half(x)``, or None."""
    cat = ctx.prod(rh, Op.CONCAT)
    if cat is None or len(cat.inputs) != 2 or cat.attrs.axis != len(rh.shape) - 1:
        return None
    neg_nodes: list[Node] = []
    coef, fs = factors(ctx, cat.inputs[0], neg_nodes, root=ctx.single_use(cat.inputs[0]))
    if coef != -1.0 or len(fs) != 1:
        return None
    hi, lo = _last_axis_slice(ctx, fs[0]), _last_axis_slice(ctx, cat.inputs[1])
    if hi is None or lo is None or hi[0] is not lo[0]:
        return None
    x = hi[0]
    d = x.shape[-1]
    if d % 2 or hi[1:] != (d // 2, d) or lo[1:] != (0, d // 2):
        return None
    nodes += [cat, *neg_nodes, ctx.prod(fs[0]), ctx.prod(cat.inputs[1])]  # type: ignore[list-item]
    return x


def _match(ctx: Ctx, rw: Rewriter, root: Node, opts: PassOptions) -> bool:
    out = root.outputs[0]
    nodes: list[Node] = []
    c0, ts = terms(ctx, out, nodes)
    if c0 != 0.0 or len(ts) != 2 or not out.dtype.is_float:
        return False
    prods = []
    for t in ts:
        if not ctx.single_use(t):
            return False
        k, fs = factors(ctx, t, nodes, root=False)
        if k != 1.0 or len(fs) != 2:
            return False
        prods.append(fs)
    for (p_rot, p_lin) in ((prods[0], prods[1]), (prods[1], prods[0])):
        for rh, sin in ((p_rot[0], p_rot[1]), (p_rot[1], p_rot[0])):
            inner: list[Node] = []
            x = _rotate_half_of(ctx, rh, inner)
            if x is None:
                continue
            where = ctx.where(root)
            if x not in p_lin:
                opts.decline("rope", where, "x * cos uses a different tensor than rotate_half(x) * sin")
                return False
            cos = p_lin[1] if p_lin[0] is x else p_lin[0]
            if x.shape != out.shape:
                opts.decline("rope", where, f"cos/sin broadcast x {list(x.shape)} to {list(out.shape)}")
                return False
            matched = nodes + inner
            for v in (n.outputs[0] for n in inner):
                if not ctx.only_used_by(v, matched):
                    opts.decline("rope", where, f"intermediate {v.name!r} has readers outside the rotation")
                    return False
            if rw.claimed(matched):
                return False
            why = _unsupported(x.shape, cos, sin, x.shape[-1])
            if why:
                opts.decline("rope", where, why)
                return False
            try:
                _emit(ctx, rw, root, x, cos, sin, matched)
            except ValueError as e:  # cos/sin that do not broadcast to the rotated part
                opts.decline("rope", where, str(e))
                return False
            return True
    return False


def _unsupported(x: tuple[int, ...], cos: Value, sin: Value, rd: int) -> str:
    """Why no rope kernel takes a ROPE over x [B, H, S, D] rotating ``rd`` columns ("" if one does):
    they read cos/sin as [B|1, 1, S|1, rd] rows shared by every head (any layout the reference runs
    is still recognized by nothing else, so declining keeps the model compilable)."""
    c = (1,) * (4 - len(cos.shape)) + cos.shape
    if len(x) != 4:
        return f"rope over a rank-{len(x)} x {list(x)}: the rope kernels take [B, H, S, D]"
    if cos.shape != sin.shape or len(c) != 4 or not (cos.dtype.is_float and sin.dtype.is_float):
        return f"cos {cos.type_str} and sin {sin.type_str} are not one float layout"
    if c[0] not in (1, x[0]) or (c[1] != 1 and x[1] != 1) or c[2] not in (1, x[2]) or c[3] != rd:
        return f"cos/sin {list(cos.shape)} are not [B|1, 1, S|1, {rd}] rows shared by every head of x {list(x)}"
    return ""


def _emit(ctx: Ctx, rw: Rewriter, root: Node, x: Value, cos: Value, sin: Value, matched: list[Node]) -> None:
    """ROPE for the whole head when the rotation covers a leading slice joined back to the rest."""
    part = _last_axis_slice(ctx, x)
    users = ctx.users(root.outputs[0])
    if part is not None and part[1] == 0 and len(users) == 1 and not ctx.is_output(root.outputs[0]):
        full, _, rd = part
        cat = users[0]
        rest = _last_axis_slice(ctx, cat.inputs[1]) if len(cat.inputs) == 2 else None
        if (cat.op == Op.CONCAT and cat.inputs[0] is root.outputs[0] and cat.attrs.axis == len(x.shape) - 1
                and rest is not None and rest == (full, rd, full.shape[-1]) and ctx.only_used_by(x, matched)):
            node = rw.node(Op.ROPE, [full, cos, sin], RopeAttrs(rd), out=cat.outputs[0])
            extra = [ctx.prod(x), ctx.prod(cat.inputs[1]), root]
            rw.replace(cat, [node], matched + [n for n in extra if n is not None])
            return
    rw.replace(root, [rw.node(Op.ROPE, [x, cos, sin], RopeAttrs(x.shape[-1]), out=root.outputs[0])], matched)


def run(graph: Graph, options: PassOptions) -> PassResult:
    return recognize(graph, options, (Op.ADD,), _match, {"rope": Op.ROPE}, "rope_recognized")
