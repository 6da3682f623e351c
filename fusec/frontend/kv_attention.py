"""The decode step of an ONNX decoder with a KV cache (``fusec.frontend.kv_cache``): one-query
attention over the written cache becomes ``kv_attention``, where its mask is proven to be
"key j <= pos[b]"."""

from __future__ import annotations

import numpy as np

from fusec.ir import Graph, Node, Value
from fusec.ops import Op


def use_kv_attention(graph: Graph) -> Graph:
    """The decode graph with each recognized one-query ``attention`` over a written cache replaced by
    ``kv_attention`` (keys ``0..pos``, the decode kernel fusec's own decoders use), where the
    attention's mask is proven to be exactly "key j <= pos[b]".

    The proof is by evaluation: the mask must depend on nothing but the ``pos`` state (and
    constants), and evaluating it for every position in every row must give "attend" (True or +0)
    for keys j <= pos[b] and "never" after them (False, or at most -6e4: HF masks with the dtype's
    lowest value, -65504 in fp16, which softmax turns into an exact 0 unless a masked score is ~6e4
    above the row's best). Anything else keeps the masked attention over the whole cache (correct, slower).
    Runs the pass pipeline's canonicalization and pattern recognition first (what recognizes the
    attention); the full pipeline runs them again, harmlessly."""
    from fusec import reference
    from fusec.ir import verify
    from fusec.ops import KVAttentionAttrs
    from fusec.passes import dce, recognize_attention
    from fusec.passes.base import PassOptions
    from fusec.passes.pipeline import PIPELINE, optimize

    g = optimize(graph, pipeline=PIPELINE[:PIPELINE.index(recognize_attention) + 1])[0]
    states = {r["input"] for r in g.meta.get("states") or []}
    ins = {v.name: v for v in g.inputs}
    pos = ins.get("pos")
    if pos is None:
        return graph
    producers = g.producers()
    checked: dict[Value, bool] = {}

    def is_cache(v: Value) -> bool:
        n = producers.get(v)
        if n is not None and n.op == Op.CAST:  # an fp16/bf16 model reads its fp32 cache state cast
            n = producers.get(n.inputs[0])
        return n is not None and n.op == Op.CACHE_WRITE and n.inputs[0].name in states \
            and n.inputs[0].name[:2] in ("k.", "v.") and n.inputs[2] is pos

    def mask_is_pos(mask: Value, t: int) -> bool:
        if mask in checked:
            return checked[mask]
        need, nodes = {mask}, []
        for n in reversed(g.nodes):
            if any(o in need for o in n.outputs):
                nodes.append(n)
                need.update(n.inputs)
        leaves = {v for v in need if v not in producers and not v.is_const}
        ok = leaves == {pos}
        if ok:
            sub = Graph([pos], [mask], nodes[::-1], [v for v in g.constants if v in need], "mask")
            bsz = pos.shape[0]
            keys = np.arange(t)
            for p in range(t):
                at = (p + np.arange(bsz) * max(1, t // max(bsz, 1))) % t  # every row sees every position
                got = reference.run(sub, {"pos": at.astype(pos.dtype.np)})[mask.name]
                got = np.broadcast_to(got, (bsz,) + got.shape[1:])
                allowed = (keys[None, :] <= at[:, None]).reshape(bsz, *([1] * (got.ndim - 2)), t)
                allowed = np.broadcast_to(allowed, got.shape)
                if got.dtype == np.bool_:
                    ok = bool((got == allowed).all())
                else:
                    ok = bool((got[allowed] == 0).all() and (got[~allowed] <= -6e4).all())
                if not ok:
                    break
        checked[mask] = ok
        return ok

    nodes, changed = [], 0
    for n in g.nodes:
        if n.op == Op.ATTENTION and len(n.inputs) == 4 and n.inputs[0].shape[2] == 1 \
                and is_cache(n.inputs[1]) and is_cache(n.inputs[2]) \
                and mask_is_pos(n.inputs[3], n.inputs[1].shape[2]):
            nodes.append(Node(Op.KV_ATTENTION, [*n.inputs[:3], pos], n.outputs, KVAttentionAttrs(n.attrs.scale, softcap=n.attrs.softcap),
                              n.name))
            changed += 1
        else:
            nodes.append(n)
    if not changed:
        return graph
    out = Graph(g.inputs, g.outputs, nodes, g.constants, g.name, g.meta)
    out = dce.run(out, PassOptions()).graph  # the mask's computation is dead now
    verify(out)
    return out
