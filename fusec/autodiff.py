"""Reverse-mode automatic differentiation on the IR: a forward graph and a scalar loss give a
backward pass in the same IR (autodidax's ``vjp`` over a jaxpr, one rule per primitive).

``backward(b, loss, wrt)`` appends to the GraphBuilder ``b`` (which holds the forward) the nodes
that compute d loss / d w for every ``w`` in ``wrt`` and returns {w: gradient value} (None where
the loss does not depend on w). It walks the forward nodes in reverse order; a node some
cotangent reaches is differentiated by its op's vector-Jacobian rule (``fusec.vjp_rules.VJP``,
a table keyed by ``Op`` like the op's other tables), which emits ordinary IR ops (products with
transpose flags, elementwise ops, reductions, gathers; ``scatter_add`` for a gather's gradient).
Cotangents of a value read several times are summed. Only floating-point values carry
gradients: paths through integers or booleans (ids, masks, comparisons) carry none.

A node whose op has no rule is refused, naming the op and the node, when a gradient must pass
through it (``ModelError``). ``grad_graph`` is the same on a finished Graph (tests, checks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.errors import ModelError
from fusec.ir import Graph, Node, Value
from fusec.ops import Op

ROWS_AS_PRODUCT = 64  # sums over at least this many leading rows run as a product with ones (Grad.sum_to)

# rule(g, node, output cotangents (None: zero), need per input) -> gradient per input (None: zero)
Rule = Callable[["Grad", Node, list[Value | None], list[bool]], list[Value | None]]


class Grad:
    """What a VJP rule emits with: the builder, plus shape helpers and cached scalar constants."""

    def __init__(self, b: GraphBuilder):
        self.b = b
        self._scalars: dict[tuple[float, DType], Value] = {}
        self._ones: dict[tuple[int, DType], Value] = {}

    def op(self, op: Op, *inputs: Value, **attrs: Any) -> Any:
        return self.b.emit(op, *inputs, **attrs)

    def scalar(self, x: float, like: Value | DType) -> Value:
        dt = like if isinstance(like, DType) else like.dtype
        key = (float(x), dt)
        v = self._scalars.get(key)
        if v is None:
            v = self._scalars[key] = self.b.scalar(x, dt, name=f"grad_scalar_{dt.value}_{float(x)!r}")
        return v

    def const(self, data: np.ndarray, name: str) -> Value:
        return self.b.const(data, name=name)

    # sugar for the rules
    def add(self, a: Value, b: Value) -> Value:
        return self.op(Op.ADD, a, b)

    def sub(self, a: Value, b: Value) -> Value:
        return self.op(Op.SUB, a, b)

    def mul(self, a: Value, b: Value) -> Value:
        return self.op(Op.MUL, a, b)

    def div(self, a: Value, b: Value) -> Value:
        return self.op(Op.DIV, a, b)

    def neg(self, a: Value) -> Value:
        return self.op(Op.NEG, a)

    def reshape(self, x: Value, shape: Sequence[int]) -> Value:
        shape = tuple(int(d) for d in shape)
        return x if x.shape == shape else self.op(Op.RESHAPE, x, shape=shape)

    def expand(self, x: Value, shape: Sequence[int]) -> Value:
        """``x`` (rank <= len(shape), broadcastable) read as ``shape``."""
        shape = tuple(int(d) for d in shape)
        if x.shape == shape:
            return x
        x = self.reshape(x, (1,) * (len(shape) - len(x.shape)) + x.shape)
        return x if x.shape == shape else self.op(Op.EXPAND, x, shape=shape)

    def sum_to(self, g: Value, shape: Sequence[int]) -> Value:
        """Sum ``g`` over the axes along which a value of ``shape`` was broadcast to ``g.shape``.
        A sum over many leading rows (a bias's gradient: [B, S, N] -> [N]) is a product with a row
        of ones, which cuBLAS reads row by row; a reduction kernel would read down the columns."""
        shape = tuple(int(d) for d in shape)
        if g.shape == shape:
            return g
        lead = len(g.shape) - len(shape)
        axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape) if d == 1 and g.shape[lead + i] != 1)
        kept = [i for i in range(len(g.shape)) if i not in axes and g.shape[i] != 1]
        rows = math.prod(g.shape[i] for i in axes)
        if axes and g.dtype.is_float and rows >= ROWS_AS_PRODUCT and kept and min(kept) > max(axes):
            cols = g.numel // rows
            ones = self.ones_row(rows, g.dtype)
            return self.reshape(self.op(Op.MATMUL, ones, self.reshape(g, (rows, cols))), shape)
        if axes:
            g = self.op(Op.REDUCE_SUM, g, axes=axes, keepdims=False)
        return self.reshape(g, shape)

    def ones_row(self, n: int, dtype: DType) -> Value:
        key = (n, dtype)
        v = self._ones.get(key)
        if v is None:
            v = self._ones[key] = self.b.const(np.ones((1, n), dtype.np), name=f"grad_ones_{n}", dtype=dtype)
        return v

    def reduce(self, op: Op, x: Value, axes: Sequence[int], keepdims: bool = True) -> Value:
        return self.op(op, x, axes=tuple(sorted(set(int(a) for a in axes))), keepdims=keepdims)


def cotangent(g: Grad, node: Node, cts: list[Value | None], i: int = 0) -> Value:
    """The cotangent of ``node``'s output ``i``, zeros where none reached it."""
    c = cts[i]
    return c if c is not None else g.expand(g.scalar(0.0, node.outputs[i]), node.outputs[i].shape)


def _differentiable(v: Value) -> bool:
    return v.dtype.is_float


def backward(b: GraphBuilder, loss: Value, wrt: Sequence[Value]) -> dict[Value, Value | None]:
    """Append the backward pass of ``loss`` (a one-element float value) to ``b``; returns the
    gradient of every value in ``wrt`` (None where the loss does not depend on it)."""
    from fusec.vjp_rules import VJP

    if not loss.dtype.is_float or loss.numel != 1:
        raise ModelError(f"the loss {loss.name!r} must be one floating-point value, got {loss.type_str}")
    nodes = list(b.nodes)
    producer = {o: n for n in nodes for o in n.outputs}
    if loss not in producer and loss not in wrt:
        raise ModelError(f"the loss {loss.name!r} is not computed by the graph")
    # values that depend on some w (forward), and nodes on a path from them to the loss (backward)
    targets = {w for w in wrt if _differentiable(w)}
    depends = set(targets)
    for n in nodes:
        if any(v in depends for v in n.inputs):
            depends.update(o for o in n.outputs if _differentiable(o))
    if loss not in depends:
        return {w: None for w in wrt}
    g = Grad(b)
    ct: dict[Value, Value] = {loss: g.expand(g.scalar(1.0, loss), loss.shape)}  # d loss / d loss
    pieces: dict[Value, list[tuple[int, int, int, Value]]] = {}  # v -> slices' cotangents (axis, start, stop, ct)

    def accumulate(v: Value, gv: Value) -> None:
        prev = ct.get(v)
        ct[v] = gv if prev is None else g.add(prev, gv)

    for node in reversed(nodes):
        for o in node.outputs:  # every reader of o has been differentiated: its slices' pieces are all in
            if o in pieces:
                accumulate(o, _join_slices(g, o, pieces.pop(o)))
        outs = [ct.get(o) for o in node.outputs]
        if all(c is None for c in outs):
            continue
        need = [v in depends for v in node.inputs]
        if not any(need):
            continue
        piece = _slice_piece(node)
        if piece is not None and outs[0] is not None:
            pieces.setdefault(node.inputs[0], []).append((*piece, outs[0]))
            continue
        rule = VJP.get(node.op)
        if rule is None:
            raise ModelError(f"op {node.op.value} has no gradient rule, and the loss depends on node "
                             f"{node.describe()} through it")
        grads = rule(g, node, outs, need)
        for v, gv, nd in zip(node.inputs, grads, need):
            if gv is None or not nd:
                continue
            if gv.shape != v.shape or gv.dtype != v.dtype:  # a rule bug, not user input
                raise AssertionError(f"gradient rule of {node.op.value} gave {gv.type_str} for {v.name!r} ({v.type_str})")
            accumulate(v, gv)
    for v, parts in pieces.items():  # slices of graph inputs, constants, parameters
        accumulate(v, _join_slices(g, v, parts))
    return {w: ct.get(w) for w in wrt}


def _slice_piece(node: Node) -> tuple[int, int, int] | None:
    """(axis, start, stop) of a SLICE that cuts one axis with step 1, else None."""
    if node.op != Op.SLICE:
        return None
    x, a = node.inputs[0], node.attrs
    cut = [(ax, s, e) for ax, s, e, st in zip(a.axes, a.starts, a.ends, a.steps)
           if not (s == 0 and e >= x.shape[ax] and st == 1)]
    if len(cut) != 1 or a.steps[a.axes.index(cut[0][0])] != 1:
        return None
    ax, s, e = cut[0]
    s, e = min(max(s, 0), x.shape[ax]), min(max(e, 0), x.shape[ax])
    return (ax, s, e) if e > s else None


def _join_slices(g: Grad, v: Value, parts: list[tuple[int, int, int, Value]]) -> Value:
    """The cotangent of ``v`` from those of slices of it: one CONCAT where the slices tile one axis
    (a fused projection split into q, k and v), else each slice's cotangent padded back and summed."""
    parts = sorted(parts, key=lambda p: (p[0], p[1]))
    axis = parts[0][0]
    tiles = all(p[0] == axis for p in parts) and parts[0][1] == 0 and parts[-1][2] == v.shape[axis] \
        and all(a[2] == b[1] for a, b in zip(parts, parts[1:]))
    if tiles:
        return parts[0][3] if len(parts) == 1 else g.op(Op.CONCAT, *[p[3] for p in parts], axis=axis)
    total: Value | None = None
    for ax, start, stop, c in parts:
        pads = [0] * (2 * len(v.shape))
        pads[ax], pads[len(v.shape) + ax] = start, v.shape[ax] - stop
        padded = g.op(Op.PAD, c, pads=tuple(pads))
        total = padded if total is None else g.add(total, padded)
    assert total is not None
    return total


def grad_graph(graph: Graph, loss: str, wrt: Sequence[str]) -> tuple[Graph, dict[str, str]]:
    """``graph`` plus the backward pass of its output ``loss`` with respect to the inputs or
    constants named in ``wrt``; the gradients become outputs named ``grad.<name>``. Returns the
    graph and {name: gradient output name}. ModelError if the loss depends on none of ``wrt``."""
    b = GraphBuilder.extend(graph)
    by_name = {v.name: v for v in graph.values()}
    missing = [n for n in [loss, *wrt] if n not in by_name]
    if missing:
        raise ModelError(f"no value named {', '.join(map(repr, missing))} in graph {graph.name!r}")
    grads = backward(b, by_name[loss], [by_name[n] for n in wrt])
    names = {}
    taken = set(graph.outputs) | set(graph.inputs)
    for n in wrt:
        gv = grads[by_name[n]]
        if gv is None:
            raise ModelError(f"the loss {loss!r} does not depend on {n!r}")
        if gv in taken or gv.is_const:
            gv = b.emit(Op.MUL, gv, b.scalar(1.0, gv.dtype))  # an output of its own name
        name, k = f"grad.{n}", 1
        while b.has_name(name):
            name, k = f"grad.{n}_{k}", k + 1
        names[n] = b.output(gv, name=name).name
        taken.add(gv)
    out = b.build()
    out.meta.update({k: v for k, v in graph.meta.items() if k != "states"})
    return out, names

