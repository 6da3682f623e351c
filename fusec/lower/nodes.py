"""One lowering per op: IR node -> kernel spec(s) or a cuBLAS GEMM (the table ``LOWER``)."""

from __future__ import annotations

import math
from collections.abc import Callable

from fusec.codegen import copyspecs as C
from fusec.codegen import specs as S
from fusec.codegen.elementwise import single_op
from fusec.dtypes import DType
from fusec.ir import Node, Value
from fusec.lower import Context, LoweringError, Raw, quant_emit
from fusec.lower import argreduce as _argreduce
from fusec.lower import batching as B
from fusec.lower import decode as _decode
from fusec.lower import layout as L
from fusec.lower import pad as _pad
from fusec.lower import tf32_split as _tf32_split
from fusec.lower import topk as _topk
from fusec.lower import train as _train
from fusec.ops import OP_INFO, FusionKind, Op

# ---- elementwise family -----------------------------------------------------------------------

def elementwise(ctx: Context, expr, inputs: list[Value], out: Value, label: str) -> None:
    vec_ok = ctx.aligned(out, *inputs)  # views may start mid-buffer; vector accesses need 16 bytes
    spec = S.elementwise_spec(expr, [v.shape for v in inputs], [v.dtype for v in inputs], out.shape, vectorize=vec_ok)
    ctx.kernel(spec, [*inputs, out], label)


def _elementwise_node(ctx: Context, node: Node, label: str) -> None:
    elementwise(ctx, single_op(node.op, len(node.inputs), node.attrs), list(node.inputs), node.output, label)


def _copy(ctx: Context, node: Node, label: str) -> None:
    """Every data-movement op through the one index-mapping copy kernel (fusec.codegen.copyspecs)."""
    x, out, a = node.inputs[0], node.output, node.attrs
    dt = x.dtype
    if node.op == Op.TRANSPOSE:
        ctx.kernel(C.transpose(x.shape, a.perm, dt), [x, out], label)
    elif node.op == Op.SLICE:
        ctx.kernel(C.slice_(x.shape, a.axes, a.starts, a.ends, a.steps, dt), [x, out], label)
    elif node.op == Op.EXPAND:
        ctx.kernel(C.expand(x.shape, out.shape, dt), [x, out], label)
    elif node.op == Op.TILE:
        ctx.kernel(C.tile(x.shape, a.repeats, dt), [x, out], label)
    elif node.op == Op.TRILU:
        ctx.kernel(C.trilu(x.shape, a.upper, a.k, dt), [x, out], label)
    elif node.op == Op.CONCAT:
        from fusec.passes.memory_plan import concat_blocks

        blocks = concat_blocks(node) or [None] * len(node.inputs)
        space, base = ctx.addr(out)
        for v, spec, off in zip(node.inputs, C.concat([v.shape for v in node.inputs], a.axis, dt), blocks):
            if off is not None and ctx.addr(v) == (space, base + off):
                ctx.count("concat_in_place")  # the memory plan put the input in its block: nothing to copy
                continue
            ctx.kernel(spec, [v, out], label)
    elif node.op == Op.GATHER:
        ctx.kernel(C.gather(x.shape, node.inputs[1].shape, a.axis, dt, node.inputs[1].dtype), [x, node.inputs[1], out], label)
    elif node.op == Op.GATHER_ELEMENTS:
        idx = node.inputs[1]
        ctx.kernel(C.gather_elements(x.shape, idx.shape, a.axis, dt, idx.dtype), [x, idx, out], label)
    elif node.op == Op.GATHER_ND:
        idx = node.inputs[1]
        ctx.kernel(C.gather_nd(x.shape, idx.shape, a.batch_dims, dt, idx.dtype), [x, idx, out], label)
    elif node.op == Op.SCATTER_ND:
        idx, upd = node.inputs[1], node.inputs[2]
        first, scatter = C.scatter_nd(x.shape, idx.shape, dt, idx.dtype)
        if not ctx.same_storage(x, out):
            ctx.kernel(first, [x, out], label)
        ctx.kernel(scatter, [upd, idx, out], label)
    else:
        raise LoweringError(f"{label}: no copy lowering for {node.op.value}")


def _reshape_copy(ctx: Context, node: Node, label: str) -> None:
    # A reshape is a view unless the memory plan gave it a buffer of its own (e.g. a graph output).
    x = node.inputs[0]
    if not ctx.same_storage(x, node.output):
        ctx.kernel(C.contiguous(node.output.shape, x.dtype), [x, node.output], label)


def _cumsum(ctx: Context, node: Node, label: str) -> None:
    x, a = node.inputs[0], node.attrs
    outer, n, inner = math.prod(x.shape[:a.axis]), x.shape[a.axis], math.prod(x.shape[a.axis + 1:])
    ctx.kernel(S.CumsumSpec(outer, n, inner, x.dtype, a.exclusive, a.reverse), [x, node.output], label)


# ---- matrix products ------------------------------------------------------------------------

def matmul(ctx: Context, node: Node, label: str) -> None:
    """cuBLAS GEMMs, reading every operand where and as the IR stores it: a B with ``trans_b``
    ([.., N, K], e.g. a tied embedding table) is read through cuBLAS's transpose flag. Weight
    layouts (transposes, padding of N to 16 bytes) are passes' work (transpose_cache, pad_gemm):
    nothing here copies or reshapes a weight. Broadcast batches (``fusec.lower.batching``): batch
    axes B is shared along fold into M, the rest is one strided-batched call (stride 0 for an
    operand shared by every product) or a few calls at offsets; past that an operand is first
    copied broadcast into scratch."""
    a, b = node.inputs
    out = node.output
    trans_b = bool(getattr(node.attrs, "trans_b", False))
    trans_a = bool(getattr(node.attrs, "trans_a", False))  # A stored [.., K, M] (a gradient product)
    if a.dtype not in (DType.F32, DType.F16, DType.BF16):
        raise LoweringError(f"{label}: matmul of {a.dtype.value} has no GPU lowering")
    sa = a.shape if len(a.shape) > 1 else (1,) + a.shape
    if trans_a:
        sa = tuple(sa[:-2]) + (sa[-1], sa[-2])
    sb = b.shape if len(b.shape) > 1 else b.shape + (1,)
    k, n = (sb[-1], sb[-2]) if trans_b else (sb[-2], sb[-1])
    plan = B.gemm_batches(tuple(sa[:-2]), tuple(sb[:-2]), sa[-2], k, n)
    if trans_a and (plan.m != sa[-2] or plan.expand_a is not None):
        raise LoweringError(f"{label}: a product reading A transposed needs A and B of one batch shape "
                            f"(got {list(a.shape)} and {list(b.shape)})")
    ops: list[Value | Raw] = [a, b]
    grown = [(i, x, tuple(full) + tuple(shape[-2:])) for i, (x, full, shape) in
             enumerate(((a, plan.expand_a, sa), (b, plan.expand_b, sb))) if full is not None]
    if grown:  # operands that vary along some broadcast batch axes but not all: copy them broadcast
        sizes = [-(-math.prod(shape) * x.dtype.itemsize // 256) * 256 for _, x, shape in grown]
        base = ctx.scratch(sum(sizes))
        for (i, x, shape), off in zip(grown, [0, sizes[0]]):
            ops[i] = Raw(base.space, base.offset + off)
            src = (1,) * (len(shape) - len(x.shape)) + tuple(x.shape)  # a 1-D B has no batch: never grown
            ctx.kernel(C.expand(src, shape, x.dtype), [x, ops[i]], f"{label} broadcast operand")
    compute = gemm_compute(ctx, node.attrs, a.dtype)
    fields = {"m": plan.m, "n": n, "k": k, "batch": plan.batch, "lda": plan.m if trans_a else k,
              "ldb": k if trans_b else n, "ldc": n,
              "stride_a": plan.strides[0], "stride_b": plan.strides[1], "stride_c": plan.strides[2],
              "trans_a": trans_a, "trans_b": trans_b, "dtype": a.dtype.value, "compute": compute}
    for oa, ob, oc in plan.calls:
        ctx.gemm(fields, a, b, (out, oc), label, extra_reads=tuple(x for x in ops if isinstance(x, Raw)))
        if oa or ob or grown:  # Context.gemm addresses whole values: point A/B at the call's product
            ctx.launches[-1]["a"] = ctx.ptr(_at(ops[0], oa, a.dtype))[1:]
            ctx.launches[-1]["b"] = ctx.ptr(_at(ops[1], ob, b.dtype))[1:]


def gemm_compute(ctx: Context, attrs: object, dtype: DType) -> str:
    """The cuBLAS compute mode of a product: "tf32" for a ``precision=tf32`` MATMUL (3xTF32,
    passes/split_tf32.py) and for fp32 in a tf32 plan; "f32" otherwise."""
    if dtype != DType.F32:
        return "f32"
    return "tf32" if getattr(attrs, "precision", "f32") == "tf32" else ctx.compute


def _at(x: Value | Raw, elems: int, dt: DType) -> tuple[Value, int] | Raw:
    return (x, elems) if isinstance(x, Value) else Raw(x.space, x.offset + elems * dt.itemsize)


# ---- reductions and norms ---------------------------------------------------------------------

def _outer_cols_inner(shape: tuple[int, ...], axes: tuple[int, ...], label: str) -> tuple[int, int, int]:
    lo, hi = min(axes), max(axes)
    if list(axes) != list(range(lo, hi + 1)):
        raise LoweringError(f"{label}: reduction over non-adjacent axes {list(axes)} has no GPU lowering yet")
    return math.prod(shape[:lo]), math.prod(shape[lo:hi + 1]), math.prod(shape[hi + 1:])


def _reduce(ctx: Context, node: Node, label: str) -> None:
    """One row-reduce kernel; reduced axes that are not adjacent (extent-1 axes aside) are first
    made so by a transposed copy into scratch (kept axes first, reduced axes last). A min is the
    max kernel between two order-reversing flips, both exact: -x for floats, ~x for integers."""
    x = node.inputs[0]
    perm, outer, cols, inner = B.reduce_transpose(x.shape, node.attrs.axes)
    kind = {Op.REDUCE_SUM: "sum", Op.REDUCE_MEAN: "mean", Op.REDUCE_MAX: "max", Op.REDUCE_MIN: "max",
            Op.REDUCE_PROD: "prod"}[node.op]
    flip = None
    if node.op == Op.REDUCE_MIN:
        if not (x.dtype.is_float or x.dtype.is_int):
            raise LoweringError(f"{label}: reduce_min of {x.dtype.value} has no GPU lowering")
        flip = single_op(Op.NEG if x.dtype.is_float else Op.BITWISE_NOT, 1)
    step = -(-x.nbytes // 256) * 256
    base = ctx.scratch(step * ((flip is not None) + (perm is not None))) if flip or perm else None
    src: Value | Raw = x
    if flip is not None:
        spec = S.elementwise_spec(flip, [x.shape], [x.dtype], x.shape, vectorize=ctx.aligned(x))
        src = Raw(base.space, base.offset)
        ctx.kernel(spec, [x, src], f"{label} flip order")
    if perm is not None:
        dst = Raw(base.space, base.offset + (step if flip is not None else 0))
        ctx.kernel(C.transpose(x.shape, perm, x.dtype), [src, dst], f"{label} reduced axes last")
        src = dst
    out = node.output
    ctx.kernel(S.RowReduceSpec(kind, outer, cols, x.dtype, inner=inner), [src, out], label)
    if flip is not None:
        spec = S.elementwise_spec(flip, [out.shape], [out.dtype], out.shape, vectorize=ctx.aligned(out))
        ctx.kernel(spec, [out, out], f"{label} flip back")


def _softmax(ctx: Context, node: Node, label: str) -> None:
    x = node.inputs[0]
    outer, cols, inner = _outer_cols_inner(x.shape, (node.attrs.axis,), label)
    ctx.kernel(S.RowReduceSpec("softmax", outer, cols, x.dtype, inner=inner), [x, node.output], label)


def _layernorm(ctx: Context, node: Node, label: str) -> None:
    x, scale = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    cols = math.prod(x.shape[node.attrs.axis:])
    for w in (scale, bias):
        if w is not None and w.numel != cols:
            raise LoweringError(f"{label}: layernorm scale/bias must cover the normalized axes")
    spec = S.RowReduceSpec("layernorm", x.numel // cols, cols, x.dtype, w_dtype=scale.dtype, has_bias=bias is not None,
                           eps=float(node.attrs.eps))
    ctx.kernel(spec, [x, scale, *([bias] if bias is not None else []), node.output], label)


def _rmsnorm(ctx: Context, node: Node, label: str) -> None:
    x, w = node.inputs
    cols = x.shape[-1]
    spec = S.RowReduceSpec("rmsnorm", x.numel // cols, cols, x.dtype, w_dtype=w.dtype, eps=float(node.attrs.eps),
                           weight_offset=float(node.attrs.weight_offset))
    ctx.kernel(spec, [x, w, node.output], label)


# ---- attention, rope, embedding ---------------------------------------------------------------

def _bcast_strides(v: Value, full: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of ``v`` read broadcast to ``full`` (0 on broadcast axes)."""
    view = L.broadcast_to(L.View.contiguous(v.shape), full)
    if view is None:
        raise LoweringError(f"value {v.name!r} {list(v.shape)} does not broadcast to {list(full)}")
    return tuple(0 if n == 1 else s for n, s in zip(full, view.strides))  # an extent-1 axis reads index 0


def _attention(ctx: Context, node: Node, label: str) -> None:
    """A standalone attention node: the fused-layout emitter with contiguous views."""
    from fusec.lower.fused import emit_attention

    views = [(i, L.View.contiguous(x.shape)) for i, x in enumerate(node.inputs)]
    emit_attention(ctx, {"node": node, "operands": views, "out": L.View.contiguous(node.output.shape)}, node, label)


def _rope(ctx: Context, node: Node, label: str) -> None:
    x, cos, sin = node.inputs
    if len(x.shape) != 4:
        raise LoweringError(f"{label}: rope expects x of rank 4 [B, H, S, D], got {list(x.shape)}")
    B, H, S_, D = x.shape
    rd = node.attrs.rotary_dim
    full = (B, H, S_, rd)
    cst, sst = _bcast_strides(cos, full), _bcast_strides(sin, full)
    if cst != sst or cst[1] != 0 or cst[3] != 1:
        raise LoweringError(f"{label}: rope cos/sin layout {list(cos.shape)} has no GPU lowering yet")
    xs = S.contiguous_strides(x.shape)[:3]
    spec = S.RopeSpec(B, H, S_, D, rd, x.dtype, xs, xs, (cst[0], cst[2]), cos.dtype)  # type: ignore[arg-type]
    ctx.kernel(spec, [x, cos, sin, node.output], label)


def _gather(ctx: Context, node: Node, label: str) -> None:
    table, ids = node.inputs
    if node.attrs.axis == 0 and len(table.shape) == 2 and table.dtype.is_float:
        spec = S.EmbeddingSpec(ids.numel, table.shape[0], table.shape[1], table.dtype, id_dtype=ids.dtype)
        ctx.kernel(spec, [ids, table, node.output], label)
        return
    _copy(ctx, node, label)


def _fused(ctx: Context, node: Node, label: str) -> None:
    from fusec.lower.fused import lower_fused

    lower_fused(ctx, node, label)


LOWER: dict[Op, Callable[[Context, Node, str], None]] = {
    Op.MATMUL: matmul,
    Op.QMATMUL: quant_emit.lower_node,
    Op.QGATHER: quant_emit.lower_gather,
    Op.TRANSPOSE: _copy,
    Op.SLICE: _copy,
    Op.EXPAND: _copy,
    Op.TILE: _copy,
    Op.TRILU: _copy,
    Op.CONCAT: _copy,
    Op.GATHER_ELEMENTS: _copy,
    Op.GATHER_ND: _copy,
    Op.SCATTER_ND: _copy,
    Op.CUMSUM: _cumsum,
    Op.RESHAPE: _reshape_copy,
    Op.REDUCE_SUM: _reduce,
    Op.REDUCE_MEAN: _reduce,
    Op.REDUCE_MAX: _reduce,
    Op.REDUCE_MIN: _reduce,
    Op.REDUCE_PROD: _reduce,
    Op.ARGMAX: _argreduce.lower_arg,
    Op.ARGMIN: _argreduce.lower_arg,
    Op.SOFTMAX: _softmax,
    Op.LAYERNORM: _layernorm,
    Op.RMSNORM: _rmsnorm,
    Op.ATTENTION: _attention,
    Op.ROPE: _rope,
    Op.GATHER: _gather,
    Op.FUSED: _fused,
    Op.CACHE_WRITE: _decode.cache_write,
    Op.KV_ATTENTION: _decode.kv_attention,
    Op.SAMPLE: _decode.sample,
    Op.PAD: _pad.lower_pad,
    Op.TOPK: _topk.lower_topk,
    Op.TF32_SPLIT: _tf32_split.lower_split,
    Op.CROSS_ENTROPY: _train.cross_entropy,
    Op.SCATTER_ADD: _train.scatter_add,
    Op.INIT: _train.init,
    Op.ADAMW: _train.adamw,
    Op.SOFTMAX_GRAD: _train.softmax_grad,
    Op.LAYERNORM_GRAD: _train.layernorm_grad,
    Op.CROSS_ENTROPY_GRAD: _train.cross_entropy_grad,
}


def lower_node(ctx: Context, node: Node, label: str) -> None:
    """Emit ``node`` as its kernel selection (passes/select_kernels.py) says."""
    from fusec.lower.choices import emit
    from fusec.passes.select_kernels import selection
    from fusec.passes.views import view_of

    sel = selection(node)
    if sel.family == "view":
        view = view_of(node)
        space, off = ctx.addr(node.inputs[0])
        if view is None or ctx.addr(node.output) != (space, off + view.byte_offset):
            raise LoweringError(f"{label}: selected as a view, but the memory plan did not place it in its input")
        ctx.count("view")
        return
    if node.op == Op.FUSED:
        ctx.count("fused_" + sel.family)  # one per fused node, whatever its launches
    if emit(ctx, node, sel, label):
        return
    fn = LOWER.get(node.op)
    if fn is None and OP_INFO[node.op].kind in (FusionKind.ELEMENTWISE, FusionKind.BROADCAST):
        fn = _elementwise_node
    if fn is None:
        raise LoweringError(f"{label}: op {node.op.value} has no GPU lowering yet (node {node.name!r})")
    fn(ctx, node, label)
