"""One copy of a shared norm per skinny product that reads it, so each takes it as its prologue.

``merge_gemms`` makes the projections of one normalized activation one product. Where they cannot
merge (packed weights in different formats: a Q4_K_M file's q/k in Q4_K, its v in Q6_K), the norm
has several readers and ``norm_gemm`` (a norm read by nothing else becomes the product's prologue)
leaves it a launch of its own. Here each reader after the first gets its own copy of the norm: the
products normalize the rows they read (a few microseconds of K-long rows, against a launch and a
round trip through memory).

A norm is split only where every reader is a product reading it as its first operand and the
codegen's capability query (``fusec.lower.fused_plan.can_fuse``) says each norm + product is one kernel,
and the rules ``norm_copies`` and ``norm_gemm`` are on, and not where one launch takes the norm with all of its
readers (``packed_siblings``: packed products in the dp4a form): where a reader could not take the copy (a prefill's cuBLAS product,
the tensor-core quantized form) the norm stays one launch. The fusion pass then finds each copy read
by one product. ``fusion_rules.projection_source`` follows a product back through the norm to the
activation both copies read, so the q/k RoPEs and the V cache copy of the two products stay siblings
(one launch, and the attention's prologue).
"""

from __future__ import annotations

from fusec.ir import Graph, Node, Value
from fusec.ops import Op
from fusec.passes import fusion_rules as R
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter
from fusec.passes.subgraph import extract

NAME = "split_norms"
REQUIRES = ("merge_gemms",)


def _splittable(ctx: Ctx, graph: Graph, norm: Node) -> list[Node]:
    """The readers of ``norm``'s result when it is to be split among them, else []."""
    from fusec.lower.fused_plan import can_fuse

    out = norm.outputs[0]
    readers = ctx.users(out)
    if len(readers) < 2 or out in graph.outputs or len(set(readers)) != len(readers):
        return []
    for r in readers:
        if R.kind(r) != R.K.GEMM or r.inputs[0] is not out or out in r.inputs[1:]:
            return []
        if not can_fuse(extract([norm, r], [r.outputs[0]], "candidate").body):
            return []
    return readers


def _siblings(ctx: Ctx, norm: Node) -> bool:
    """Whether ``norm``'s readers are packed products that one launch takes with it (``packed_siblings``)."""
    from fusec.lower.fused_plan import can_fuse

    readers = ctx.users(norm.outputs[0])
    if len(readers) < 2 or any(r.op != Op.QMATMUL for r in readers):
        return False
    return can_fuse(extract([norm, *readers], [r.outputs[0] for r in readers], "candidate").body)


def run(graph: Graph, options: PassOptions) -> PassResult:
    def on(rule: str) -> bool:
        return R.decide(rule, options.disabled_fusions, options.enabled_fusions, {}, "")[0] == R.Decision.APPLIED

    if not (on("norm_copies") and on("norm_gemm")):
        return PassResult(graph, False)
    siblings = on("packed_siblings")
    ctx = Ctx(graph)
    rw = Rewriter(graph)  # fresh value names
    replace: dict[Node, list[Node]] = {}
    split = 0
    for n in graph.nodes:
        if not (R.is_norm(n) and len(n.outputs) == 1):
            continue
        if siblings and _siblings(ctx, n):  # the fusion pass makes the norm and its products one launch
            continue
        readers = _splittable(ctx, graph, n)
        y = n.outputs[0]
        for i, r in enumerate(readers[1:], 1):
            copy = Node(n.op, n.inputs, [Value(rw.fresh_name(f"{y.name}_copy{i}"), y.shape, y.dtype)], n.attrs,
                        f"{n.name}_copy{i}" if n.name else "")
            replace[r] = [copy, Node(r.op, (copy.outputs[0], *r.inputs[1:]), r.outputs, r.attrs, r.name)]
        split += bool(readers)
    if not split:
        return PassResult(graph, False)
    g = graph.copy()
    g.nodes = [m for n in graph.nodes for m in replace.get(n, [n])]
    g.meta["norms_split"] = split
    options.bump("norms_split", split)
    return PassResult(g, True)
