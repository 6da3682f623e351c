"""Fused nodes lowered (``lower_fused``): each body as the one kernel its plan names
(``fusec.lower.fused_plan.kernel_plan``, recorded by kernel selection), and the attention's
emission through its operands' views (``emit_attention``).
"""

from __future__ import annotations

import math
from typing import Any

from fusec.codegen import specs as S
from fusec.codegen.elementwise import Apply, Const, In
from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value
from fusec.lower import Context, LoweringError, Raw
from fusec.lower import layout as L
from fusec.lower.fused_plan import IndexedExpr
from fusec.ops import Op


def lower_fused(ctx: Context, node: Node, label: str) -> None:
    from fusec.lower import nodes as N
    from fusec.passes.select_kernels import selection

    body: Graph = node.attrs.body
    sel = selection(node)  # the family and plan passes/select_kernels.py chose
    kind, detail = ("gemm_epilogue" if sel.family in ("gemm_epilogue", "cublas") else sel.family), sel.detail
    outer = dict(zip(body.inputs, node.inputs))
    outer.update({c: c for c in body.constants})
    label = f"{label} fused[{node.attrs.rule}]"
    if kind == "elementwise":
        _emit_indexed(ctx, detail, outer, node.outputs, label)
    elif kind == "gemm_epilogue":
        mm, iexpr = detail
        outer[mm.output] = node.output
        from fusec.lower import quant_emit

        if mm.op == Op.QMATMUL:  # the quantized GEMV fuses what it can (fusec.lower.quant)
            fused = quant_emit.lower_fused(ctx, node, mm, outer, label)
        else:
            N.matmul(ctx, Node(Op.MATMUL, [outer[x] for x in mm.inputs], [node.output], mm.attrs), label)  # cuBLAS
            fused = False
        if not fused:
            _emit_indexed(ctx, iexpr, outer, [node.output], label + " epilogue")
    elif kind == "attention":
        emit_attention(ctx, detail, node, label)
    elif kind == "head_rope":
        from fusec.lower import heads

        heads.emit(ctx, detail, node, label)
    elif kind == "kv_attention_heads":
        from fusec.lower import decode

        decode.kv_attention_heads(ctx, node, detail, label)
    elif kind in ("gemv", "gemm_glu"):  # the skinny family's plan: the GEMV, or a gated unit on the wgmma GEMM
        from fusec.lower import skinny

        skinny.emit(ctx, detail, node, label)
    elif kind == "mlp":
        from fusec.lower import mlp

        mlp.emit(ctx, detail, node, label)
    elif kind == "rope":
        rope, xi, xview, cst = detail
        cos, sin = (outer[v] for v in rope.inputs[1:])
        out = node.output
        B, H, S_, D = out.shape
        spec = S.RopeSpec(B, H, S_, D, rope.attrs.rotary_dim, out.dtype, xview.strides[:3],  # type: ignore[arg-type]
                          L.View.contiguous(out.shape).strides[:3], (cst.strides[0], cst.strides[2]), cos.dtype)  # type: ignore[arg-type]
        ctx.kernel(spec, [(node.inputs[xi], xview.offset), cos, sin, out], label)
    elif kind == "add_norm":
        add, norm = detail
        x, res = (outer[v] for v in add.inputs)
        out = node.outputs[body.outputs.index(norm.output)]
        # the row kernel always writes the sum: to the node's output when it is one, else to scratch
        sum_out: Value | Raw = (node.outputs[body.outputs.index(add.output)] if add.output in body.outputs
                                else ctx.scratch(add.output.nbytes))
        w = [outer[v] for v in norm.inputs[1:]]
        cols = _norm_cols(norm)
        kind_ = "add_layernorm" if norm.op == Op.LAYERNORM else "add_rmsnorm"
        extra = {"has_bias": len(w) > 1} if norm.op == Op.LAYERNORM else {"weight_offset": float(norm.attrs.weight_offset)}
        spec = S.RowReduceSpec(kind_, x.numel // cols, cols, x.dtype, w_dtype=w[0].dtype, eps=float(norm.attrs.eps), **extra)
        ctx.kernel(spec, [x, res, *w, sum_out, out], label)


def _norm_cols(norm: Node) -> int:
    x = norm.inputs[0]
    return x.numel // math.prod(x.shape[: norm.attrs.axis]) if norm.op == Op.LAYERNORM else x.shape[-1]


def _emit_indexed(ctx: Context, ie: IndexedExpr, outer: dict[Value, Value], outs: list[Value], label: str) -> None:
    """One elementwise kernel writing ``outs`` (``ie.expr``, then ``ie.more``, all of outs[0]'s shape)."""
    vals = [outer.get(v, v) for v, _, _ in ie.operands]
    out = outs[0]
    if ie.plain and not ie.more:  # standard broadcasting only: let the spec merge dims and vectorize
        from fusec.lower.nodes import elementwise

        elementwise(ctx, ie.expr, vals, out, label)
        return
    shape = out.shape if out.shape else (1,)
    operands = tuple(S.Operand(v.dtype, st if out.shape else (0,)) for v, (_, st, _) in zip(vals, ie.operands))
    offs = [off for _, _, off in ie.operands]
    more = tuple(zip(ie.more, (o.dtype for o in outs[1:])))
    spec = S.ElementwiseSpec(ie.expr, shape, operands, out.dtype, _indexed_vec(ctx, shape, operands, vals, offs, outs),
                             more)
    ctx.kernel(spec, [*zip(vals, offs), *outs], label)


def _indexed_vec(ctx: Context, shape: tuple[int, ...], operands: tuple[S.Operand, ...], vals: list[Value],
                 offs: list[int], outs: list[Value]) -> int:
    """Outputs a thread takes a step in an indexed chain (views: a gated unit's halves, slices): the elementwise
    rule (``specs.vector_width``) where each vector operand's address and offset, and the output's, are aligned
    to its vectors. One element a thread, 2-byte loads, had taken a 2,048-token prefill's SwiGLU (Qwen3-0.6B,
    [2048, 6144] halves) 30.6 us for 37.7 MB (H200)."""
    def fits(vec: int) -> bool:
        return all(ctx.aligned(o, to=vec * o.dtype.itemsize) for o in outs) and all(
            op.strides[-1] == 0 or (off % vec == 0 and ctx.aligned(v, to=vec * op.dtype.itemsize))
            for op, v, off in zip(operands, vals, offs))

    return S.vector_width(shape, [op.strides for op in operands],
                          [op.dtype.itemsize for op in operands] + [o.dtype.itemsize for o in outs], fits)


def emit_attention(ctx: Context, plan: dict[str, Any], node: Node, label: str) -> None:
    """The one attention lowering: q/k/v/mask read and the output written through ``plan``'s views
    (contiguous for a standalone node), then torch's SDPA nan_to_zero guard when asked for; the block shape is the
    kernel selection's (``node.kernel.params``)."""
    from fusec.passes.select_kernels import selection

    a: Node = plan["node"]
    (qi, qv), (ki, kv), (vi, vv) = plan["operands"][:3]
    B, Hq, S_, D = qv.shape
    Hkv, T = kv.shape[1], kv.shape[2]
    ins = node.inputs
    args: list[Any] = [(ins[qi], qv.offset), (ins[ki], kv.offset), (ins[vi], vv.offset)]
    mkind, mdt, mst = "none", None, (0, 0, 0, 0)
    mask_vec = False  # the mask's rows contiguous and 16-byte aligned, where its view starts included
    if len(plan["operands"]) > 3:
        mi, mview = plan["operands"][3]
        full = L.broadcast_to(mview, (B, Hq, S_, T))
        if full is None:
            raise LoweringError(f"{label}: attention mask does not broadcast")
        mask = ins[mi]
        mkind = "bool" if mask.dtype == DType.BOOL else "additive"
        mdt, mst = mask.dtype, full.strides
        args.append((mask, mview.offset))
        mask_vec = ctx.aligned(mask) and S.mask_rows_16(mst, mdt, mview.offset)
    ov = plan["out"]
    args.append((node.output, ov.offset))
    spec = S.AttentionSpec(B, Hq, Hkv, S_, T, D, ins[qi].dtype, float(a.attrs.scale), causal=bool(a.attrs.causal),
                           mask=mkind, mask_dtype=mdt, mask_strides=mst,  # type: ignore[arg-type]
                           q_strides=qv.strides[:3], k_strides=kv.strides[:3], v_strides=vv.strides[:3],  # type: ignore[arg-type]
                           o_strides=ov.strides[:3],  # type: ignore[arg-type]
                           fp32_math="tf32" if ctx.compute == "tf32" and D <= 128 else "",
                           softcap=float(a.attrs.softcap), mask_vec=mask_vec, **dict(selection(node).params))
    ctx.kernel(spec, args, label)
    if a.attrs.nan_to_zero:  # torch's SDPA export zeroes fully masked rows; the kernel gives NaN there
        from fusec.lower.nodes import elementwise

        out = node.output
        fix = Apply(Op.WHERE, (Apply(Op.ISNAN, (In(0),)), Const(0.0, out.dtype), In(0)))
        elementwise(ctx, fix, [out], out, label + " nan_to_zero")
