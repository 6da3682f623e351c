"""The fused-MLP family: a whole Linear -> activation -> Linear as one ``MlpSpec`` launch
(``templates/mlp.cu.jinja``), the body the ``mlp`` fusion rule proposes.

A body of this family is MATMUL m1 (x [.., K] by a constant 2-D weight, stored [K, F] or [F, K]
with ``trans_b``) -> elementwise nodes over its result (bias, activation: anything the elementwise
kernels compute, reading besides the product only per-column vectors, tensors of the hidden
shape or scalars) -> MATMUL m2 (by a constant 2-D weight, [F, N] or [N, F]) -> an elementwise
epilogue of the same kind (bias, residual) ending in the body's one output. Both products are
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
    offset: int  # element offset into it
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


def _expression(body: Graph, out: Value, leaf: Value, what: str) -> tuple[Any, tuple[Operand, ...]]:
    """``out`` as an elementwise expression over ``leaf`` (the product) and operands the kernel can
    index by (row, column) of ``out``."""
    from fusec.codegen.spec_base import contiguous_strides
    from fusec.lower.fused import _NoPlan, index_expr

    try:
        ie = index_expr(body, out, leaves={leaf: True})
    except _NoPlan as e:
        raise NoPlan(f"the fused MLP's {what} is one elementwise expression: {e}") from None
    contig = contiguous_strides(out.shape)
    ops: list[Operand] = []
    for v, strides, offset in ie.operands:
        if v is leaf:
            if strides != contig or offset:
                raise NoPlan(f"the fused MLP's {what} reads the product element by element only")
            kind = "acc"
        elif all(s == 0 for s in strides):
            kind = "scalar"
        elif strides[-1] == 1 and all(s == 0 for s in strides[:-1]):
            kind = "col"
        elif strides == contig:
            kind = "full"
        else:
            raise NoPlan(f"the fused MLP's {what} reads {v.name!r} through a layout it cannot index "
                         "(a per-column vector, a tensor of the result's shape or a scalar)")
        if v.dtype not in S.FLOATS:
            raise NoPlan(f"the fused MLP's {what} reads {v.name!r} of dtype {v.dtype.value}")
        ops.append(Operand(v, offset, kind))
    if sum(o.kind == "acc" for o in ops) != 1:
        raise NoPlan(f"the fused MLP's {what} must read the product")
    return ie.expr, tuple(ops)


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
    hidden, hidden_ops = _expression(body, h, m1.output, "activation")
    epilogue, out_ops = _expression(body, out, m2.output, "epilogue")
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
    args += [(outer[o.value], o.offset) for o in p.hidden_operands + p.out_operands if o.kind != "acc"]
    ctx.kernel(spec, args + [node.output], f"{label} mlp")
