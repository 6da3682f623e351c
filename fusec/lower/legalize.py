"""Split fused groups that no template covers back into their members, before memory planning.

Fusion (passes/fusion.py) decides what may and should be fused from the IR alone; only the
codegen knows which groups it can emit as one kernel. This step asks it (``can_lower``) and
expands the rest inline, so every intermediate gets a place in the memory plan. Each split is
recorded in ``graph.meta["fused_split"]`` (rule, members, reason): a fusion that did not become
one kernel is reported, never silent.
"""

from __future__ import annotations

from fusec.ir import Graph, Node, Value
from fusec.lower.fused import can_lower
from fusec.ops import Op


def legalize(graph: Graph) -> Graph:
    names = {v.name for v in graph.values()}

    def unique(base: str) -> str:
        name, k = base, 1
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.add(name)
        return name

    nodes: list[Node] = []
    consts = list(graph.constants)
    known_consts = set(consts)
    split = list(graph.meta.get("fused_split", []))
    for n in graph.nodes:
        if n.op != Op.FUSED or can_lower(n):
            nodes.append(n)
            continue
        body = n.attrs.body
        m: dict[Value, Value] = dict(zip(body.inputs, n.inputs))
        for c in body.constants:
            m[c] = c
            if c not in known_consts:
                consts.append(c)
                known_consts.add(c)
        out_map = dict(zip(body.outputs, n.outputs))
        for bn in body.nodes:
            outs = [out_map.get(o) or Value(unique(o.name), o.shape, o.dtype) for o in bn.outputs]
            m.update(zip(bn.outputs, outs))
            nodes.append(Node(bn.op, [m[v] for v in bn.inputs], outs, bn.attrs, bn.name))
        split.append({"rule": n.attrs.rule, "members": [bn.op.value for bn in body.nodes],
                      "reason": "no single-kernel template covers this group; its members run as separate kernels"})
    meta = dict(graph.meta)
    if split:
        meta["fused_split"] = split
    return Graph(graph.inputs, graph.outputs, nodes, consts, graph.name, meta)
