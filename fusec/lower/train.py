"""Lowerings of the training ops (``fusec.ops_train``): cross_entropy (one warp per row),
scatter_add (clear, then fp32 atomic adds), init (one kernel), adamw (gradient-norm partials when
clipping, the step's scalars, the multi-tensor update: three launches whatever the number of
parameters, reading every gradient where the memory plan put it)."""

from __future__ import annotations

import math

from fusec.codegen import specs_train as T
from fusec.dtypes import DType
from fusec.ir import Node
from fusec.lower import Context, LoweringError, Raw


def cross_entropy(ctx: Context, node: Node, label: str) -> None:
    x, labels = node.inputs
    spec = T.CrossEntropySpec(labels.numel, x.shape[-1], x.dtype, labels.dtype, node.attrs.ignore_index)
    ctx.kernel(spec, [x, labels, node.output], label)


def scatter_add(ctx: Context, node: Node, label: str) -> None:
    upd, idx = node.inputs
    if upd.dtype != DType.F32:
        raise LoweringError(f"{label}: scatter_add of {upd.dtype.value} has no GPU lowering (fp32 atomic adds only)")
    a = node.attrs
    pre, post = math.prod(upd.shape[:a.axis]), math.prod(upd.shape[a.axis + len(idx.shape):])
    ctx.kernel(T.ScatterAddSpec(pre, idx.numel, a.size, post, zero=True, idx_dtype=idx.dtype), [node.output],
               f"{label} clear")
    ctx.kernel(T.ScatterAddSpec(pre, idx.numel, a.size, post, idx_dtype=idx.dtype), [upd, idx, node.output], label)


def init(ctx: Context, node: Node, label: str) -> None:
    spec = T.InitSpec(node.attrs.segments, node.attrs.dtype, node.inputs[0].dtype)
    ctx.kernel(spec, [node.inputs[0], node.output], label)


def adamw(ctx: Context, node: Node, label: str) -> None:
    params, m, v, step, *grads = node.inputs
    for i, x in enumerate((params, m, v, step)):
        if not ctx.same_storage(x, node.outputs[i]):  # the memory plan stores every update in its state
            raise LoweringError(f"{label}: adamw's output {i} is not stored in place over {x.name!r}")
    if len(grads) > T.ADAMW_MAX_SEGMENTS:
        raise LoweringError(f"{label}: adamw over {len(grads)} parameters; one kernel takes at most "
                            f"{T.ADAMW_MAX_SEGMENTS} gradient pointers")
    a = node.attrs
    common = dict(sizes=tuple(g.numel for g in grads), grad_dtypes=tuple(g.dtype for g in grads), decay=a.decay,
                  lr=float(a.lr), beta1=float(a.beta1), beta2=float(a.beta2), eps=float(a.eps),
                  weight_decay=float(a.weight_decay), schedule=a.schedule, warmup_steps=a.warmup_steps,
                  total_steps=a.total_steps, max_grad_norm=float(a.max_grad_norm))
    update = T.AdamWSpec("update", **common)
    partial_bytes = -(-update.blocks * 8 // 256) * 256
    base = ctx.scratch(partial_bytes + 256)
    partial, scalars = Raw(base.space, base.offset), Raw(base.space, base.offset + partial_bytes)
    if a.max_grad_norm > 0:
        ctx.kernel(T.AdamWSpec("norm", **common), [partial, *grads], f"{label} gradient norm")
    ctx.kernel(T.AdamWSpec("scalars", **common), [step, partial, scalars], f"{label} step scalars")
    ctx.kernel(update, [params, m, v, scalars, *grads], label)


def softmax_grad(ctx: Context, node: Node, label: str) -> None:
    p, dp = node.inputs
    ax = node.attrs.axis
    outer, cols, inner = math.prod(p.shape[:ax]), p.shape[ax], math.prod(p.shape[ax + 1:])
    ctx.kernel(T.SoftmaxGradSpec(outer, cols, inner, p.dtype, float(node.attrs.scale)), [p, dp, node.output], label)


def layernorm_grad(ctx: Context, node: Node, label: str) -> None:
    x, scale, dy = node.inputs
    cols = math.prod(x.shape[node.attrs.axis:])
    spec = T.LayerNormGradSpec(x.numel // cols, cols, x.dtype, scale.dtype, float(node.attrs.eps))
    ctx.kernel(spec, [x, scale, dy, *node.outputs], label)


def cross_entropy_grad(ctx: Context, node: Node, label: str) -> None:
    x, labels, dloss = node.inputs
    spec = T.CrossEntropySpec(labels.numel, x.shape[-1], x.dtype, labels.dtype, node.attrs.ignore_index, grad=True)
    ctx.kernel(spec, [x, labels, dloss, node.output], label)
