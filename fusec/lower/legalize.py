"""Make every fused group one kernel: split what no template covers, then re-form the largest
sub-groups of the split members that do lower.

Fusion (passes/fusion.py) decides what may and should be fused from the IR alone; only the
codegen knows which groups it can emit as one kernel (``fusec.lower.fused.can_lower``). A group
it cannot is split into its members, before memory planning, so that every intermediate gets a
place in the arena; then, among those members only (a fusion the user turned off stays off):
attention with the layout views around it, RoPE with the views feeding it, and add -> norm are
grouped again when the result lowers. Each split is recorded in ``graph.meta["fused_split"]``
(rule, members, reason, what was re-formed): a fusion that did not become one kernel is
reported, never silent.
"""

from __future__ import annotations

from fusec.ir import Graph, Node, Value
from fusec.lower.fused import can_lower
from fusec.ops import FusedAttrs, Op

_VIEWS = (Op.SLICE, Op.RESHAPE, Op.TRANSPOSE, Op.EXPAND)


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
    split_members: set[int] = set()
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
            new = Node(bn.op, [m[v] for v in bn.inputs], outs, bn.attrs, bn.name)
            split_members.add(id(new))
            nodes.append(new)
        split.append({"rule": n.attrs.rule, "members": [bn.op.value for bn in body.nodes],
                      "reason": "no single-kernel template covers this group; split and re-grouped"})
    g = Graph(graph.inputs, graph.outputs, nodes, consts, graph.name, dict(graph.meta))
    if split_members:
        g, formed = _regroup(g, split_members)
        g.meta["fused_split"] = split
        g.meta["fused_reformed"] = formed
    return g


def _regroup(graph: Graph, candidates: set[int]) -> tuple[Graph, list[str]]:
    producers = graph.producers()
    users = graph.users()
    outputs = set(graph.outputs)

    def only_feeds(v: Value, core: set[int]) -> bool:
        return v not in outputs and all(id(u) in core for u in users.get(v, []))

    def view_chain_back(v: Value, core: set[int]) -> None:
        while True:
            p = producers.get(v)
            if p is None or id(p) not in candidates or p.op not in _VIEWS or id(p) in core:
                return
            core.add(id(p))
            if not only_feeds(p.output, core):
                core.discard(id(p))
                return
            v = p.inputs[0]

    groups: list[tuple[str, set[int]]] = []
    taken: set[int] = set()
    for n in graph.nodes:
        if id(n) not in candidates or id(n) in taken:
            continue
        core: set[int] = {id(n)}
        if n.op == Op.ATTENTION:
            for x in n.inputs:
                view_chain_back(x, core)
            v = n.output
            while v not in outputs and len(users.get(v, [])) == 1:
                u = users[v][0]
                if id(u) not in candidates or u.op not in (Op.TRANSPOSE, Op.RESHAPE):
                    break
                core.add(id(u))
                v = u.output
            rule = "attention_layout"
        elif n.op == Op.ROPE:
            view_chain_back(n.inputs[0], core)
            rule = "rope_layout"
        elif n.op in (Op.LAYERNORM, Op.RMSNORM):
            p = producers.get(n.inputs[0])
            if p is None or p.op != Op.ADD or id(p) not in candidates or p.inputs[0].shape != p.inputs[1].shape:
                continue
            core.add(id(p))
            rule = "add_norm"
        else:
            continue
        if len(core) > 1 and not core & taken:
            groups.append((rule, core))
            taken |= core

    nodes = list(graph.nodes)
    formed = []
    for rule, core in groups:
        members = [x for x in nodes if id(x) in core]
        fused = _make_fused(members, users, outputs, rule)
        last = max(nodes.index(x) for x in members)
        first = min(nodes.index(x) for x in members)
        between = [x for x in nodes[first:last] if id(x) not in core]
        produced = {o for x in members for o in x.outputs}
        if any(v in produced for x in between for v in x.inputs) or not can_lower(fused):
            continue
        nodes = [x for x in nodes[: last + 1] if id(x) not in core] + [fused] + nodes[last + 1:]
        formed.append(rule)
    return Graph(graph.inputs, graph.outputs, nodes, graph.constants, graph.name, graph.meta), formed


def _make_fused(members: list[Node], users: dict[Value, list[Node]], outputs: set[Value], rule: str) -> Node:
    ids = {id(x) for x in members}
    produced = [o for x in members for o in x.outputs]
    produced_set = set(produced)
    ins: list[Value] = []
    for x in members:
        for v in x.inputs:
            if v not in produced_set and v not in ins:
                ins.append(v)
    outs = [v for v in produced if v in outputs or any(id(u) not in ids for u in users.get(v, []))]
    if rule == "add_norm":  # the row kernel writes the sum as well: keep it as an output
        outs = [members[0].output, members[1].output] if members[0].op == Op.ADD else outs
    # the body gets its own Value objects (names kept), so the outer graph's stay untouched
    m = {v: Value(v.name, v.shape, v.dtype, v.data) for v in ins}
    body_nodes = []
    for x in members:
        o = [Value(v.name, v.shape, v.dtype) for v in x.outputs]
        m.update(zip(x.outputs, o))
        body_nodes.append(Node(x.op, [m[v] for v in x.inputs], o, x.attrs, x.name))
    body = Graph([m[v] for v in ins], [m[v] for v in outs], body_nodes, [], f"legalized_{rule}")
    return Node(Op.FUSED, ins, outs, FusedAttrs(kind="legalized", rule=rule, body=body))
