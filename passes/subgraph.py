"""Cutting a set of nodes out of a graph as a self-contained ``Graph``: the one convention shared by
fused bodies (``passes/fusion.py``) and the A/B regions (``fusec/ab/regions.py``).

``extract(members, outputs, name, inline)`` returns a ``Cut``:
- the body has Value objects of its own (same names and types), so the outer graph's values are
  never shared with it and a later pass on either side cannot change the other;
- every value the members read from outside is a body *input* (``Cut.reads`` holds the outer value
  feeding each body input, positionally), except constants ``inline`` keeps inside: those are body
  *constants* holding the same data. A body input never carries data;
- ``outputs`` (outer values the members produce) become the body outputs, in that order;
  ``escaping`` gives the usual choice: what is read outside the members, or is a graph output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence

from fusec.ir import Graph, Node, Value


def label(n: Node) -> str:
    """How fusion records and A/B regions name a node: its own name, else its first output's."""
    return n.name or n.outputs[0].name


@dataclasses.dataclass
class Cut:
    body: Graph
    reads: list[Value]  # outer value feeding each body input, positionally


def escaping(members: Sequence[Node], users: Callable[[Value], Sequence[Node]],
             graph_outputs: Collection[Value]) -> list[Value]:
    """The values ``members`` (in graph order) produce that are graph outputs or read elsewhere."""
    inside = set(members)
    return [v for n in members for v in n.outputs
            if v in graph_outputs or any(u not in inside for u in users(v))]


def scalar_constant(v: Value) -> bool:
    """Fused bodies keep scalar literals inside (the kernel reads them as immediates); weights stay
    node inputs, so the outer graph still sees every tensor the plan must upload."""
    return v.is_const and v.numel == 1


def extract(members: Sequence[Node], outputs: Sequence[Value], name: str,
            inline: Callable[[Value], bool] = scalar_constant) -> Cut:
    """``members`` (in graph order) as a body graph computing ``outputs`` (see the module doc)."""
    fresh: dict[Value, Value] = {}
    inputs: list[Value] = []
    consts: list[Value] = []
    reads: list[Value] = []
    produced = {v for n in members for v in n.outputs}
    for n in members:
        for v in n.inputs:
            if v in produced or v in fresh:
                continue
            if v.is_const and inline(v):
                fresh[v] = Value(v.name, v.shape, v.dtype, v.data)
                consts.append(fresh[v])
            else:
                fresh[v] = Value(v.name, v.shape, v.dtype)
                inputs.append(fresh[v])
                reads.append(v)
    for v in produced:
        fresh[v] = Value(v.name, v.shape, v.dtype)
    nodes = [Node(n.op, [fresh[v] for v in n.inputs], [fresh[v] for v in n.outputs], n.attrs, n.name)
             for n in members]
    # which inputs the outer graph feeds a constant (a weight): a body input never carries data, but
    # the codegen's capability query must know (fusec.lower.skinny reads only constant weights)
    meta = {"const_inputs": [i for i, v in enumerate(reads) if v.is_const]}
    return Cut(Graph(inputs, [fresh[v] for v in outputs], nodes, consts, name=name, meta=meta), reads)
