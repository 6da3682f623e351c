"""Which fused bodies one kernel covers, and the plan each kernel reads: ``can_fuse`` (the
capability query the fusion pass asks while it forms groups) and ``kernel_plan`` (the family and
its plan, which kernel selection records and ``fusec.lower.fused`` lowers).

- elementwise: a body of elementwise/broadcast ops, plus transposes, expands and reshapes that
  only add or drop size-1 axes, becomes one elementwise kernel. Each leaf read is an operand with
  its own strides over the output's iteration space (scalar constants become literals). Several
  outputs of one shape (but for size-1 axes) are written at the same index by one kernel.
- gemm epilogue: MATMUL followed by an elementwise chain: the matrix product (cuBLAS) writes the
  node's output, then one elementwise kernel applies the whole epilogue in place. Where cuBLASLt
  computes the epilogue exactly (bias, ReLU, tanh-GELU, residual), the kernel choice lowers the node
  as one cuBLASLt call instead (``fusec.lower.gemm_lt``, picked in ``fusec.lower.choices``).
- attention layout: ATTENTION with the slices/reshapes/transposes that bring q/k/v (and the mask)
  into [B, H, S, D] and the output back: the attention kernel reads and writes through strides.
- rope layout: ROPE with the layout views in front of its input: the rope kernel reads through strides.
- add + norm: ADD feeding LAYERNORM/RMSNORM: one row kernel (the sum goes to scratch when only
  the norm's result is read).
- mlp: MATMUL -> elementwise -> MATMUL -> elementwise, the whole MLP as one kernel
  (``fusec.lower.mlp``).

The fusion pass never forms a group that none covers (it records the decline with
``Capability.reason``); meeting one in the lowering is a compiler bug (``LoweringError``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fusec.codegen import specs as S
from fusec.codegen.elementwise import CUDA_EXPR, Apply, Const, Expr, In
from fusec.ir import Graph, Node, Value
from fusec.lower import layout as L
from fusec.ops import OP_INFO, FusionKind, Op

_ELEMENTWISE = (FusionKind.ELEMENTWISE, FusionKind.BROADCAST)
_LAYOUT = (Op.SLICE, Op.RESHAPE, Op.TRANSPOSE, Op.EXPAND)


class _NoPlan(Exception):
    pass


@dataclasses.dataclass
class IndexedExpr:
    """An expression over operands that each read a value through strides of the iteration space."""

    expr: Expr
    operands: list[tuple[Value, tuple[int, ...], int]]  # (body value read, strides over out dims, element offset)
    plain: bool  # every operand is a plain broadcast (no transpose/reshape/slice): vectorizable path
    more: tuple[Expr, ...] = ()  # a multi-output group's other outputs, over the same operands and index space


def index_expr(body: Graph, out: Value, leaves: dict[Value, Any] | None = None,
               more: tuple[Value, ...] = ()) -> IndexedExpr:
    """``out`` (a body value) as an expression over body inputs (and ``leaves``), or _NoPlan; ``more``: other
    outputs of out's shape, over the same operands (a multi-output kernel's).

    Each value is reached with ``rows`` (for each of its axes: the iteration axis it follows, or
    None for coordinate 0) and ``base`` (its start coordinate per axis, from slices)."""
    producers = body.producers()
    for o in (out, *more):
        _check_expr_size(o, producers, leaves)  # before the recursive walk below: bounded depth
    operands: list[tuple[Value, tuple[int, ...], int]] = []
    index: dict[tuple[int, tuple[int, ...], int], int] = {}
    plain = [True]
    rank = len(out.shape)
    Rows = tuple[int | None, ...]

    def operand(v: Value, rows: Rows, base: tuple[int, ...]) -> Expr:
        cs = L.View.contiguous(v.shape).strides
        strides = [0] * max(rank, 1)
        for j, d in enumerate(rows):
            if d is not None:
                strides[d] += cs[j]
        offset = sum(b * c for b, c in zip(base, cs))
        key = (id(v), tuple(strides), offset)
        if key not in index:
            index[key] = len(operands)
            operands.append((v, tuple(strides), offset))
        return In(index[key])

    def go(v: Value, rows: Rows, base: tuple[int, ...]) -> Expr:
        if v.is_const and v.numel == 1:
            assert v.data is not None
            return Const(v.data.reshape(()).item(), v.dtype)
        n = producers.get(v)
        if n is None or (leaves is not None and v in leaves):
            return operand(v, rows, base)
        x = n.inputs[0]
        if n.op == Op.TRANSPOSE:
            x_rows: list[int | None] = [None] * len(rows)
            x_base = [0] * len(rows)
            for k, p in enumerate(n.attrs.perm):
                x_rows[p], x_base[p] = rows[k], base[k]
            plain[0] = False
            return go(x, tuple(x_rows), tuple(x_base))
        if n.op == Op.SLICE:
            if any(st != 1 for st in n.attrs.steps):
                raise _NoPlan("strided slice inside an elementwise body")
            x_base = list(base)
            for ax, start in zip(n.attrs.axes, n.attrs.starts):
                x_base[ax] += start
            plain[0] = False
            return go(x, rows, tuple(x_base))
        if n.op == Op.RESHAPE:
            big_v = [j for j, d in enumerate(v.shape) if d != 1]
            big_x = [j for j, d in enumerate(x.shape) if d != 1]
            if [v.shape[j] for j in big_v] != [x.shape[j] for j in big_x]:
                raise _NoPlan("reshape that regroups axes")
            x_rows = [None] * len(x.shape)
            x_base = [0] * len(x.shape)
            for jv, jx in zip(big_v, big_x):
                x_rows[jx], x_base[jx] = rows[jv], base[jv]
            plain[0] = False
            return go(x, tuple(x_rows), tuple(x_base))
        if n.op == Op.EXPAND or (OP_INFO[n.op].kind in _ELEMENTWISE and n.op in CUDA_EXPR):
            args = []
            for xi in (n.inputs[:1] if n.op == Op.EXPAND else n.inputs):
                off = len(v.shape) - len(xi.shape)
                keep = [xi.shape[j] == v.shape[j + off] for j in range(len(xi.shape))]
                args.append(go(xi, tuple(rows[j + off] if keep[j] else None for j in range(len(xi.shape))),
                               tuple(base[j + off] if keep[j] else 0 for j in range(len(xi.shape)))))
            return args[0] if n.op == Op.EXPAND else Apply(n.op, tuple(args), n.attrs)
        raise _NoPlan(f"{n.op.value} inside an elementwise body")

    def rows_of(o: Value) -> Rows:  # another output over out's iteration axes (the same sizes but for 1s)
        big_o = [j for j, d in enumerate(o.shape) if d != 1]
        big = [j for j, d in enumerate(out.shape) if d != 1]
        rows: list[int | None] = [None] * len(o.shape)
        for jo, j in zip(big_o, big):
            rows[jo] = j
        return tuple(rows)

    exprs = [go(out, tuple(range(rank)), (0,) * rank)] + [go(o, rows_of(o), (0,) * len(o.shape)) for o in more]
    return IndexedExpr(exprs[0], operands, plain[0], tuple(exprs[1:]))


MAX_EXPR_DEPTH = 200  # ops on the longest path of one elementwise kernel's expression
MAX_EXPR_NODES = 20000  # its size as a tree (a value read twice is expanded twice)


def _check_expr_size(out: Value, producers: dict[Value, Node], leaves: dict[Value, Any] | None) -> None:
    """_NoPlan when ``out``'s expression is deeper or larger than one kernel takes; iterative, so a
    10,000-op chain is declined (and split by the fusion pass) instead of overflowing the stack."""
    depth: dict[Value, int] = {}
    size: dict[Value, int] = {}
    stack: list[tuple[Value, bool]] = [(out, False)]
    while stack:
        v, ready = stack.pop()
        if v in depth:
            continue
        n = producers.get(v)
        if n is None or (leaves is not None and v in leaves):
            depth[v], size[v] = 0, 1
            continue
        if not ready:
            stack.append((v, True))
            stack.extend((x, False) for x in n.inputs if x not in depth)
            continue
        depth[v] = 1 + max((depth[x] for x in n.inputs), default=0)
        size[v] = min(1 + sum(size[x] for x in n.inputs), MAX_EXPR_NODES + 1)
        if depth[v] > MAX_EXPR_DEPTH:
            raise _NoPlan(f"an elementwise kernel computes at most {MAX_EXPR_DEPTH} ops in a row")
        if size[v] > MAX_EXPR_NODES:
            raise _NoPlan(f"an elementwise kernel's expression has at most {MAX_EXPR_NODES} terms")


# ---- attention and rope with their layouts ------------------------------------------------------------------

def _view_from_input(body: Graph, v: Value, through: Node | None = None) -> tuple[int, L.View]:
    """Follow layout ops back from ``v`` to a body input: (input index, view of v in that input).
    ``through``: a row-wise node (a norm over the last axis) walked through as if it were the
    identity, for kernels that apply it to the rows they load (``fusec.lower.heads``)."""
    producers = body.producers()
    chain = []
    while v not in body.inputs:
        n = producers.get(v)
        if n is None:
            raise _NoPlan("a kernel operand is a constant inside the body")
        if n is through:
            v = n.inputs[0]
            continue
        if n.op not in _LAYOUT:
            raise _NoPlan(f"the kernel reads its operands in place through layout views only, not through {n.op.value}")
        chain.append(n)
        v = n.inputs[0]
    view: L.View | None = L.View.contiguous(v.shape)
    for n in reversed(chain):
        view = L.apply(view, n) if view is not None else None
    if view is None:
        raise _NoPlan("a kernel operand's layout views do not compose into one strided view of a body input")
    return body.inputs.index(v), view


def _attention_plan(body: Graph) -> dict[str, Any]:
    attn = [n for n in body.nodes if n.op == Op.ATTENTION]
    if len(attn) != 1 or len(body.outputs) != 1:
        raise _NoPlan("not one attention with one output")
    a = attn[0]
    users = body.users()
    operands = [_view_from_input(body, x) for x in a.inputs]
    # output: follow single-user layout ops forward to the body output, then invert from there
    chain, v = [], a.output
    while v is not body.outputs[0]:
        us = users.get(v, [])
        if len(us) != 1 or us[0].op not in (Op.TRANSPOSE, Op.RESHAPE):
            raise _NoPlan("attention output reaches the group output through other ops")
        chain.append(us[0])
        v = us[0].output
    oview: L.View | None = L.View.contiguous(body.outputs[0].shape)
    for n in reversed(chain):
        oview = L.inverse(oview, n) if oview is not None else None
    if oview is None:
        raise _NoPlan("attention output layout is not a strided view")
    for _, view in operands[:3] + [(0, oview)]:
        if view.strides[-1] != 1:
            raise _NoPlan("attention operands need a contiguous head dim")
        if a.output.dtype in S.HALFS and any(x % 8 for x in view.strides[:3]):  # AttentionSpec's own rule
            raise _NoPlan("tensor-core attention reads operands through strides that keep rows 16-byte aligned")
    return {"node": a, "operands": operands, "out": oview}


# ---- the capability query -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Capability:
    """The codegen's answer to "can this group be one kernel?" (Inductor's ``can_fuse`` on its
    scheduler backends). ``kernel`` names the template family that emits it, or is None and
    ``reason`` says why no single kernel covers the group."""

    kernel: str | None
    reason: str = ""

    def __bool__(self) -> bool:
        return self.kernel is not None


def can_fuse(body: Graph) -> Capability:
    """Whether one kernel can compute ``body`` (a fused node's body, or a group fusion is forming).
    The fusion pass asks this for every group it forms and declines, with ``reason``, the groups
    that would not be one kernel: whatever it records as applied, ``lower_fused`` emits as one."""
    try:
        return Capability(kernel_plan(body)[0])
    except _NoPlan as e:
        return Capability(None, str(e))


def kernel_plan(body: Graph) -> tuple[str, Any]:
    """(template family, what its lowering needs) for ``body``, or _NoPlan naming why none fits."""
    ops = [n.op for n in body.nodes]
    if Op.ATTENTION in ops:
        return ("attention", _attention_plan(body))
    if Op.KV_ATTENTION in ops:  # decode attention with its head_rope group as the prologue
        from fusec.lower import decode, heads

        try:
            return ("kv_attention_heads", decode.plan_heads(body))
        except heads.NoPlan as e:
            raise _NoPlan(str(e)) from None
    if Op.ROPE in ops:
        from fusec.lower import heads

        if heads.applies(body):  # a norm before it or a cache write after it: the head_rope family
            try:
                return ("head_rope", heads.plan(body))
            except heads.NoPlan as e:
                raise _NoPlan(str(e)) from None
        return ("rope", _rope_plan(body))
    if ops.count(Op.MATMUL) == 2:  # a whole MLP: fusec.lower.mlp
        from fusec.lower import mlp

        try:
            return ("mlp", mlp.plan(body))
        except mlp.NoPlan as e:
            raise _NoPlan(str(e)) from None
    if ops.count(Op.QMATMUL) >= 2:  # packed products of one norm, in different formats: one launch
        from fusec.lower import skinny

        try:
            return ("gemv", skinny.plan_siblings(body))
        except skinny.NoPlan as e:
            raise _NoPlan(str(e)) from None
    if Op.MATMUL in ops or Op.QMATMUL in ops:
        from fusec.lower import skinny

        if skinny.applies(body):  # a norm before it, a gated unit or a sample after it: decode's skinny product
            try:
                return ("gemv", skinny.plan(body))
            except skinny.NoPlan as e:
                raise _NoPlan(str(e)) from None
    if Op.MATMUL in ops or Op.QMATMUL in ops:  # a QMATMUL (packed weight) takes the same epilogues
        if ops[0] not in (Op.MATMUL, Op.QMATMUL) or Op.MATMUL in ops[1:] or Op.QMATMUL in ops[1:]:
            raise _NoPlan("a matrix product reads its operands as they are: one product, first, "
                          "with an elementwise epilogue only")
        return ("gemm_epilogue", _epilogue_plan(body))
    if any(OP_INFO[o].kind == FusionKind.REDUCE for o in ops):
        return ("add_norm", _add_norm_plan(body))
    out, *more = body.outputs
    if any([d for d in o.shape if d != 1] != [d for d in out.shape if d != 1] for o in more):
        raise _NoPlan("a multi-output elementwise kernel writes outputs of one shape (but for size-1 axes): "
                      + ", ".join(f"{o.name}{list(o.shape)}" for o in body.outputs))
    return ("elementwise", index_expr(body, out, more=tuple(more)))


def _rope_plan(body: Graph) -> tuple[Node, int, L.View, L.View]:
    ropes = [n for n in body.nodes if n.op == Op.ROPE]
    if len(ropes) != 1 or any(n.op not in _LAYOUT for n in body.nodes if n.op != Op.ROPE) or len(body.outputs) != 1:
        raise _NoPlan("the rope kernel takes one rope with layout views (slice/reshape/transpose/expand) "
                      "in front of it, and nothing else")
    rope = ropes[0]
    if rope.output is not body.outputs[0] or any(x not in body.inputs for x in rope.inputs[1:]):
        raise _NoPlan("rope must be the group's output and read cos/sin directly")
    xi, xview = _view_from_input(body, rope.inputs[0])
    if len(xview.shape) != 4 or xview.strides[-1] != 1:
        raise _NoPlan("rope input is not a [B, H, S, D] view with contiguous D")
    cos, sin = rope.inputs[1:]
    B, H, S_, _ = rope.output.shape
    cst = L.broadcast_to(L.View.contiguous(cos.shape), (B, H, S_, rope.attrs.rotary_dim))
    if cst is None or (cst.strides[1] != 0 and H != 1) or cst.strides[3] != 1 or cos.shape != sin.shape:
        raise _NoPlan(f"rope cos/sin {list(cos.shape)} are not [S, rotary_dim] rows shared by every head")
    return rope, xi, xview, cst


def _epilogue_plan(body: Graph) -> tuple[Node, IndexedExpr]:
    mm = body.nodes[0]
    if len(body.outputs) != 1:
        raise _NoPlan("a GEMM epilogue writes one output")
    if getattr(mm.attrs, "trans_a", False):
        raise _NoPlan("a product reading A transposed (a gradient) takes no epilogue")
    out = body.outputs[0]
    if mm.output is out:
        raise _NoPlan("no epilogue")
    if out.shape != mm.output.shape or out.dtype != mm.output.dtype:
        raise _NoPlan("the epilogue changes the shape or dtype of the product")
    return mm, index_expr(body, out, leaves={mm.output: True})


def _add_norm_plan(body: Graph) -> tuple[Node, Node]:
    ops = [n.op for n in body.nodes]
    if ops != [Op.ADD, Op.LAYERNORM] and ops != [Op.ADD, Op.RMSNORM]:
        names = "+".join(o.value for o in ops)
        raise _NoPlan(f"the only fused reduction is add -> layernorm/rmsnorm (one row kernel), not {names}")
    add, norm = body.nodes
    if norm.inputs[0] is not add.output or add.inputs[0].shape != add.inputs[1].shape:
        raise _NoPlan("add + norm needs the norm to read the sum of two same-shape operands")
    return add, norm
