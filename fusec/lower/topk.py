"""GPU lowering of ``Op.TOPK`` (the int64 indices; the importer's GATHER_ELEMENTS takes the values):
one launch of the top-k kernel (fusec.codegen.build_topk, templates/topk.cu.jinja), one block per
row along the axis. k above ``MAX_K`` (the per-thread candidate lists live in registers) is refused
in one line; the reference backend runs it."""

from __future__ import annotations

import math

from fusec.codegen.build_topk import MAX_K, TopKSpec
from fusec.dtypes import DType
from fusec.ir import Node
from fusec.lower import Context, LoweringError


def lower_topk(ctx: Context, node: Node, label: str) -> None:
    x, out, a = node.inputs[0], node.output, node.attrs
    if out.numel == 0:
        return
    if not (x.dtype.is_float or x.dtype in (DType.I64, DType.I32)):
        raise LoweringError(f"{label}: topk of {x.dtype.value} has no GPU lowering")
    if a.k > MAX_K:
        raise LoweringError(f"{label}: topk with k={a.k} has no GPU lowering (at most {MAX_K}: the kernel keeps "
                            f"k candidates per thread in registers); it runs on the reference backend")
    outer, cols, inner = math.prod(x.shape[:a.axis]), x.shape[a.axis], math.prod(x.shape[a.axis + 1:])
    if cols >= 2**31:
        raise LoweringError(f"{label}: topk along an axis of {cols} elements (2**31 or more) has no GPU lowering")
    ctx.kernel(TopKSpec(outer, cols, inner, a.k, x.dtype, bool(a.largest)), [x, out], label)
