"""Common-subexpression elimination.

- Constants with the same dtype, shape and bytes (bitwise: -0.0 and 0.0 differ, equal NaNs match)
  become one constant.
- Nodes with the same op, attrs and inputs become one node. For commutative binary ops
  (``COMMUTATIVE``) the input order does not matter: IEEE ``a+b`` and ``b+a`` are bitwise equal.
  Ops whose attrs are not hashable (e.g. a fused node carrying a subgraph) are left alone.

Graph-output names are part of the interface, so a duplicate that is a graph output is never
replaced by a differently named value. When the *later* duplicate is a graph output and the
earlier is not, the earlier node is re-emitted (in its own position) writing the output's value,
and the earlier value's uses read that value instead.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from fusec.ir import Graph, Node, Value
from fusec.ops import Op
from fusec.passes import dce
from fusec.passes.base import PassOptions, PassResult

NAME = "cse"

COMMUTATIVE: frozenset[Op] = frozenset({Op.ADD, Op.MUL, Op.MAX, Op.MIN, Op.EQUAL, Op.AND, Op.OR})


def _const_key(c: Value) -> tuple[Any, ...]:
    assert c.data is not None
    raw = np.ascontiguousarray(c.data).view(np.uint8)
    return (c.dtype, c.shape, hashlib.blake2b(raw.data, digest_size=16).digest())


def _same_bytes(a: Value, b: Value) -> bool:
    assert a.data is not None and b.data is not None
    raw_a, raw_b = (np.ascontiguousarray(v.data).view(np.uint8) for v in (a, b))
    return bool(np.array_equal(raw_a, raw_b))


def dedupe_constants(graph: Graph) -> tuple[Graph, int]:
    outputs = set(graph.outputs)
    seen: dict[tuple[Any, ...], Value] = {}
    mapping: dict[Value, Value] = {}
    consts = []
    for c in graph.constants:
        key = _const_key(c)
        first = seen.get(key)
        if first is not None and c not in outputs and _same_bytes(first, c):
            mapping[c] = first
            continue
        seen.setdefault(key, c)
        consts.append(c)
    g = Graph(graph.inputs, graph.outputs, graph.nodes, consts, graph.name, graph.meta)
    return (dce.replace_uses(g, mapping), len(mapping)) if mapping else (g, 0)


def _node_key(node: Node, ins: tuple[Value, ...]) -> tuple[Any, ...] | None:
    ids = tuple(id(v) for v in ins)
    if node.op in COMMUTATIVE:
        ids = tuple(sorted(ids))
    key = (node.op, node.attrs, ids, len(node.outputs))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def dedupe_nodes(graph: Graph) -> tuple[Graph, int]:
    outputs = set(graph.outputs)
    mapping: dict[Value, Value] = {}
    seen: dict[tuple[Any, ...], int] = {}  # key -> index in `nodes`
    nodes: list[Node] = []
    merged = 0

    def res(v: Value) -> Value:
        while v in mapping:
            v = mapping[v]
        return v

    for node in graph.nodes:
        ins = tuple(res(v) for v in node.inputs)
        key = _node_key(node, ins)
        j = seen.get(key) if key is not None else None
        if j is None:
            if key is not None:
                seen[key] = len(nodes)
            nodes.append(node)
            continue
        first = nodes[j]
        if not any(o in outputs for o in node.outputs):
            mapping.update(zip(node.outputs, first.outputs))
        elif not any(o in outputs for o in first.outputs):
            # keep the output-visible names: the first node now writes this node's values
            nodes[j] = Node(first.op, first.inputs, node.outputs, first.attrs, first.name)
            mapping.update(zip(first.outputs, node.outputs))
        else:
            nodes.append(node)  # both are named graph outputs: keep both
            continue
        merged += 1
    g = Graph(graph.inputs, graph.outputs, nodes, graph.constants, graph.name, graph.meta)
    return (dce.replace_uses(g, mapping), merged) if mapping else (g, 0)


def run(graph: Graph, options: PassOptions) -> PassResult:
    g, nc = dedupe_constants(graph)
    g, nn = dedupe_nodes(g)
    if nc:
        options.bump("cse_constants_merged", nc)
    if nn:
        options.bump("cse_nodes_merged", nn)
    return PassResult(g, bool(nc or nn))
