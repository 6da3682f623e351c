"""Lowering of QMATMUL and QGATHER (products over, and rows of, a packed quantized weight, ``fusec.quant``): the
launches that kernel selection's record asks for (``fusec.lower.quant``'s rules made it). A quantized GEMV
(``QGemvSpec``), the dequantize-in-tile GEMM (``QGemmSpec``), or the weight dequantized into arena scratch a block of
rows at a time (at most ``SCRATCH_BYTES``) and multiplied there by cuBLAS (``QDequantSpec`` + a GEMM reading the block
through its transpose flag, writing its columns of the output). Each product's variant is counted in
``ctx.counts["qmatmul:<variant>"]`` (the lowering report's ``by_template``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fusec.codegen.specs import Epilogue
from fusec.codegen.specs_quant import QDequantSpec, QGemmSpec, QGemvSpec
from fusec.ir import Node, Value
from fusec.lower import Context, LoweringError, Raw
from fusec.quant import FORMATS

SCRATCH_BYTES = 32 << 20  # the prefill's dequantized block of a weight


def scale_dtype(fmt: str, packed: Any) -> Any:
    """The scale dtype of a product's packed operands (``fusec.quant`` order: codes, [high words], scales, ...)."""
    return packed[2 if FORMATS[fmt].high_words else 1].dtype


def emit_qgemv(ctx: Context, spec: QGemvSpec, x: Value, packed: Any, between: list[Value], extra: Any, out: Any,
               label: str, after: Sequence[Any] = (), what: str = "qgemv") -> None:
    """One quantized-GEMV launch: x, the packed operands (with siblings, each product's in turn), ``between`` (the
    norm weight), the epilogue's ``extra`` operands, out (all 16-byte aligned: its vector loads), then ``after``:
    the siblings' outputs, or with ``spec.argmax`` the sampler's seed, counter and temperature and the partials
    written. ``what`` ends the launch's label."""
    outs = (out, *after) if spec.siblings else (out,)
    mine = [v for v in outs if isinstance(v, Value)]  # a Raw out is scratch: the arena's alignment
    if not (ctx.aligned(x, *mine, *extra) and all(ctx.aligned(p) for p in packed)):
        raise LoweringError(f"{label}: the quantized GEMV was selected, but its operands are not 16-byte "
                            "aligned in the memory plan")
    ctx.kernel(spec, [x, *packed, *between, *extra, out, *after], f"{label} {what}")
    ctx.count("qmatmul:qgemv")


def lower_qmatmul(ctx: Context, node: Node, sel: Any, label: str, epilogue: Epilogue | None = None,
                  extra: tuple[Value, ...] = ()) -> bool:
    """Emit ``node`` (a QMATMUL over outer values) as kernel selection's record ``sel`` says (its
    variant and the GEMV's form). With ``epilogue`` (its ``extra`` operands: [bias], [residual]) the
    product fuses it when the GEMV runs it; returns whether it did (the caller then applies the
    epilogue itself)."""
    x, packed, out = node.inputs[0], node.inputs[1:], node.outputs[0]
    a = node.attrs
    m = math.prod(x.shape[:-1])
    sdt = scale_dtype(a.format, packed)
    if sel.variant == "qgemv":
        spec = QGemvSpec(m, a.n, a.k, a.format, a.group, x.dtype, sdt, epilogue or Epilogue(), **dict(sel.params))
        emit_qgemv(ctx, spec, x, packed, [], extra, out, label)
        return epilogue is not None
    if sel.variant == "qgemm":
        spec = QGemmSpec(m, a.n, a.k, a.format, a.group, x.dtype, sdt, epilogue or Epilogue(), **dict(sel.params))
        if not (ctx.aligned(x) and all(ctx.aligned(p) for p in packed)):
            raise LoweringError(f"{label}: the dequantize-in-tile GEMM was selected, but x or the packed operands "
                                "are not 16-byte aligned in the memory plan")
        ctx.kernel(spec, [x, *packed, *extra, out], f"{label} qgemm")
        ctx.count("qmatmul:qgemm")
        return epilogue is not None
    _dequant_gemm(ctx, x, packed, out, a, sdt, m, label)
    ctx.count("qmatmul:dequant_gemm")
    return False


def _dequant_gemm(ctx: Context, x: Value, packed: tuple[Value, ...], out: Value, a: Any, scale_dtype: Any,
                  m: int, label: str) -> None:
    from fusec.lower.nodes import gemm_compute

    item = x.dtype.itemsize
    rows = max(16, min(a.n, SCRATCH_BYTES // (a.k * item)) // 16 * 16)
    rows = min(rows, a.n)
    base = ctx.scratch(rows * a.k * item)
    for r0 in range(0, a.n, rows):
        r = min(rows, a.n - r0)
        ctx.kernel(QDequantSpec(a.n, a.k, a.format, a.group, x.dtype, scale_dtype, r0, r), [*packed, base],
                   f"{label} dequantize rows {r0}..{r0 + r}")
        fields = {"m": m, "n": r, "k": a.k, "batch": 1, "lda": a.k, "ldb": a.k, "ldc": a.n, "stride_a": 0,
                  "stride_b": 0, "stride_c": 0, "trans_a": False, "trans_b": True, "dtype": x.dtype.value,
                  "compute": gemm_compute(ctx, None, x.dtype)}
        ctx.gemm(fields, x, packed[0], (out, r0), label)
        ctx.launches[-1]["b"] = ctx.ptr(Raw(base.space, base.offset))[1:]  # the dequantized block in scratch


def lower_node(ctx: Context, node: Node, label: str) -> None:
    """``LOWER[Op.QMATMUL]``: a plain product (no epilogue)."""
    from fusec.passes.select_kernels import selection

    lower_qmatmul(ctx, node, selection(node), label)


def lower_gather(ctx: Context, node: Node, label: str) -> None:
    """``LOWER[Op.QGATHER]``: the rows of a packed table, dequantized by the same kernel as the prefill's."""
    ids, packed, out, a = node.inputs[0], node.inputs[1:], node.outputs[0], node.attrs
    if not ctx.aligned(out) or not all(ctx.aligned(p) for p in packed):
        raise LoweringError(f"{label}: qgather's output and table must be 16-byte aligned (the kernel's vector stores)")
    spec = QDequantSpec(a.n, a.k, a.format, a.group, out.dtype, scale_dtype(a.format, packed), ids=ids.numel,
                        id_dtype=ids.dtype)
    ctx.kernel(spec, [ids, *packed, out], f"{label} qgather")


def lower_fused(ctx: Context, node: Node, mm: Node, outer: dict[Value, Value], label: str) -> bool:
    """A gemm_epilogue group whose product is a QMATMUL: one GEMV with the epilogue when the chain
    is [+ bias] [activation] [+ residual] (``fusec.lower.choices``'s parse) and the GEMV runs;
    False: the product was emitted alone and the caller applies the epilogue."""
    from fusec.lower.choices import _epilogue
    from fusec.passes.select_kernels import selection

    sel = selection(node)
    q = Node(mm.op, [outer[v] for v in mm.inputs], [node.outputs[0]], mm.attrs, mm.name)
    parsed = _epilogue(node.attrs.body)
    if parsed is None:
        lower_qmatmul(ctx, q, sel, label)
        return False
    bias, act, res = parsed
    epi = Epilogue(bias=bias is not None, activation=act, residual=res is not None)
    extra = tuple(outer[v] for v in (bias, res) if v is not None)
    return lower_qmatmul(ctx, q, sel, label, epi, extra)
