"""Algebraic simplification: remove no-ops and collapse chains of layout ops.

Identities (the result has the same shape and dtype as ``x``, and reads it element for element):

- ``x*1``, ``1*x``, ``x+0``, ``0+x``, ``x-0``, ``x/1`` where the constant is all ones / all zeros
  and does not broadcast ``x`` to a larger shape. (``x+0.0`` differs from ``x`` only in the sign
  of a zero, as in every fast-math compiler; ``x-0`` and ``x*1``, ``x/1`` are exact.)
- CAST to ``x``'s dtype; RESHAPE/EXPAND to ``x``'s shape; TRANSPOSE with the identity perm;
  SLICE that takes every axis whole with step 1; TILE with all repeats 1.

Chains (a new node replaces the outer one; the inner one dies unless used elsewhere, DCE):

- ``reshape(reshape(x, s1), s2)`` -> ``reshape(x, s2)``;
- ``transpose(transpose(x, p1), p2)`` -> ``transpose(x, q)`` with ``q[k] = p1[p2[k]]``.

An identity whose result is a named graph output cannot simply vanish (the name is part of the
interface): if ``x`` is produced by a node and is not itself a graph output, ``x`` is renamed to
the output (its producer writes the output's value, every reader of ``x`` reads it); otherwise
(``x`` is a graph input, a constant or another output) the node stays and the decline is logged.
Rewrites repeat to a fixpoint.
"""

from __future__ import annotations

import numpy as np

from fusec.ir import Graph, Node, Value
from fusec.ops import Op, PermAttrs, ShapeAttrs
from fusec.passes import dce
from fusec.passes.base import PassOptions, PassResult

NAME = "simplify"

_MAX_ROUNDS = 16


def _all_equal(v: Value, x: float) -> bool:
    return v.data is not None and v.data.size > 0 and bool(np.all(v.data == x))


def identity_input(node: Node) -> Value | None:
    """The input ``node`` passes through unchanged, or None if ``node`` is not a no-op."""
    if len(node.outputs) != 1:
        return None
    out, ins, a = node.outputs[0], node.inputs, node.attrs
    cand: Value | None = None
    if node.op in (Op.MUL, Op.ADD):
        unit = 1 if node.op == Op.MUL else 0
        if _all_equal(ins[1], unit):
            cand = ins[0]
        elif _all_equal(ins[0], unit):
            cand = ins[1]
    elif node.op in (Op.SUB, Op.DIV):
        if _all_equal(ins[1], 0 if node.op == Op.SUB else 1):
            cand = ins[0]
    elif node.op == Op.CAST:
        cand = ins[0] if a.to == ins[0].dtype else None
    elif node.op in (Op.RESHAPE, Op.EXPAND):
        cand = ins[0]
    elif node.op == Op.TRANSPOSE:
        cand = ins[0] if tuple(a.perm) == tuple(range(len(a.perm))) else None
    elif node.op == Op.SLICE:
        cand = ins[0] if all(st == 1 for st in a.steps) else None
    elif node.op == Op.TILE:
        cand = ins[0] if all(r == 1 for r in a.repeats) else None
    if cand is None or cand.shape != out.shape or cand.dtype != out.dtype:
        return None
    return cand


def _collapse(node: Node, producers: dict[Value, Node]) -> Node | None:
    """A single node equivalent to ``node`` applied to its input's producer, or None."""
    src = node.inputs[0] if node.inputs else None
    inner = producers.get(src) if src is not None else None
    if inner is None or inner.op != node.op or node.op not in (Op.RESHAPE, Op.TRANSPOSE):
        return None
    if node.op == Op.RESHAPE:
        return Node(Op.RESHAPE, inner.inputs, node.outputs, ShapeAttrs(node.attrs.shape), node.name)
    p1, p2 = inner.attrs.perm, node.attrs.perm
    return Node(Op.TRANSPOSE, inner.inputs, node.outputs, PermAttrs(tuple(p1[k] for k in p2)), node.name)


def _sweep(graph: Graph, options: PassOptions) -> tuple[Graph, int]:
    outputs = set(graph.outputs)
    mapping: dict[Value, Value] = {}
    nodes: list[Node] = []
    producers: dict[Value, Node] = {}  # over the new node list
    index: dict[Node, int] = {}
    rewrites = 0

    def res(v: Value) -> Value:
        while v in mapping:
            v = mapping[v]
        return v

    def emit(n: Node) -> None:
        index[n] = len(nodes)
        nodes.append(n)
        for o in n.outputs:
            producers[o] = n

    for node in graph.nodes:
        ins = tuple(res(v) for v in node.inputs)
        if ins != node.inputs:
            node = Node(node.op, ins, node.outputs, node.attrs, node.name)
        x = identity_input(node)
        if x is not None:
            out = node.outputs[0]
            if out not in outputs:
                mapping[out] = x
                rewrites += 1
                continue
            prod = producers.get(x)
            if prod is not None and x not in outputs:
                # rename x to out: its producer writes out, and every reader of x reads out
                moved = Node(prod.op, prod.inputs, tuple(out if o is x else o for o in prod.outputs),
                             prod.attrs, prod.name)
                k = index.pop(prod)
                nodes[k], index[moved] = moved, k
                for o in moved.outputs:
                    producers[o] = moved
                del producers[x]
                mapping[x] = out
                rewrites += 1
                continue
            options.decline(NAME, node.describe(), "no-op writes a named graph output from an input, "
                                                   "a constant or another output: nothing to rename")
        merged = _collapse(node, producers)
        if merged is not None:
            node = merged
            rewrites += 1
        emit(node)
    g = Graph(graph.inputs, graph.outputs, nodes, graph.constants, graph.name, graph.meta)
    if mapping:
        g = dce.replace_uses(g, mapping)
    return dce.eliminate(g), rewrites


def simplify(graph: Graph, options: PassOptions) -> tuple[Graph, int]:
    total = 0
    for _ in range(_MAX_ROUNDS):
        graph, n = _sweep(graph, options)
        total += n
        if n == 0:
            break
    return graph, total


def run(graph: Graph, options: PassOptions) -> PassResult:
    g, n = simplify(graph, options)
    if n:
        options.bump("simplified", n)
    return PassResult(g, n > 0 or len(g.nodes) != len(graph.nodes))
