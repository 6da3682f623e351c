"""Lowering of the decode-step ops: CACHE_WRITE (in place), KV_ATTENTION (split, merged in-kernel; or
with the layer's head_rope group as its prologue, ``plan_heads``) and SAMPLE. Everything a launch needs
per token (positions, counters, each row's sampling settings and seed) is read from device memory, so
the launches are fixed and replay in a CUDA graph."""

from __future__ import annotations

import dataclasses
from typing import Any

from fusec.codegen import specs as S
from fusec.codegen.build_decode import sample_spec
from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value
from fusec.lower import Context, LoweringError, Raw
from fusec.lower.heads import Part
from fusec.ops import FusedAttrs, Op
from fusec.passes.subgraph import Cut, extract


def _where(node: Node, label: str) -> str:
    return f"{label} (node {node.name!r})"


def cache_write(ctx: Context, node: Node, label: str) -> None:
    cache, new, pos = node.inputs[:3]
    rows = node.inputs[3] if len(node.inputs) == 4 else None
    out = node.output
    if cache.is_const or not ctx.same_storage(cache, out):
        raise LoweringError(f"{_where(node, label)}: cache_write is in place, but the memory plan put its output "
                            f"{out.name!r} in other storage than the cache {cache.name!r} {list(cache.shape)}")
    if pos.dtype not in S.POS_DTYPES or (rows is not None and rows.dtype not in S.POS_DTYPES):
        raise LoweringError(f"{_where(node, label)}: positions/rows of dtype "
                            f"{pos.dtype.value}/{rows.dtype.value if rows is not None else '-'} are not supported")
    if cache.dtype not in S.CACHE_DTYPES:
        raise LoweringError(f"{_where(node, label)}: a cache of {cache.dtype.value} {list(cache.shape)} is not supported")
    try:
        spec = S.cache_write_spec(tuple(cache.shape), tuple(new.shape), node.attrs.axis, cache.dtype, pos.dtype,
                                  vectorize=ctx.aligned(new, out), rows_dtype=rows.dtype if rows is not None else None)
    except ValueError as e:
        raise LoweringError(f"{_where(node, label)}: cache {list(cache.shape)}, new {list(new.shape)}: {e}") from None
    ctx.kernel(spec, [new, pos] + ([rows] if rows is not None else []) + [out], label)
    if rows is None and node.attrs.axis == 2 and len(cache.shape) == 4:  # rows pos[b] + s of [B, H, T, D]
        ctx.wrote_rows_from_pos(out, pos)


def kv_attention(ctx: Context, node: Node, label: str) -> None:
    q, k, v, pos = node.inputs
    spec = _kv_spec(ctx, node, label, node.attrs, q, k, v, pos, node.output)
    ctx.kernel(spec, [q, k, v, pos, *_merge_args(ctx, spec), node.output], label)


def _kv_spec(ctx: Context, node: Node, label: str, attrs: Any, q: Value, k: Value, v: Value, pos: Value, out: Value,
             heads: tuple[S.HeadRopeSpec, ...] = ()) -> S.KVAttentionSpec:
    """The kernel spec of a KV_ATTENTION (``attrs``, lowered as ``node``) over q/k/v/pos/out (the
    fused node's values when head_rope parts are its prologue: ``heads``, and q is the body's, never
    stored)."""
    B, Hq, S_, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    if not (q.dtype == k.dtype == v.dtype == out.dtype):
        raise LoweringError(f"{_where(node, label)}: kv_attention needs one dtype for q/k/v/out, got "
                            f"{q.dtype.value}/{k.dtype.value}/{v.dtype.value}/{out.dtype.value}")
    if pos.dtype not in S.POS_DTYPES:
        raise LoweringError(f"{_where(node, label)}: positions of dtype {pos.dtype.value} are not supported")
    if not ctx.aligned(k, v) or not (heads or ctx.aligned(q)):
        raise LoweringError(f"{_where(node, label)}: kv_attention needs 16-byte aligned q/k/v")
    from fusec.passes.select_kernels import selection

    form = dict(selection(node).params)  # kernel selection's form (build_decode.kv_form)
    # the older rows load before the PDL wait only where the task before this one leaves them and pos alone
    prefetch = form.pop("prefetch") and ctx.older_rows_stable((k, v), pos)
    try:
        return S.KVAttentionSpec(B, Hq, Hkv, S_, T, D, q.dtype, float(attrs.scale), form["splits"], pos.dtype,
                                 softcap=float(attrs.softcap), window=int(attrs.window), prefetch=prefetch,
                                 cluster=form["cluster"], heads=heads, unroll=form["unroll"],
                                 solo_keys=form["solo_keys"], trigger=form.get("trigger", "wait"),
                                 mma=form.get("mma", False))
    except ValueError as e:
        raise LoweringError(f"{_where(node, label)}: kv_attention of q {list(q.shape)} over k/v {list(k.shape)} "
                            f"({q.dtype.value}): {e}") from None


def _merge_args(ctx: Context, spec: S.KVAttentionSpec) -> list[Raw]:
    """The partials and counters a split launch merges through (the last block of each head merges:
    one launch); none for one split or one cluster."""
    if not spec.global_merge:
        return []
    from fusec.codegen.build_decode import kv_layout

    return [ctx.scratch(spec.part_floats * 4), ctx.sync(spec.sync_ints(kv_layout(spec, spec.threads)["tiles"]) * 4)]


@dataclasses.dataclass
class HeadsPlan:
    """A fused body of one KV_ATTENTION and the head_rope group (q and k norms and RoPEs, the K/V
    cache writes) that makes its q and new cache rows: the attention's prologue. ``cut`` is the body
    without the attention (one head_rope group: ``heads.plan``), ``outs`` the body value of each of
    its outputs, ``parts`` its (q, k, v) parts."""

    attn: Node
    cut: Cut
    outs: list[Value]
    parts: tuple[Part, Part, Part]


def plan_heads(body: Graph) -> HeadsPlan:
    """The plan of an attention with its head_rope prologue, or ``heads.NoPlan`` saying why the body
    is not one such kernel (asked by fusion through ``fused.can_fuse``)."""
    from fusec.lower import heads

    attns = [n for n in body.nodes if n.op == Op.KV_ATTENTION]
    if len(attns) != 1:
        raise heads.NoPlan("the attention prologue kernel takes one kv_attention")
    attn = attns[0]
    q, k, v, pos = attn.inputs
    if (why := S.kv_heads_refusal(q.shape[2], q.shape[3], q.dtype, int(attn.attrs.window))) is not None:
        raise heads.NoPlan(why)
    rest = [n for n in body.nodes if n is not attn]
    if attn.output not in body.outputs or q in body.outputs:
        raise heads.NoPlan("the rotated q rows must be read by the attention only, and its result be the kernel's")
    outs = [x for n in rest for x in n.outputs if x in body.outputs or x in attn.inputs]
    cut = extract(rest, outs, "heads")
    parts = heads.plan(cut.body)
    role = {id(outs[p.out]): p for p in parts if p.res is None}
    qp, kp, vp = (role.get(id(x)) for x in (q, k, v))
    if qp is None or kp is None or vp is None or qp.write is not None or qp.rope is None or kp.rope is None \
            or kp.write is None or vp.rope is not None or len(parts) != 3:
        raise heads.NoPlan("the attention's prologue computes its q rows (a RoPE) and writes the new K rows (a RoPE) "
                           "and V rows (a copy) to the caches it reads, nothing else")
    for p in (kp, vp):
        wpos = p.write.inputs[2]  # type: ignore[union-attr]
        if wpos not in cut.body.inputs or cut.reads[cut.body.inputs.index(wpos)] is not pos:
            raise heads.NoPlan("the cache writes of the attention's prologue use the attention's run-time positions")
    return HeadsPlan(attn, cut, outs, (qp, kp, vp))


def kv_attention_heads(ctx: Context, node: Node, plan: HeadsPlan, label: str) -> None:
    """One launch: the attention, its q rows and new cache rows computed by its prologue."""
    from fusec.lower import heads

    body: Graph = node.attrs.body
    outer: dict[Value, Value] = dict(zip(body.inputs, node.inputs))
    outer.update({c: c for c in body.constants})
    outer.update(zip(body.outputs, node.outputs))
    # the group as a head_rope node of its own, for heads' part specs; q stays the body's value (the
    # kernel keeps it in shared memory)
    group = Node(Op.FUSED, [outer[r] for r in plan.cut.reads], [outer.get(x, x) for x in plan.outs],
                 FusedAttrs(node.attrs.kind, "head_rope", plan.cut.body), node.name)
    specs: list[S.HeadRopeSpec] = []
    args: list[Any] = []
    for p in plan.parts:
        spec, x, w, _, _ = heads.part_spec(ctx, p, plan.parts[0], group, label)
        specs.append(spec)
        args += [x] + ([w] if w is not None else [])
    q, k, v, pos = plan.attn.inputs
    k, v, pos, out = outer[k], outer[v], outer[pos], outer[plan.attn.output]
    rope = plan.parts[0].rope
    assert rope is not None
    cos, sin = (outer[plan.cut.reads[plan.cut.body.inputs.index(c)]] for c in rope.inputs[1:])
    spec = _kv_spec(ctx, node, label, plan.attn.attrs, q, k, v, pos, out, tuple(specs))
    ctx.kernel(spec, [*args, cos, sin, pos, k, v, *_merge_args(ctx, spec), out], label)
    for cache in (k, v):  # the prologue writes cache rows pos[b] + s only
        ctx.wrote_rows_from_pos(cache, pos)


def sample(ctx: Context, node: Node, label: str) -> None:
    logits, seed, counter, temperature, top_k, top_p = node.inputs
    if seed.dtype not in S.POS_DTYPES or counter.dtype not in S.POS_DTYPES or top_k.dtype not in S.POS_DTYPES:
        raise LoweringError(f"{_where(node, label)}: seed/counter/top_k must be int32/int64")
    if temperature.dtype != DType.F32 or top_p.dtype != DType.F32:
        raise LoweringError(f"{_where(node, label)}: temperature/top_p must be float32 (got "
                            f"{temperature.dtype.value}/{top_p.dtype.value})")
    B, V = logits.shape
    try:
        spec = sample_spec(B, V, logits.dtype, seed.dtype, counter.dtype, top_k.dtype)
    except ValueError as e:
        raise LoweringError(f"{_where(node, label)}: sample over logits {list(logits.shape)} "
                            f"({logits.dtype.value}): {e}") from None
    if not ctx.aligned(logits):
        raise LoweringError(f"{_where(node, label)}: sample needs 16-byte aligned logits")
    settings = [logits, seed, counter, temperature, top_k, top_p]
    if spec.chunks == 1:
        ctx.kernel(spec, [*settings, node.output], label)
        return
    part = ctx.scratch(spec.part_bytes)
    ctx.kernel(spec.part(), [*settings, part], label + " part")
    ctx.kernel(spec, [*settings, part, node.output], label)


__all__ = ["HeadsPlan", "cache_write", "kv_attention", "kv_attention_heads", "plan_heads", "sample"]
