"""Give each constant GEMM weight the layout its chosen kernel reads, in the IR.

Kernel choices (``fusec.lower.choices``) are picked per choice key, by an A/B ledger or by hand
(``fusec.compile(choices=...)`` -> ``PassOptions.choices``). Some variants read the weight in the
other layout than the one the earlier passes picked: fusec's GEMM reads B [K, N], the GEMV reads
[N, K] (``MATMUL[trans_b=True]``), and ``cached_transpose`` / ``transpose_flag`` are the layouts
themselves. This pass writes that layout as a constant of the graph (a transposed copy, shared by
every product that needs it) and flips the product's ``trans_b``, so the lowering never copies a
weight and the copy is in the pass dumps and the weight bytes. The weight it replaces dies unless
something else reads it (a tied embedding's GATHER): those bytes are counted in
``stats["weight_layout_extra_bytes"]``. Without choices, the rule-based defaults of
``fusec.lower.choices.choose`` apply (a single-row product reads its weight [N, K] for the GEMV).

It runs after fusion because a choice key names the fused epilogue.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fusec.ir import Graph, Node, Value
from fusec.ops import FusedAttrs, Op
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter

NAME = "weight_layout"
REQUIRES = ("fusion",)


def _relayout(node: Node, w_new: Value, trans_b: bool) -> Node:
    """``node`` (a MATMUL, or a fused group whose first member is the MATMUL) reading ``w_new``."""
    if node.op == Op.MATMUL:
        return Node(Op.MATMUL, [node.inputs[0], w_new], node.outputs, dataclasses.replace(node.attrs, trans_b=trans_b), node.name)
    body: Graph = node.attrs.body
    mm = body.nodes[0]
    bw = mm.inputs[1]
    if bw in body.inputs:  # the weight enters as an operand: a new body input of the new shape
        nb = Value(f"{bw.name}.{'nk' if trans_b else 'kn'}", w_new.shape, w_new.dtype)
        inputs = [nb if v is bw else v for v in body.inputs]
        outer = [w_new if v is bw else o for v, o in zip(body.inputs, node.inputs)]
        consts = list(body.constants)
    else:  # a body constant
        nb = w_new
        inputs, outer = list(body.inputs), list(node.inputs)
        consts = [w_new if c is bw else c for c in body.constants]
    new_mm = Node(Op.MATMUL, [mm.inputs[0], nb], mm.outputs, dataclasses.replace(mm.attrs, trans_b=trans_b), mm.name)  # keeps precision
    new_body = Graph(inputs, body.outputs, [new_mm, *body.nodes[1:]], consts, body.name, dict(body.meta))
    attrs = FusedAttrs(node.attrs.kind, node.attrs.rule, new_body)
    return Node(Op.FUSED, outer, node.outputs, attrs, node.name)


def run(graph: Graph, options: PassOptions) -> PassResult:
    from fusec.lower.choices import NEEDS_TRANS_B, choice_point, choose

    choices = getattr(options, "choices", None) or {}
    ctx = Ctx(graph)
    rw = Rewriter(graph)
    made: dict[int, Value] = {}
    readers_left: dict[Value, int] = {}
    records: list[dict[str, object]] = []
    for node in graph.nodes:
        cp = choice_point(node)
        if cp is None or not cp.b_const:
            continue
        variant = choose(choices, cp)
        need = NEEDS_TRANS_B.get(variant)
        if need is None or need == cp.trans_b:
            continue
        w = node.inputs[node.attrs.body.inputs.index(cp.b)] if node.op == Op.FUSED and cp.b in node.attrs.body.inputs \
            else cp.b
        assert w.data is not None
        new = made.get(id(w))
        if new is None:
            new = made[id(w)] = rw.const(np.ascontiguousarray(np.asarray(w.data).T), f"{w.name}.{'nk' if need else 'kn'}")
            readers_left[w] = len(ctx.users(w)) + (1 if ctx.is_output(w) else 0)
        readers_left[w] -= 1
        rw.replace(node, [_relayout(node, new, need)], [node])
        records.append({"key": cp.key, "variant": variant, "where": ctx.where(node), "weight": w.name,
                        "stored": new.name, "shape": list(new.shape)})
    extra = sum(w.nbytes for w, left in readers_left.items() if left > 0)
    g = rw.finish() if rw.changed else graph.copy()
    g.meta["weights_relaid"] = records
    options.bump("weights_relaid", len(records))
    if extra:
        options.bump("weight_layout_extra_bytes", extra)
    return PassResult(g, bool(records))
