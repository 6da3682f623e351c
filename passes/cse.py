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


_SAMPLE = 1 << 16  # bytes: constants up to this size are hashed whole


def _const_key(c: Value) -> tuple[Any, ...]:
    """(dtype, shape, digest of a sample of the bytes): equal constants get equal keys; constants
    whose keys collide are compared byte for byte. The sample (the first and last 32 KiB and
    ~64 KiB spread evenly over the rest) keeps a model's weights from being hashed whole: two
    random weight matrices differ in their first bytes."""
    assert c.data is not None
    raw = np.ascontiguousarray(c.data).reshape(-1).view(np.uint8)
    h = hashlib.blake2b(digest_size=16)
    if raw.nbytes <= 2 * _SAMPLE:
        h.update(raw.data)
    else:
        half = _SAMPLE // 2
        h.update(raw[:half].data)
        h.update(raw[-half:].data)
        h.update(np.ascontiguousarray(raw[:: raw.nbytes // _SAMPLE]).data)
    return (c.dtype, c.shape, h.digest())


def _same_bytes(a: Value, b: Value) -> bool:
    assert a.data is not None and b.data is not None
    raw_a, raw_b = (np.ascontiguousarray(v.data).reshape(-1).view(np.uint8) for v in (a, b))
    chunk = 16 << 20  # compared a chunk at a time: memcmp speed, stops at the first difference
    return raw_a.nbytes == raw_b.nbytes and all(raw_a[i:i + chunk].tobytes() == raw_b[i:i + chunk].tobytes()
                                                for i in range(0, raw_a.nbytes, chunk))


def dedupe_constants(graph: Graph) -> tuple[Graph, int]:
    outputs = set(graph.outputs)
    seen: dict[tuple[Any, ...], list[Value]] = {}  # key -> the distinct constants with that key
    mapping: dict[Value, Value] = {}
    consts = []
    for c in graph.constants:
        group = seen.setdefault(_const_key(c), [])
        first = next((f for f in group if _same_bytes(f, c)), None)
        if first is not None and c not in outputs:
            mapping[c] = first
            continue
        if first is None:
            group.append(c)
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
