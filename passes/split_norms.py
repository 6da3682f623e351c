"""An RMSNorm read by several packed decode products: one copy of it per product.

The norm_gemm fusion makes an RMSNorm the prologue of the one skinny product that reads it. A Q4_K_M
file's attention reads its normed hidden state through two packed products that cannot merge (q/k in
Q4_K, v in Q6_K: ``merge_gemms`` merges one format only), so that norm would run as a kernel of its
own. Here each of those products gets its own copy of the norm, and fusion then puts each copy into
its product (the dp4a and FMA forms of the quantized GEMV normalize x in the block anyway, so a copy
costs no launch and no extra pass over memory).

Only where every reader is a packed product that would take the norm as its prologue
(``fusec.lower.skinny.qfits``) and norm_gemm is not disabled; the copies compute what the norm did, so
the graph's results are unchanged.
"""

from __future__ import annotations

import math

from fusec.ir import Graph, Node
from fusec.ops import Op
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter

NAME = "split_norms"
REQUIRES = ("merge_gemms",)


def _takes_norm(node: Node, x: object) -> bool:
    from fusec.lower.skinny import qfits

    if node.op != Op.QMATMUL or node.inputs[0] is not x or x in node.inputs[1:]:
        return False
    a = node.attrs
    m = math.prod(node.inputs[0].shape[:-1])
    const = all(v.data is not None for v in node.inputs[1:])
    return qfits(m, a.n, a.k, node.inputs[0], node, True, False, const) is None


def run(graph: Graph, options: PassOptions) -> PassResult:
    if "norm_gemm" in options.disabled_fusions:
        return PassResult(graph.copy(), False)
    ctx = Ctx(graph)
    rw = Rewriter(graph)
    split = 0
    for node in graph.nodes:
        if node.op != Op.RMSNORM:
            continue
        y = node.outputs[0]
        readers = ctx.users(y)
        if len(readers) < 2 or ctx.is_output(y) or not all(_takes_norm(r, y) for r in readers):
            continue
        for i, r in enumerate(readers[1:], 1):
            copy = rw.node(Op.RMSNORM, node.inputs, node.attrs, base=f"{y.name}.copy{i}",
                           name=f"{node.name or y.name}.copy{i}")
            mm = Node(r.op, [copy.outputs[0], *r.inputs[1:]], r.outputs, r.attrs, r.name)
            rw.replace(r, [copy, mm], [r])
        split += 1
        options.bump("norms_split", len(readers) - 1)
    g = rw.finish() if rw.changed else graph.copy()
    return PassResult(g, split > 0)
