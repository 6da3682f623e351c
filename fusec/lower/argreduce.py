"""ARGMAX / ARGMIN on the GPU from existing kernels (no arg-reduce template), exact:

1. ``iota``: 0..n-1 along the axis (ones, then an exclusive cumsum, int64);
2. ``m``: the row maximum (the row-reduce max kernel; for ARGMIN over the order-reversed input,
   -x for floats and ~x for integers, both exact);
3. one elementwise kernel: ``t = hit ? key(iota) : sentinel`` where ``hit`` is ``x == m`` (or x is
   NaN: a NaN is the extremum, as numpy's argmax says); the first index is wanted as the largest
   ``~iota`` (``~`` reverses the order), the last one as the largest ``iota``;
4. the row-reduce max of ``t`` into the output, then ``~`` back in place for the first index.

Six launches (seven for ARGMIN), scratch of about three int64 copies of the input.

Step 2 needs numpy's max, NaN included: a row holding a NaN and numbers must give NaN as ``m``, or
step 3 marks both the NaNs and the largest number and the smaller index of the two wins. The
row-reduce max kernel once folded its warps with ``fmaxf`` (which drops a NaN): on the H100
(2026-11-23) that gave wrong indices for 24 of 32 cases of
tests/test_lowering_broadcast.py::test_arg_reduce_on_the_gpu, while the numpy emulation, whose max
keeps NaN, agreed. The kernel now folds with ``fc_max`` at every stage (templates/row_reduce.cu.jinja).
"""

from __future__ import annotations

import math

from fusec.codegen import elementwise as E
from fusec.codegen import specs as S
from fusec.dtypes import DType
from fusec.ir import Node
from fusec.ops import Op

ENABLED = True  # a switch for the GPU path; see the module docstring


def lower_arg(ctx, node: Node, label: str) -> None:  # noqa: ANN001 (fusec.lower.Context; avoids an import cycle)
    from fusec.lower import LoweringError, Raw

    x, out, a = node.inputs[0], node.output, node.attrs
    if not ENABLED:
        raise LoweringError(f"{label}: {node.op.value} has no GPU lowering (switched off: "
                            f"fusec.lower.argreduce.ENABLED); it runs on the reference backend")
    if not (x.dtype.is_float or x.dtype.is_int):
        raise LoweringError(f"{label}: {node.op.value} of {x.dtype.value} has no GPU lowering")
    outer, cols, inner = math.prod(x.shape[:a.axis]), x.shape[a.axis], math.prod(x.shape[a.axis + 1:])
    n, rows = x.numel, outer * inner
    sizes = [x.nbytes, 8 * n, 8 * n, x.dtype.itemsize * rows, 8 * n]  # flipped x, ones, iota, m, t
    offs, acc = [], 0
    for sz in sizes:
        offs.append(acc)
        acc += -(-sz // 256) * 256
    base = ctx.scratch(acc)
    flipped, ones, iota, m, t = (Raw(base.space, base.offset + o) for o in offs)
    src = x
    if node.op == Op.ARGMIN:  # argmin(x) = argmax(reversed x)
        flip = E.Apply(Op.NEG if x.dtype.is_float else Op.BITWISE_NOT, (E.In(0),))
        ctx.kernel(S.elementwise_spec(flip, [x.shape], [x.dtype], x.shape, vectorize=False), [x, flipped],
                   f"{label} reverse order")
        src = flipped
    ctx.kernel(S.elementwise_spec(E.Const(1, DType.I64), [], [], x.shape, vectorize=False), [ones], f"{label} ones")
    ctx.kernel(S.CumsumSpec(outer, cols, inner, DType.I64, exclusive=True), [ones, iota], f"{label} iota")
    ctx.kernel(S.RowReduceSpec("max", outer, cols, x.dtype, inner=inner), [src, m], f"{label} max")
    hit: E.Expr = E.Apply(Op.EQUAL, (E.In(0), E.In(1)))
    if x.dtype.is_float:
        hit = E.Apply(Op.OR, (hit, E.Apply(Op.ISNAN, (E.In(0),))))
    last = bool(a.select_last_index)
    key: E.Expr = E.In(2) if last else E.Apply(Op.BITWISE_NOT, (E.In(2),))
    miss = E.Const(-1 if last else ~cols, DType.I64)  # below every key: ~cols < ~(cols - 1)
    m_shape = x.shape[:a.axis] + (1,) + x.shape[a.axis + 1:]
    spec = S.elementwise_spec(E.Apply(Op.WHERE, (hit, key, miss)), [x.shape, m_shape, x.shape],
                              [x.dtype, x.dtype, DType.I64], x.shape, vectorize=False)
    ctx.kernel(spec, [src, m, iota, t], f"{label} hits")
    ctx.kernel(S.RowReduceSpec("max", outer, cols, DType.I64, inner=inner), [t, out], label)
    if not last:
        back = E.Apply(Op.BITWISE_NOT, (E.In(0),))
        ctx.kernel(S.elementwise_spec(back, [out.shape], [DType.I64], out.shape, vectorize=False), [out, out],
                   f"{label} first index")
