"""Store constant weights in the layout their matrix products read, at compile time.

HF's nn.Linear keeps W as [out, in] and exports ``x @ transpose(W)``. Left alone, that TRANSPOSE
would run on every forward over the whole weight (seed 004: the runtime transposed weights per
call). Every TRANSPOSE whose input is a constant and whose readers are all matrix products
(fusion kind GEMM) goes away, in one of two forms:

- *transpose flag*: a 2-D weight that something else also reads (a tied embedding: GATHER reads
  [V, D] rows, the lm_head reads the transpose) stays where it is, and each reader becomes
  ``MATMUL[trans_b=True](x, W)``: cuBLAS reads the [N, K] layout with its transpose flag, so the
  table is stored once (a cached transpose would store it twice: +622 MB on qwen3-0.6b fp32);
  With ``PassOptions.weights_nk`` every 2-D weight is read so (generation plans: the decode
  GEMV reads [N, K] too, and prefill and decode share one copy);
- *cached transpose*: otherwise a new constant already in [in, out] row-major order replaces it;
  the old constant dies with it (no extra bytes).

Both are one decision per weight, visible in the IR; the A/B choice between them (and the
layouts other kernels need) is ``weight_layout``'s (``fusec.lower.choices``: variants
``cached_transpose`` / ``transpose_flag``). Counters: ``transposes_cached``,
``transposes_flagged``; a cached transpose of a weight read elsewhere adds
``transpose_cache_extra_bytes``.
"""

from __future__ import annotations

from fusec.bulk import derived, transposed
from fusec.ir import Graph, Node
from fusec.ops import OP_INFO, FusionKind, MatMulAttrs, Op
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter

NAME = "transpose_cache"


def _flaggable(readers: list[Node], out: object) -> bool:
    """Every reader is a MATMUL reading ``out`` as its B operand only, without trans_b yet."""
    return all(u.op == Op.MATMUL and u.inputs[1] is out and u.inputs[0] is not out
               and not getattr(u.attrs, "trans_b", False) and not getattr(u.attrs, "trans_a", False) for u in readers)


def run(graph: Graph, options: PassOptions) -> PassResult:
    ctx = Ctx(graph)
    rw = Rewriter(graph)
    cached = flagged = extra = 0
    folded: dict[tuple[int, tuple[int, ...]], object] = {}
    for node in graph.nodes:
        if node.op != Op.TRANSPOSE or node.inputs[0].data is None:
            continue
        w, out = node.inputs[0], node.outputs[0]
        readers = ctx.users(out)
        where = ctx.where(node)
        if ctx.is_output(out) or not readers:
            continue
        non_gemm = sorted({u.op.value for u in readers if OP_INFO[u.op].kind != FusionKind.GEMM})
        if non_gemm:
            options.decline("transpose_cache", where, f"transposed weight {w.name!r} is also read by "
                            f"{', '.join(non_gemm)} (not a matrix product)")
            continue
        shared = any(u is not node for u in ctx.users(w)) or ctx.is_output(w)
        if (shared or options.weights_nk) and len(w.shape) == 2 and node.attrs.perm == (1, 0) and _flaggable(readers, out) \
                and not rw.claimed(readers):
            for mm in readers:  # the product reads W [N, K] through cuBLAS's transpose flag: no copy
                rw.replace(mm, [Node(Op.MATMUL, [mm.inputs[0], w], mm.outputs, MatMulAttrs(trans_b=True), mm.name)],
                           [mm])
            rw.replace(node, [], [node])
            flagged += 1
            continue
        key = (id(w), node.attrs.perm)
        new = folded.get(key)
        if new is None:
            assert w.data is not None
            data, perm = w.data, node.attrs.perm  # fusec.bulk: a tiled copy, shared by the entries of a plan
            new = folded[key] = rw.const(derived("transpose", [data], perm, lambda d=data, p=perm: transposed(d, p)), f"{w.name}.T")
            if shared:
                extra += w.nbytes
        # The TRANSPOSE is replaced by nothing: its readers are re-pointed at the cached constant.
        rw.redirect(out, new)  # type: ignore[arg-type]
        rw.replace(node, [], [node])
        cached += 1
    g = rw.finish() if rw.changed else graph.copy()
    g.meta["transposes_cached"] = cached
    g.meta["transposes_flagged"] = flagged
    options.bump("transposes_cached", cached)
    options.bump("transposes_flagged", flagged)
    if extra:
        options.bump("transpose_cache_extra_bytes", extra)
    return PassResult(g, cached + flagged > 0)
