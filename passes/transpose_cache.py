"""Store constant weights in the layout their matrix products read, at compile time.

HF's nn.Linear keeps W as [out, in] and exports ``x @ transpose(W)``. Left alone, that TRANSPOSE
would run on every forward over the whole weight (seed 004: the runtime transposed weights per
call). Here every TRANSPOSE whose input is a constant and whose readers are all matrix products
(fusion kind GEMM) becomes a new constant already in [in, out] row-major order; the old constant
dies with it unless something else reads it.

A weight that is also read elsewhere (a tied embedding: GATHER reads [V, D] rows, lm_head reads
the transpose) is still cached -- a second copy costs memory once, a runtime transpose costs
bandwidth every run; the extra bytes are counted in ``options.stats["transpose_cache_extra_bytes"]``.
"""

from __future__ import annotations

import numpy as np

from fusec.ir import Graph
from fusec.ops import OP_INFO, FusionKind, Op
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter

NAME = "transpose_cache"


def run(graph: Graph, options: PassOptions) -> PassResult:
    ctx = Ctx(graph)
    rw = Rewriter(graph)
    cached = extra = 0
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
        key = (id(w), node.attrs.perm)
        new = folded.get(key)
        if new is None:
            assert w.data is not None
            new = folded[key] = rw.const(np.ascontiguousarray(np.transpose(w.data, node.attrs.perm)), f"{w.name}.T")
            if any(u is not node for u in ctx.users(w)) or ctx.is_output(w):
                extra += w.nbytes
        # The TRANSPOSE is replaced by nothing: its readers are re-pointed at the cached constant.
        rw.redirect(out, new)  # type: ignore[arg-type]
        rw.replace(node, [], [node])
        cached += 1
    g = rw.finish() if rw.changed else graph.copy()
    g.meta["transposes_cached"] = cached
    options.bump("transposes_cached", cached)
    if extra:
        options.bump("transpose_cache_extra_bytes", extra)
    return PassResult(g, cached > 0)
