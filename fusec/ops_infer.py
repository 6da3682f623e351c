"""Shape and dtype inference, one rule per op (``fusec.ops.OP_INFO`` maps ops to them).

Each rule takes (attrs, input types) and returns output types, or raises ValueError with a
message that says what is inconsistent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fusec.dtypes import DType
from fusec.ops_attrs import (ArgAttrs, AxisAttrs, CastAttrs, CumSumAttrs, GatherNDAttrs, MatMulAttrs, PadAttrs,
                             PermAttrs, ReduceAttrs, ShapeAttrs, SliceAttrs, TileAttrs, TopKAttrs, TriluAttrs)

Shape = tuple[int, ...]
TensorType = tuple[Shape, DType]


def _same_dtype(types: Sequence[TensorType], what: str) -> DType:
    dts = {t[1] for t in types}
    if len(dts) != 1:
        raise ValueError(f"{what}: inputs must share one dtype, got {', '.join(sorted(d.value for d in dts))}")
    return types[0][1]


def _bcast(types: Sequence[TensorType]) -> Shape:
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*[t[0] for t in types]))
    except ValueError:
        raise ValueError("shapes do not broadcast: " + " vs ".join(str(list(t[0])) for t in types)) from None


def _float_only(types: Sequence[TensorType], what: str) -> None:
    for t in types:
        if not t[1].is_float:
            raise ValueError(f"{what} needs a floating-point input, got {t[1].value}")


def _unary_same(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    return [t[0]]


def _unary_float(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    _float_only(t, "op")
    return [t[0]]


def _unary_pred(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    return [(t[0][0], DType.BOOL)]


def _not(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    if t[0][1] != DType.BOOL:
        raise ValueError(f"not needs a bool input, got {t[0][1].value}")
    return [t[0]]


def _cast(a: CastAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    return [(t[0][0], a.to)]


def _binary(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    return [(_bcast(t), _same_dtype(t, "binary op"))]


def _pow(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    return [(_bcast(t), t[0][1])]  # ONNX Pow: the result has the base's dtype


def _compare(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    _same_dtype(t, "comparison")
    return [(_bcast(t), DType.BOOL)]


def _logical(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    if any(x[1] != DType.BOOL for x in t):
        raise ValueError("logical op needs bool inputs")
    return [(_bcast(t), DType.BOOL)]


def _where(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    if t[0][1] != DType.BOOL:
        raise ValueError(f"where: condition must be bool, got {t[0][1].value}")
    return [(_bcast(t), _same_dtype(t[1:], "where"))]


def _reduce(a: ReduceAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    shape, dt = t[0]
    _check_axes(a.axes, len(shape))
    if a.keepdims:
        out = tuple(1 if i in a.axes else d for i, d in enumerate(shape))
    else:
        out = tuple(d for i, d in enumerate(shape) if i not in a.axes)
    return [(out, dt)]


def _check_axes(axes: Sequence[int], rank: int) -> None:
    for ax in axes:
        if not 0 <= ax < rank:
            raise ValueError(f"axis {ax} out of range for rank {rank}")


def _axis_same(a: AxisAttrs | CumSumAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    _check_axes([a.axis], len(t[0][0]))
    return [t[0]]


def _matmul(a: MatMulAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    sa, sb = t[0][0], t[1][0]
    dt = _same_dtype(t, "matmul")
    if len(sa) == 0 or len(sb) == 0:
        raise ValueError("matmul operands must have rank >= 1")
    if a.trans_b:
        if len(sb) < 2:
            raise ValueError("matmul with trans_b needs B of rank >= 2")
        sb = tuple(sb[:-2]) + (sb[-1], sb[-2])
    if a.trans_a:
        if len(sa) < 2:
            raise ValueError("matmul with trans_a needs A of rank >= 2")
        sa = tuple(sa[:-2]) + (sa[-1], sa[-2])
    a2 = sa if len(sa) > 1 else (1,) + sa
    b2 = sb if len(sb) > 1 else sb + (1,)
    if a2[-1] != b2[-2]:
        raise ValueError(f"matmul inner dimensions differ: {list(sa)} @ {list(sb)}")
    batch = _bcast([(a2[:-2], dt), (b2[:-2], dt)])
    out = batch + (a2[-2], b2[-1])
    if len(sa) == 1:
        out = out[:-2] + out[-1:]
    if len(sb) == 1:
        out = out[:-1]
    return [(out, dt)]


def _reshape(a: ShapeAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    if int(np.prod(a.shape, dtype=np.int64)) != int(np.prod(t[0][0], dtype=np.int64)) or min(a.shape, default=1) < 0:
        raise ValueError(f"cannot reshape {list(t[0][0])} to {list(a.shape)}")
    return [(tuple(a.shape), t[0][1])]


def _transpose(a: PermAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    shape = t[0][0]
    if sorted(a.perm) != list(range(len(shape))):
        raise ValueError(f"perm {list(a.perm)} is not a permutation of rank {len(shape)}")
    return [(tuple(shape[p] for p in a.perm), t[0][1])]


def _expand(a: ShapeAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    out = _bcast([t[0], (a.shape, t[0][1])])
    if out != tuple(a.shape):
        raise ValueError(f"expand target {list(a.shape)} is not the broadcast result {list(out)}")
    return [(out, t[0][1])]


def _concat(a: AxisAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    dt = _same_dtype(t, "concat")
    rank = len(t[0][0])
    _check_axes([a.axis], rank)
    for x in t:
        if len(x[0]) != rank or any(x[0][i] != t[0][0][i] for i in range(rank) if i != a.axis):
            raise ValueError("concat inputs differ outside the concat axis: " + ", ".join(str(list(x[0])) for x in t))
    out = list(t[0][0])
    out[a.axis] = sum(x[0][a.axis] for x in t)
    return [(tuple(out), dt)]


def _slice(a: SliceAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    out = list(t[0][0])
    _check_axes(a.axes, len(out))
    for ax, s, e, st in zip(a.axes, a.starts, a.ends, a.steps):
        out[ax] = len(range(s, e, st))
    return [(tuple(out), t[0][1])]


def _gather(a: AxisAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (sd, dd), (si, di) = t[0], t[1]
    _check_axes([a.axis], len(sd))
    if not di.is_int:
        raise ValueError(f"gather indices must be integers, got {di.value}")
    return [(sd[: a.axis] + tuple(si) + sd[a.axis + 1:], dd)]


def _int_indices(op: str, dt: DType) -> None:
    if not dt.is_int:
        raise ValueError(f"{op} indices must be integers, got {dt.value}")


def _gather_elements(a: AxisAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (sd, _), (si, di) = t[0], t[1]
    if len(sd) != len(si):
        raise ValueError("gather_elements: data and indices must have the same rank")
    _check_axes([a.axis], len(sd))
    _int_indices("gather_elements", di)
    for d, (n, m) in enumerate(zip(si, sd)):
        if d != a.axis and n > m:
            raise ValueError(f"gather_elements: indices dim {d} is {n}, beyond the data's {m}")
    return [(si, t[0][1])]


def _gather_nd(a: GatherNDAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (sd, dd), (si, di) = t[0], t[1]
    _int_indices("gather_nd", di)
    b = a.batch_dims
    if not si or b >= min(len(sd), len(si)):
        raise ValueError(f"gather_nd: batch_dims {b} must be below the ranks of data ({len(sd)}) and indices "
                         f"({len(si)})")
    if tuple(si[:b]) != tuple(sd[:b]):
        raise ValueError(f"gather_nd: the batch dims of data {list(sd[:b])} and indices {list(si[:b])} differ")
    last = si[-1]
    if b + last > len(sd):
        raise ValueError("gather_nd: index tuples longer than the data rank")
    return [(tuple(si[:-1]) + tuple(sd[b + last:]), dd)]


def _scatter_nd(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    (sd, dd), (si, di), (su, du) = t
    _int_indices("scatter_nd", di)
    if not si or si[-1] > len(sd):
        raise ValueError(f"scatter_nd: index tuples of length {si[-1] if si else '?'} for data of rank {len(sd)}")
    want = tuple(si[:-1]) + tuple(sd[si[-1]:])
    if tuple(su) != want or du != dd:
        raise ValueError(f"scatter_nd: updates must be {dd.value}{list(want)}, got {du.value}{list(su)}")
    return [t[0]]


def _tile(a: TileAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    if len(a.repeats) != len(t[0][0]):
        raise ValueError("tile: repeats must have one entry per axis")
    return [(tuple(d * r for d, r in zip(t[0][0], a.repeats)), t[0][1])]


def _trilu(a: TriluAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    if len(t[0][0]) < 2:
        raise ValueError("trilu needs rank >= 2")
    return [t[0]]


def _unary_numeric(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    if t[0][1] == DType.BOOL:
        raise ValueError("op needs a numeric input, got bool")
    return [t[0]]


def _int_only(types: Sequence[TensorType], what: str) -> None:
    for x in types:
        if not x[1].is_int:
            raise ValueError(f"{what} needs integer inputs, got {x[1].value}")


def _unary_int(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    _int_only(t, "bitwise op")
    return [t[0]]


def _binary_int(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    _int_only(t, "bitwise op")
    return _binary(a, t)


def _binary_numeric(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    if any(x[1] == DType.BOOL for x in t):
        raise ValueError("op needs numeric inputs, got bool")
    return _binary(a, t)


def _arg(a: ArgAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    shape = t[0][0]
    _check_axes([a.axis], len(shape))
    if shape[a.axis] == 0:
        raise ValueError(f"arg max/min over axis {a.axis} of length 0")
    if a.keepdims:
        out = tuple(1 if i == a.axis else d for i, d in enumerate(shape))
    else:
        out = tuple(d for i, d in enumerate(shape) if i != a.axis)
    return [(out, DType.I64)]


def _topk(a: TopKAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    shape = t[0][0]
    _check_axes([a.axis], len(shape))
    if a.k > shape[a.axis]:
        raise ValueError(f"topk k={a.k} is larger than axis {a.axis} ({shape[a.axis]} elements)")
    if t[0][1] == DType.BOOL:
        raise ValueError("topk needs a numeric input, got bool")
    return [(tuple(a.k if i == a.axis else d for i, d in enumerate(shape)), DType.I64)]


def _pad(a: PadAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    shape, dt = t[0]
    rank = len(shape)
    if len(a.pads) != 2 * rank:
        raise ValueError(f"pad needs {2 * rank} pads for rank {rank}, got {len(a.pads)}")
    out = []
    for i, d in enumerate(shape):
        b, e = a.pads[i], a.pads[rank + i]
        kept = d + min(b, 0) + min(e, 0)
        if kept < 0:
            raise ValueError(f"pads ({b}, {e}) remove more than axis {i} holds ({d})")
        if a.mode != "constant" and (b > 0 or e > 0) and kept == 0:
            raise ValueError(f"{a.mode} padding of axis {i}, which is empty")
        if a.mode == "reflect" and max(b, e) > kept - 1 and kept > 1:
            raise ValueError(f"reflect pads ({b}, {e}) exceed axis {i} ({kept} elements) less one")
        out.append(d + b + e)
    if len(t) == 2:
        if t[1][1] != dt or int(np.prod(t[1][0], dtype=np.int64)) != 1:
            raise ValueError(f"pad value must be one {dt.value} element, got {t[1][1].value}{list(t[1][0])}")
        if a.mode != "constant":
            raise ValueError(f"a pad value is given, but the mode is {a.mode}")
    return [(tuple(out), dt)]
