"""Constant folding: a node whose inputs are all constants becomes a constant, computed by the
numpy reference (``fusec.reference.eval_node``), so folding means exactly what running means.

Not every such node should fold. ``FoldPolicy`` (module default ``POLICY``) says which decline
(a zero-copy view of a weight, ``fusec.passes.views.view_of``, always folds: it costs nothing):

- *layout ops on weights* (``LAYOUT_OPS``: TRANSPOSE, MATMUL) with any input of more than
  ``policy.max_layout_elements`` elements are left for the transpose-caching / GEMM passes, which
  rewrite weight layouts deliberately and record what they did (``transposes_cached``); folding
  them here would hide that work and, for MATMUL of two weights, can grow the weights;
- *growth*: a node whose result is larger than ``policy.max_growth_elements`` elements and larger
  than all of its inputs together (EXPAND / TILE / broadcasting of a small constant) stays a node,
  because a kernel recomputes it for free while a folded copy costs weight memory and upload time;
- *stored weights*: a CAST to fp32 of a constant held in the storage dtype of this compile
  (a weight stored narrow while the model was built, ``fusec.models.weights.StoredWeights``)
  stays: the precision pass drops it, and folding it would make the fp32 copy of the weight that
  storing it narrow avoids. What only constants compute from it still folds (a position table's
  rows gathered at constant positions), reading the weight through the cast.

Each decline is recorded with ``options.decline("constant_fold", where, reason)``. Folded outputs
keep their value names (so a folded graph output keeps its interface name); constants left
unused afterwards are dropped (DCE).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fusec import reference
from fusec.ir import Graph, Node, Value
from fusec.ops import Op
from fusec.passes import dce, views
from fusec.passes.base import PassOptions, PassResult

NAME = "constant_fold"

LAYOUT_OPS: frozenset[Op] = frozenset({Op.TRANSPOSE, Op.MATMUL})


@dataclasses.dataclass(frozen=True)
class FoldPolicy:
    max_layout_elements: int = 4096
    max_growth_elements: int = 1 << 16


POLICY = FoldPolicy()


def fold_decline_reason(node: Node, policy: FoldPolicy = POLICY) -> str | None:
    """Why an all-constant ``node`` must not be folded, or None if it may be."""
    if views.view_of(node) is not None:
        return None  # a zero-copy view of a weight: folding is free and keeps views out of the weights alias path
    biggest = max((v.numel for v in node.inputs), default=0)
    if node.op in LAYOUT_OPS and biggest > policy.max_layout_elements:
        return (f"{node.op.value} of a {biggest}-element weight is left to the layout passes "
                f"(limit {policy.max_layout_elements})")
    out = sum(v.numel for v in node.outputs)
    if out > policy.max_growth_elements and out > sum(v.numel for v in node.inputs):
        return f"folding would add a {out}-element constant grown from {sum(v.numel for v in node.inputs)} elements"
    return None


def _stored_weight(node: Node, ins: list[Value], options: PassOptions) -> bool:
    """A CAST to fp32 of a large weight stored in this compile's storage dtype (module docstring)."""
    from fusec.dtypes import DType

    return node.op == Op.CAST and node.attrs.to == DType.F32 and ins[0].dtype.value == options.storage_dtype


def fold(graph: Graph, options: PassOptions, policy: FoldPolicy = POLICY) -> tuple[Graph, int]:
    """Fold every foldable node (in one forward sweep, so chains fold through); returns (graph, count)."""
    consts: list[Value] = list(graph.constants)
    const_set = set(consts)
    mapping: dict[Value, Value] = {}
    kept: list[Node] = []
    folded = 0
    stored: dict[Value, Value] = {}  # the fp32 value of a kept stored-weight CAST -> the stored weight
    names = {v.name for v in consts} | {v.name for n in graph.nodes for v in n.outputs}
    with np.errstate(all="ignore"):  # folding mirrors run(): IEEE results, not warnings
        for node in graph.nodes:
            ins = [mapping.get(v, v) for v in node.inputs]
            if not all(v in const_set or v in stored for v in ins):
                kept.append(node)
                continue
            if _stored_weight(node, ins, options):  # by design, not a declined opportunity: no record
                stored[node.outputs[0]] = ins[0]
                kept.append(node)
                continue
            reason = fold_decline_reason(node, policy)
            if reason is not None:
                options.decline(NAME, node.describe(), reason)
                kept.append(node)
                continue
            results = reference.eval_node(node, [v.data if v in const_set else stored[v].data.astype(np.float32)
                                                 for v in ins])
            for old, arr in zip(node.outputs, results):
                name = _folded_name(node, ins, old, graph)
                name = old.name if name in names else name
                names.add(name)
                new = Value(name, old.shape, old.dtype, np.ascontiguousarray(arr))
                mapping[old] = new
                consts.append(new)
                const_set.add(new)
            folded += 1
    g = Graph(graph.inputs, graph.outputs, kept, consts, graph.name, graph.meta)
    g = dce.replace_uses(g, mapping)
    return dce.eliminate(g), folded


def _folded_name(node: Node, ins: list[Value], old: Value, graph: Graph) -> str:
    """The folded constant's name: its value's, except where one layer's weight alone makes an unnamed value (a
    builder's transpose of ``layers.0.self_attn.o_proj.weight``): then the weight's name and the op, so the
    constant still says which layer it belongs to (``explain``'s layers, decline messages)."""
    from fusec.passes.match import layer_of_name

    src = [v for v in ins if v.numel > 1]
    if len(src) != 1 or old in graph.outputs or layer_of_name(old.name) or not layer_of_name(src[0].name):
        return old.name
    return f"{src[0].name}.{node.op.value}"


def run(graph: Graph, options: PassOptions) -> PassResult:
    g, n = fold(graph, options)
    if n:
        options.bump("constants_folded", n)
    changed = n > 0 or len(g.constants) != len(graph.constants)
    return PassResult(g, changed)
