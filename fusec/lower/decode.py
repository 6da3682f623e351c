"""Lowering of the decode-step ops: CACHE_WRITE (in place), KV_ATTENTION (split, merged in-kernel) and
SAMPLE. Everything a launch needs per token (positions, counters, each row's sampling settings and
seed) is read from device memory, so the launches are fixed and replay in a CUDA graph."""

from __future__ import annotations

from fusec import knobs
from fusec.codegen import specs as S
from fusec.codegen.build_decode import kv_attention_spec, sample_spec
from fusec.dtypes import DType
from fusec.errors import InputError
from fusec.ir import Node
from fusec.lower import Context, LoweringError, sm90_or_later


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
    out = node.output
    B, Hq, S_, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    if not (q.dtype == k.dtype == v.dtype == out.dtype):
        raise LoweringError(f"{_where(node, label)}: kv_attention needs one dtype for q/k/v/out, got "
                            f"{q.dtype.value}/{k.dtype.value}/{v.dtype.value}/{out.dtype.value}")
    if pos.dtype not in S.POS_DTYPES:
        raise LoweringError(f"{_where(node, label)}: positions of dtype {pos.dtype.value} are not supported")
    if not ctx.aligned(q, k, v):
        raise LoweringError(f"{_where(node, label)}: kv_attention needs 16-byte aligned q/k/v")
    split_keys = knobs.get("FUSEC_KV_SPLIT_KEYS")
    if split_keys < 1:
        raise InputError(f"environment variable FUSEC_KV_SPLIT_KEYS={split_keys} must be a positive row count")
    try:
        spec = kv_attention_spec(B, Hq, Hkv, S_, T, D, q.dtype, float(node.attrs.scale), pos.dtype,
                                 softcap=float(node.attrs.softcap), window=int(node.attrs.window),
                                 prefetch=knobs.get("FUSEC_KV_PREFETCH") and ctx.older_rows_stable((k, v), pos),
                                 cluster=knobs.get("FUSEC_KV_CLUSTER") and sm90_or_later(ctx.arch),
                                 split_keys=split_keys)
    except ValueError as e:
        raise LoweringError(f"{_where(node, label)}: kv_attention of q {list(q.shape)} over k/v {list(k.shape)} "
                            f"({q.dtype.value}): {e}") from None
    if spec.splits == 1 or spec.cluster:
        ctx.kernel(spec, [q, k, v, pos, out], label)
        return
    from fusec.codegen.build_decode import kv_layout

    part = ctx.scratch(spec.part_floats * 4)
    sync = ctx.sync(spec.sync_ints(kv_layout(spec, spec.threads)["tiles"]) * 4)
    ctx.kernel(spec, [q, k, v, pos, part, sync, out], label)  # the last block of each head merges: one launch


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


__all__ = ["cache_write", "kv_attention", "sample"]
