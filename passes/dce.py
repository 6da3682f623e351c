"""Dead-code elimination, plus the value-rewiring helper the canonicalization passes share.

``run`` keeps a node iff one of its outputs is (transitively) needed by a graph output, and keeps
a constant iff a kept node or a graph output uses it. Graph inputs are the interface and are never
dropped, even when unused.
"""

from __future__ import annotations

from collections.abc import Mapping

from fusec.ir import Graph, Node, Value
from fusec.passes.base import PassOptions, PassResult

NAME = "dce"


def eliminate(graph: Graph) -> Graph:
    """A new Graph without dead nodes and unused constants (same Value/Node objects otherwise)."""
    needed: set[Value] = set(graph.outputs)
    kept: list[Node] = []
    for node in reversed(graph.nodes):
        if any(o in needed for o in node.outputs):
            kept.append(node)
            needed.update(node.inputs)
    kept.reverse()
    consts = [c for c in graph.constants if c in needed]
    return Graph(graph.inputs, graph.outputs, kept, consts, graph.name, graph.meta)


def replace_uses(graph: Graph, mapping: Mapping[Value, Value], nodes: list[Node] | None = None) -> Graph:
    """A new Graph in which every use of a key of ``mapping`` reads its value instead.

    Chains (a -> b -> c) are followed. Nodes whose inputs change are rebuilt as new Node objects;
    the old graph is left untouched. Graph outputs are substituted too, so callers must only map
    a graph output to a value of the same name (e.g. a folded constant that reuses the name):
    an output's name is part of the model's interface.
    """

    def res(v: Value) -> Value:
        seen = 0
        while v in mapping:
            v = mapping[v]
            seen += 1
            if seen > len(mapping):
                raise RuntimeError(f"replace_uses: cyclic substitution through {v.name!r}")
        return v

    out_nodes = []
    for n in graph.nodes if nodes is None else nodes:
        new_in = tuple(res(v) for v in n.inputs)
        if any(a is not b for a, b in zip(new_in, n.inputs)):
            n = Node(n.op, new_in, n.outputs, n.attrs, n.name)
        out_nodes.append(n)
    outs = [res(v) for v in graph.outputs]
    for old, new in zip(graph.outputs, outs):
        if old.name != new.name:
            raise RuntimeError(f"replace_uses would rename graph output {old.name!r} to {new.name!r}")
    return Graph(graph.inputs, outs, out_nodes, graph.constants, graph.name, graph.meta)


def run(graph: Graph, options: PassOptions) -> PassResult:
    g = eliminate(graph)
    removed = len(graph.nodes) - len(g.nodes)
    dropped = len(graph.constants) - len(g.constants)
    if removed:
        options.bump("dce_nodes_removed", removed)
    if dropped:
        options.bump("dce_constants_dropped", dropped)
    return PassResult(g, bool(removed or dropped))
