"""Kernel selection: the one decision of how each node runs, recorded on the node (``node.kernel``).

For every node of the optimized graph this pass decides, once:

- its **family**: ``view`` (no launch: the memory plan aliases it), a fused body's template family
  (``fusec.lower.fused_plan.kernel_plan``: ``gemv``, ``gemm_epilogue``, ``attention``, ``kv_attention_heads``,
  ``head_rope``, ``rope``, ``add_norm``, ``elementwise``), or the op's own lowering (its op name);
- for products with alternatives (``fusec.lower.choices``: a fused GEMM epilogue, a plain MATMUL
  over a constant weight): the **variant** (the GEMM back end: cuBLAS + epilogue kernel, cuBLASLt
  with the epilogue inside, fusec's GEMM, the skinny GEMV) by an explicit choice
  (``PassOptions.choices``, an A/B ledger) or the rule-based default (``choices.choose``), and the
  **weight layout** that variant reads: this pass writes it into the IR (a transposed copy of the
  weight, shared by every product that reads it so, and ``trans_b`` flipped), so that the lowering
  never copies a weight and the copy shows in the dumps and the weight bytes;
- for products over packed weights (QMATMUL, alone or under a fused epilogue): the variant
  (``fusec.lower.quant.choose``: the quantized GEMV, the dequantize-in-tile GEMM, or dequantize-then-cuBLAS);
- the **spec parameters** of a GEMV (``params``): how the skinny product streams its weights
  (``build_gemm.gemv_form``: its ring, tiles a block, spread, bulk copies, x normalized in the block), the
  quantized GEMV's form (``fusec.lower.qgemv_form.gemv_form``); of an attention, its block shape and keys a tile
  (``build_attention.query_warps``, ``key_tile``); of a head_rope group, its rows a warp
  (``build_heads.rows_per_warp``); of a decode attention, its splits, cluster merge, keys a group, solo context
  and whether it loads older rows before its PDL wait (``build_decode.kv_form``; the lowering keeps that last
  one only where the task before it leaves those rows alone); of fusec's GEMM in its stream form, its K split over
  a cluster (``build_gemm.stream_splits``, where ``PassOptions.clusters``: sm_90 and later) and on sm_90 its
  products on wgmma (``PassOptions.wgmma``; the weight then stored [N, K]).

The lowering (``fusec.lower``) reads ``node.kernel`` and decides nothing; ``explain``, ``inspect``
and the A/B read the same record (``graph.meta["selection"]`` holds it as JSON, per node).

A variant whose operands are not 16-byte aligned (a view that starts mid-buffer) is declined here,
with the reason, from the views' byte offsets: every buffer of the plan starts 256-byte aligned.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fusec.ir import Graph, Node, Value
from fusec.ops import FusedAttrs, Op
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter
from fusec.passes.views import view_of

NAME = "select_kernels"
REQUIRES = ("fusion",)


@dataclasses.dataclass(frozen=True)
class Selection:
    """How a node runs. ``detail`` is what the lowering needs for a fused body (the template
    family's plan); it is derived from the node, never serialized."""

    family: str
    variant: str = ""
    key: str = ""  # the choice key of a product with alternatives ("" otherwise)
    layout: str = ""  # a constant-weight product: "nk" (stored [N, K], read with trans_b) or "kn"
    reason: str = ""
    # the kernel spec's parameters this pass chose, as (keyword, value) pairs: the skinny product's
    # weight streaming (stages, tiles_per_block), the quantized GEMV's form (rows, fold; tc, warps)
    params: tuple[tuple[str, Any], ...] = ()
    detail: Any = dataclasses.field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"family": self.family}
        out.update({k: v for k, v in (("variant", self.variant), ("key", self.key), ("layout", self.layout),
                                      ("reason", self.reason)) if v})
        if self.params:
            out["params"] = dict(self.params)
        return out


def _offsets(graph: Graph) -> dict[Value, int]:
    """Each value's byte offset from the start of its buffer (views only: everything else starts
    a buffer, 256-byte aligned)."""
    off: dict[Value, int] = {}
    for n in graph.nodes:
        info = view_of(n)
        if info is not None:
            off[n.outputs[0]] = off.get(info.base, 0) + info.byte_offset
    return off


def _select(node: Node, options: PassOptions, offsets: dict[Value, int]) -> Selection:
    from fusec.lower import choices as C
    from fusec.lower.fused_plan import _NoPlan, kernel_plan

    if view_of(node) is not None and not node.inputs[0].is_const:
        return Selection("view", reason="a zero-copy view of its input")
    cp = C.choice_point(node)
    if node.op == Op.FUSED:
        try:
            family, detail = kernel_plan(node.attrs.body)
        except _NoPlan as e:  # fusion asks can_fuse before it forms a group: a bug if this happens
            from fusec.lower import LoweringError

            raise LoweringError(f"{node.describe()}: fused group ({node.attrs.rule}) is not one kernel: {e}") from None
        if family == "gemv" and detail.packed:
            a = detail.mm.attrs
            params = _qgemv_params(detail.m, a.n, a.k, a.format, a.group, detail.mm.inputs[0].dtype,
                                   detail.norm is not None, bool(detail.glu), bool(detail.siblings))
            if detail.siblings:  # each further product's rows a task and chunks a round (its own form's)
                forms = [dict(_qgemv_params(detail.m, s.attrs.n, s.attrs.k, s.attrs.format, s.attrs.group,
                                            s.inputs[0].dtype, True, siblings=True)) for s in detail.siblings]
                params += (("sibling_forms", tuple((f["rows"], f["chunks"]) for f in forms)),)
            return Selection("gemv", "qgemv", reason="only the quantized GEMV covers this body", params=params,
                             detail=detail)
        if family == "gemv" and detail.wide:  # a gated unit after a prefill's product: the wgmma form's epilogue
            return Selection("gemm_glu", "fusec_gemm", layout="nk", reason="only fusec's wgmma GEMM covers this body",
                             params=_gemm_params(detail.m, detail.n, detail.k, detail.mm.inputs[0].dtype,
                                                 options.clusters, True), detail=detail)
        if family == "gemv":
            return Selection("gemv", "gemv", layout="nk", reason="only the skinny product covers this body",
                             params=_gemv_params(detail.n, detail.k, detail.mm.inputs[0].dtype, bool(detail.glu), detail.m,
                                                 detail.norm is not None),
                             detail=detail)
        if family == "gemm_epilogue" and detail[0].op == Op.QMATMUL:
            return _quantized(node, detail[0], offsets, family, detail, options.clusters, options.choices)
        if cp is None:
            params = _attention_params(detail["operands"][0][1].shape) if family == "attention" \
                else _head_rope_params(detail) if family == "head_rope" \
                else _kv_params(detail.attn, options) if family == "kv_attention_heads" else ()
            return Selection(family, reason=f"the one {family} kernel of this body", params=params, detail=detail)
    if node.op == Op.QMATMUL:
        return _quantized(node, node, offsets, "qmatmul", clusters=options.clusters, choices=options.choices)
    if cp is None:
        params = _attention_params(node.inputs[0].shape) if node.op == Op.ATTENTION \
            else _kv_params(node, options) if node.op == Op.KV_ATTENTION else ()
        return Selection(node.op.value, reason="the op's own lowering", params=params)
    variant = C.choose(options.choices, cp, options.wgmma)
    reason = "explicit choice" if cp.key in options.choices else "rule-based default"
    if not cp.accepts(variant):
        options.decline("select_kernels", node.name or node.outputs[0].name,
                        f"{cp.key}: variant {variant!r} does not apply (have {', '.join(cp.variants)})")
        variant, reason = C.choose({}, cp, options.wgmma), f"{variant!r} does not apply here: the rule-based default"
    operands = [C.outer(node, v) for v in (cp.a, cp.bias, cp.residual) if v is not None] + list(node.outputs)
    if variant in C.ALIGNED and any(offsets.get(v, 0) % 16 for v in operands):
        options.decline("select_kernels", node.name or node.outputs[0].name,
                        f"{cp.key}: variant {variant!r} needs 16-byte aligned operands")
        variant, reason = C.DEFAULT, "operands not 16-byte aligned"
    params = _gemv_params(cp.n, cp.k, C.outer(node, cp.a).dtype, m=cp.m) if variant == "gemv" else ()
    if variant == "fusec_gemm":
        params = _gemm_params(cp.m, cp.n, cp.k, C.outer(node, cp.a).dtype, options.clusters, options.wgmma)
    need = C.NEEDS_TRANS_B.get(variant)
    if dict(params).get("wgmma"):  # the wgmma form reads the weight [N, K]
        need = True
    layout = "" if not cp.b_const else ("nk" if (cp.trans_b if need is None else need) else "kn")
    family = {"cublas": "gemm_epilogue" if node.op == Op.FUSED else "cublas"}.get(variant, variant)
    if variant in C.LAYOUT_VARIANTS:
        family = "gemm_epilogue" if node.op == Op.FUSED else "cublas"
    detail = None
    if node.op == Op.FUSED:
        detail = kernel_plan(node.attrs.body)[1]
    return Selection(family, variant, cp.key, layout, reason, params, detail)


def _attention_params(q_shape: tuple[int, ...]) -> tuple[tuple[str, Any], ...]:
    """The fp16/bf16 attention's block shape at q [B, H, S, D] and its keys a tile (``build_attention.query_warps``
    and ``key_tile``, the rules; the fp32 forms ignore them)."""
    from fusec.codegen.build_attention import key_tile, query_warps

    b, h, s, d = q_shape
    qw = query_warps(b, h, s)
    return (("qwarps", qw), ("bn", key_tile(d, qw)))


def _kv_params(attn: Node, options: PassOptions) -> tuple[tuple[str, Any], ...]:
    """The decode attention's form (``build_decode.kv_form``: splits, cluster merge, keys a group, solo context,
    older rows before the wait) for a KV_ATTENTION node (a fused body's: its shapes are the kernel's)."""
    from fusec.codegen.build_decode import kv_form
    from fusec.errors import InputError
    from fusec.lower import LoweringError

    q, k, _, pos = attn.inputs
    B, Hq, S_, D = q.shape
    try:
        form = kv_form(B, Hq, k.shape[1], S_, k.shape[2], D, q.dtype, pos.dtype, float(attn.attrs.softcap),
                       options.clusters)
    except InputError:  # a knob out of its bounds: its own message
        raise
    except ValueError as e:
        raise LoweringError(f"{attn.describe()}: kv_attention of q {list(q.shape)} over k/v {list(k.shape)} "
                            f"({q.dtype.value}): {e}") from None
    return tuple(form.items())


def _head_rope_params(parts: Any) -> tuple[tuple[str, Any], ...]:
    """The head_rope kernel's rows a warp over its parts' [B, H, S, D] rows (``build_heads.rows_per_warp``)."""
    from fusec.codegen.build_heads import rows_per_warp

    shapes = [p.rows.shape for p in parts]
    return (("rpw", rows_per_warp(shapes[0][2], sum(b * h * s for b, h, s, _ in shapes))),)


def _gemm_params(m: int, n: int, k: int, dtype: Any, clusters: bool, wgmma: bool) -> tuple[tuple[str, Any], ...]:
    """fusec's GEMM: in its stream form, the K split over a cluster (``build_gemm.stream_splits``, the one rule); on
    sm_90 (``PassOptions.wgmma``), the products on wgmma (``GemmSpec.wgmma``, the weight read [N, K]) with their
    columns a block and split from ``build_gemm.wgmma_tiling``: measured alone on an H200 at the rule's splits it took
    0.63-0.92x the mma.sync stream form's time at seven of Qwen3-0.6B's and Llama-1B's eight prefill products, 1.09x at
    Llama-1B's o product (benchmarks/RESULTS.md, twenty-third session), before that rule. Its B copies carry an L2
    evict-first policy where ``FUSEC_WGMMA_L2_EVICT_FIRST`` says so (``GemmSpec.l2_evict_first``)."""
    from fusec import knobs
    from fusec.codegen.build_gemm import stream_splits, wgmma_tiling
    from fusec.lower.choices import stream_fits

    if not stream_fits(m, n, k, dtype):
        return ()
    if wgmma:  # its columns a block and its K split, one rule (build_gemm.wgmma_tiling)
        bn, splits = wgmma_tiling(m, n, k)
        l2 = (("l2_evict_first", True),) if knobs.get("FUSEC_WGMMA_L2_EVICT_FIRST") else ()
        return (("splits", splits), ("wgmma", True), ("bn", bn)) + l2
    return (("splits", stream_splits(m, n, k, clusters)),)


def _gemv_params(n: int, k: int, dtype: Any, glu: bool = False, m: int = 1,
                 norm: bool = False) -> tuple[tuple[str, Any], ...]:
    """The skinny product's weight streaming (``build_gemm.gemv_form``, the one rule)."""
    from fusec.codegen.build_gemm import gemv_form

    return tuple(gemv_form(n, k, dtype, glu, m, norm).items())


def _quantized(node: Node, mm: Node, offsets: dict[Value, int], family: str, detail: Any = None,
               clusters: bool = False, choices: dict[str, str] | None = None) -> Selection:
    """A product over packed weights (``mm``: a QMATMUL, alone or the product of a fused epilogue):
    the quantized GEMV with its form (``fusec.lower.quant``'s rules); past the GEMV's rows the
    dequantize-in-tile GEMM with its tiling where an explicit choice for its key (``choices``: an A/B's),
    the rule or FUSEC_QGEMM takes it (``clusters``: sm_90's tilings), else dequantize-then-cuBLAS; also
    dequantize-then-cuBLAS where the chosen kernel's operands are not 16-byte aligned (vector loads, x's
    16-byte copies)."""
    from fusec.lower import choices as C
    from fusec.lower import quant as Q

    choices = choices or {}
    x = C.outer(node, mm.inputs[0]) if node.op == Op.FUSED else mm.inputs[0]
    m, a = int(np.prod(x.shape[:-1])), mm.attrs
    variant = Q.choose(m, a.n, a.k, a.format, a.group, x.dtype, clusters)
    reason = "rule-based default"
    cp = C.choice_point(node)
    key = cp.key if cp is not None else ""
    if cp is not None and cp.key in choices:  # an A/B's (or the caller's) choice for this shape
        if cp.accepts(choices[cp.key]):
            variant, reason = choices[cp.key], "explicit choice"
        else:
            reason = f"{choices[cp.key]!r} does not apply here (have {', '.join(cp.variants)}): the rule-based default"
    if variant == "qgemv":
        parsed = C._epilogue(node.attrs.body) if node.op == Op.FUSED else None
        extra = [C.outer(node, v) for v in (parsed[0], parsed[2]) if v is not None] if parsed else []
        if any(offsets.get(v, 0) % 16 for v in (x, *node.outputs, *extra)):
            variant, reason = "dequant_gemm", "operands not 16-byte aligned"
    elif variant == "qgemm" and offsets.get(x, 0) % 16:  # x's tiles are copied 16 bytes at a time
        variant, reason = "dequant_gemm", "x not 16-byte aligned"
    params: tuple[tuple[str, Any], ...] = ()
    if variant == "qgemv":
        params = _qgemv_params(m, a.n, a.k, a.format, a.group, x.dtype)
    elif variant == "qgemm":
        params = tuple(Q.qgemm_tiling(m, a.n, a.k, clusters).items())
    return Selection(family, variant, key, reason=reason, params=params, detail=detail)


def _qgemv_params(m: int, n: int, k: int, fmt: str, group: int, dtype: Any, norm: bool = False,
                  glu: bool = False, siblings: bool = False) -> tuple[tuple[str, Any], ...]:
    """The quantized GEMV's form at M = ``m`` (``fusec.lower.qgemv_form.gemv_form``, the one rule)."""
    from fusec.lower.qgemv_form import gemv_form

    return tuple(gemv_form(m, n, k, fmt, group, dtype, norm, glu, siblings).items())


def _matmul_of(node: Node) -> tuple[Node, Graph | None]:
    if node.op == Op.MATMUL:
        return node, None
    body: Graph = node.attrs.body
    return next(n for n in body.nodes if n.op == Op.MATMUL), body


def _relayout(node: Node, w_new: Value, trans_b: bool) -> Node:
    """``node`` (a MATMUL, or a fused group with one MATMUL) reading ``w_new`` with ``trans_b``."""
    mm, body = _matmul_of(node)
    attrs = dataclasses.replace(mm.attrs, trans_b=trans_b)  # keeps precision
    if body is None:
        return Node(Op.MATMUL, [node.inputs[0], w_new], node.outputs, attrs, node.name)
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
    new_mm = Node(Op.MATMUL, [mm.inputs[0], nb], mm.outputs, attrs, mm.name)
    new_body = Graph(inputs, body.outputs, [new_mm if n is mm else n for n in body.nodes], consts, body.name,
                     dict(body.meta))
    return Node(Op.FUSED, outer, node.outputs, FusedAttrs(node.attrs.kind, node.attrs.rule, new_body), node.name)


def run(graph: Graph, options: PassOptions) -> PassResult:
    from fusec.lower import choices as C

    ctx = Ctx(graph)
    rw = Rewriter(graph)
    offsets = _offsets(graph)
    made: dict[int, Value] = {}
    readers_left: dict[Value, int] = {}
    relaid: list[dict[str, Any]] = []
    chosen: dict[Node, Selection] = {}
    for node in graph.nodes:
        sel = _select(node, options, offsets)
        if sel.layout:  # a constant-weight product: store the weight the way the variant reads it
            mm, body = _matmul_of(node)
            trans_b = bool(getattr(mm.attrs, "trans_b", False))
            if (sel.layout == "nk") != trans_b:
                w = C.outer(node, mm.inputs[1])
                assert w.data is not None
                new = made.get(id(w))
                if new is None:
                    new = made[id(w)] = rw.const(np.ascontiguousarray(np.asarray(w.data).T),
                                                  f"{w.name}.{sel.layout}")
                    readers_left[w] = len(ctx.users(w)) + (1 if ctx.is_output(w) else 0)
                readers_left[w] -= 1
                new_node = _relayout(node, new, sel.layout == "nk")
                rw.replace(node, [new_node], [node])
                relaid.append({"key": sel.key, "variant": sel.variant, "where": ctx.where(node), "weight": w.name,
                               "stored": new.name, "shape": list(new.shape)})
                if new_node.op == Op.FUSED:  # the plan of the new body
                    from fusec.lower.fused_plan import kernel_plan

                    sel = dataclasses.replace(sel, detail=kernel_plan(new_node.attrs.body)[1])
                chosen[new_node] = sel
                continue
        chosen[node] = sel
    g = rw.finish() if rw.changed else graph.copy()
    # fresh Node objects carry the records: the nodes of the graph this pass was given stay as they were
    g.nodes = [Node(n.op, n.inputs, n.outputs, n.attrs, n.name, kernel=chosen[n]) for n in g.nodes]
    extra = sum(w.nbytes for w, left in readers_left.items() if left > 0)
    g.meta["weights_relaid"] = relaid
    g.meta["selection"] = [{"node": n.name or n.outputs[0].name, **n.kernel.to_json()} for n in g.nodes]
    options.bump("weights_relaid", len(relaid))
    if extra:
        options.bump("weight_layout_extra_bytes", extra)
    return PassResult(g, bool(relaid))


def selection(node: Node) -> Selection:
    """``node``'s recorded selection (a graph that skipped this pass is a compiler bug)."""
    sel = getattr(node, "kernel", None)
    if sel is None:
        raise RuntimeError(f"node {node.describe()} has no kernel selection: the graph did not go through "
                           f"passes/{NAME}.py")
    return sel
