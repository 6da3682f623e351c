"""The fused-MLP family: a whole Linear -> activation -> Linear as one ``MlpSpec`` launch
(``templates/mlp.cu.jinja``), the body the ``mlp`` fusion rule proposes.

A body of this family is MATMUL m1 (x [.., K] by a constant 2-D weight, stored [K, F] or [F, K]
with ``trans_b``) -> elementwise nodes over its result (bias, activation: anything the elementwise
kernels compute, reading besides the product only per-column vectors, tensors of the hidden
shape or scalars) -> MATMUL m2 (by a constant 2-D weight, [F, N] or [N, F]) -> an elementwise
epilogue of the same kind (bias, residual) ending in the body's one output; reshapes that keep
the last dimension (an exporter's [B*S, F] <-> [B, S, F] views) may sit anywhere between. Gated
MLPs (Llama, Qwen3: the product's halves, one activated, multiplied) are declined: the hidden
value is not elementwise on one tile of the product. Both products are
exact fp16/bf16 products with fp32 accumulation (cuBLAS's too); the kernel rounds each stored
value as the reference stores it. fp32 MLPs are declined: their products stay cuBLAS's (exact
SGEMM or 3xTF32), and an fp32 copy of this kernel would need a second, FMA code path.

``plan(body)`` is the capability half (asked through ``fused.can_fuse`` while fusion forms
groups): it raises ``NoPlan`` saying why a body is not one such kernel, or returns what
``emit`` needs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fusec.codegen import specs as S
from fusec.codegen.specs_mlp import MLP_SMEM, MlpOperand, MlpSpec, mlp_tiles
from fusec.ir import Graph, Node, Value
from fusec.lower.skinny import is_constant
from fusec.ops import Op


class NoPlan(Exception):
    """The body is not one fused-MLP kernel; the message says why."""


@dataclasses.dataclass(frozen=True)
class Operand:
    value: Value  # body value
    kind: str  # "acc" (the product), "col", "full", "scalar"


@dataclasses.dataclass(frozen=True)
class Plan:
    m1: Node
    m2: Node
    hidden: Any  # fusec.codegen.elementwise.Expr over ``hidden_operands``
    hidden_operands: tuple[Operand, ...]
    epilogue: Any
    out_operands: tuple[Operand, ...]
    out: Value
    m: int
    k: int
    f: int
    n: int
    w1_nk: bool
    w2_nk: bool

    def spec(self, x_vec: bool = True) -> MlpSpec:
        dt = self.m1.inputs[0].dtype
        return MlpSpec(self.m, self.k, self.f, self.n, dt, self.hidden,
                       tuple(MlpOperand(o.value.dtype, o.kind) for o in self.hidden_operands), self.epilogue,
                       tuple(MlpOperand(o.value.dtype, o.kind) for o in self.out_operands), self.out.dtype,
                       w1_nk=self.w1_nk, w2_nk=self.w2_nk, x_vec=x_vec)


def _weight(body: Graph, mm: Node, which: str) -> tuple[int, int, bool]:
    """(rows of the product's K, columns, stored [N, K]) of ``mm``'s constant 2-D weight."""
    w = mm.inputs[1]
    if len(w.shape) != 2 or not is_constant(body, w):
        raise NoPlan(f"the fused MLP streams constant 2-D weights; {which}'s is {'not constant' if len(w.shape) == 2 else f'{len(w.shape)}-D'}")
    if getattr(mm.attrs, "precision", "f32") != "f32":
        raise NoPlan("the fused MLP computes exact products (not a 3xTF32 split)")
    nk = bool(getattr(mm.attrs, "trans_b", False))
    k, n = (w.shape[1], w.shape[0]) if nk else w.shape
    return k, n, nk


def _nodes_back(body: Graph, v: Value, stop: Value) -> set[Node]:
    """The nodes ``v`` is computed by, walking back from it and stopping at ``stop``."""
    producers = body.producers()
    seen: set[Node] = set()
    stack = [v]
    while stack:
        x = stack.pop()
        n = producers.get(x)
        if x is stop or n is None or n in seen:
            continue
        seen.add(n)
        stack.extend(n.inputs)
    return seen


def _kind(v: Value, rows: int, cols: int) -> str | None:
    """How the kernel indexes ``v`` at element (row, col) of a [rows, cols] result: one element, a
    per-column vector (leading dims 1), or the result's own flat order (any leading dims); None
    when it is none of these."""
    if v.numel == 1:
        return "scalar"
    if v.shape and v.shape[-1] == cols and v.numel == cols:
        return "col"
    if v.shape and v.shape[-1] == cols and v.numel == rows * cols:
        return "full"
    return None


_ORDER = {"scalar": 0, "col": 1, "full": 2}


def _expression(body: Graph, out: Value, leaf: Value, rows: int, cols: int, what: str) -> tuple[Any, tuple[Operand, ...]]:
    """``out`` as an elementwise expression over ``leaf`` (the product) and operands the kernel
    indexes by (row, column) of the [rows, cols] result. Reshapes that keep the last dimension are
    read through (they keep the flat order: an exporter's [B*S, F] <-> [B, S, F] views around its
    products), expands of a vector or a scalar too; anything else that is not elementwise declines."""
    from fusec.codegen.elementwise import CUDA_EXPR, Apply, Const, In
    from fusec.lower.fused_plan import _check_expr_size, _NoPlan
    from fusec.ops import OP_INFO, FusionKind

    producers = body.producers()
    try:
        _check_expr_size(out, producers, {leaf: True})  # bounds the recursion below
    except _NoPlan as e:
        raise NoPlan(f"the fused MLP's {what}: {e}") from None
    operands: list[Operand] = []
    index: dict[tuple[int, str], int] = {}
    memo: dict[Value, tuple[Any, str]] = {}

    def operand(v: Value, kind: str) -> Any:
        if v.dtype not in S.FLOATS:
            raise NoPlan(f"the fused MLP's {what} reads {v.name!r} of dtype {v.dtype.value}")
        key = (id(v), kind)
        if key not in index:
            index[key] = len(operands)
            operands.append(Operand(v, kind))
        return In(index[key])

    def go(v: Value) -> tuple[Any, str]:
        if v in memo:
            return memo[v]
        kind = "full" if v is leaf else _kind(v, rows, cols)
        if kind is None:
            raise NoPlan(f"the fused MLP's {what} reads {v.name!r} {list(v.shape)}, which is neither a scalar, a "
                         f"vector over the {cols} columns nor a tensor of the result's shape")
        n = producers.get(v)
        if v is leaf:
            res = (operand(v, "acc"), "full")
        elif v.is_const and v.numel == 1 and v.data is not None:
            res = (Const(v.data.reshape(()).item(), v.dtype), "scalar")
        elif n is None:
            res = (operand(v, kind), kind)
        elif n.op in (Op.RESHAPE, Op.EXPAND):
            res = go(n.inputs[0])
        elif OP_INFO[n.op].kind in (FusionKind.ELEMENTWISE, FusionKind.BROADCAST) and n.op in CUDA_EXPR \
                and len(n.outputs) == 1:
            args = [go(x) for x in n.inputs]
            res = (Apply(n.op, tuple(a for a, _ in args), n.attrs), max((k for _, k in args), key=_ORDER.__getitem__))
        else:
            raise NoPlan(f"the fused MLP's {what} is elementwise on its tile, not {n.op.value}")
        memo[v] = res
        return res

    expr, _ = go(out)
    if not any(o.kind == "acc" for o in operands):
        raise NoPlan(f"the fused MLP's {what} must read the product")
    return expr, tuple(operands)


def plan(body: Graph) -> Plan:
    mms = [n for n in body.nodes if n.op == Op.MATMUL]
    if len(mms) != 2:
        raise NoPlan("a fused MLP body has exactly two matrix products")
    m1, m2 = mms
    if body.nodes[0] is not m1 or m1.inputs[0] not in body.inputs:
        raise NoPlan("the fused MLP starts with its first product, reading x from outside")
    x = m1.inputs[0]
    if x.dtype not in S.HALFS:
        raise NoPlan(f"the fused MLP runs fp16/bf16 products on tensor cores; {x.dtype.value} products stay "
                     "cuBLAS's (exact SGEMM or 3xTF32)")
    if len(x.shape) < 2:
        raise NoPlan("the fused MLP multiplies rows of x")
    k, f, w1_nk = _weight(body, m1, "the first product")
    f2, n, w2_nk = _weight(body, m2, "the second product")
    h = m2.inputs[0]
    m = math.prod(x.shape[:-1])
    if f == 2 * f2 and h.shape[-1] == f2:
        raise NoPlan("a gated unit between the products (the first product's halves, one activated, multiplied) "
                     "is not elementwise on the hidden tile: the fused MLP does not cover it")
    if f2 != f or h.shape[-1] != f or math.prod(h.shape[:-1]) != m:
        raise NoPlan("the second product must multiply the hidden activation's rows")
    if len({v.dtype for v in (x, m1.inputs[1], m1.output, h, m2.inputs[1], m2.output)}) != 1:
        raise NoPlan("the fused MLP's products, weights and hidden activation share one dtype")
    for what, v in (("K", k), ("F", f), ("N", n)):
        if v % 8:
            raise NoPlan(f"the fused MLP copies weights 16 bytes at a time: {what} = {v} is not a multiple of 8")
    if len(body.outputs) != 1:
        raise NoPlan(f"the fused MLP writes one output, the group has {len(body.outputs)}")
    out = body.outputs[0]
    if len(out.shape) < 1 or out.shape[-1] != n or out.numel != m * n:
        raise NoPlan("the fused MLP's output keeps the second product's [rows, N] shape")
    if h is m1.output:
        raise NoPlan("the fused MLP applies an elementwise activation between its products")
    hidden, hidden_ops = _expression(body, h, m1.output, m, f, "activation")
    epilogue, out_ops = _expression(body, out, m2.output, m, n, "epilogue")
    covered = _nodes_back(body, h, m1.output) | _nodes_back(body, out, m2.output) | {m1, m2}
    if covered != set(body.nodes) or m2 in _nodes_back(body, h, m1.output):
        raise NoPlan("the fused MLP computes the activation between its products and the epilogue after them, nothing else")
    if mlp_tiles(m, k, f, n, w1_nk, w2_nk) is None:
        raise NoPlan(f"the fused MLP keeps a block's rows of x in shared memory: K = {k} does not fit "
                     f"({MLP_SMEM} bytes)")
    return Plan(m1, m2, hidden, hidden_ops, epilogue, out_ops, out, m, k, f, n, w1_nk, w2_nk)


def emit(ctx: Any, p: Plan, node: Node, label: str) -> None:
    """One MlpSpec launch over the fused node's operands."""
    body: Graph = node.attrs.body
    outer: dict[Value, Value] = dict(zip(body.inputs, node.inputs))
    outer.update({c: c for c in body.constants})
    x = outer[p.m1.inputs[0]]
    spec = p.spec(x_vec=ctx.aligned(x))  # an x starting mid-buffer is copied element by element
    args: list[Any] = [x, outer[p.m1.inputs[1]], outer[p.m2.inputs[1]]]
    args += [outer[o.value] for o in p.hidden_operands + p.out_operands if o.kind != "acc"]
    ctx.kernel(spec, args + [node.output], f"{label} mlp")
