"""Shape and dtype inference, one rule per op (``fusec.ops.OP_INFO`` maps ops to them).

Each rule takes (attrs, input types) and returns output types, or raises ValueError with a
message that says what is inconsistent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fusec.dtypes import DType
from fusec.ops_attrs import (ArgAttrs, AttentionAttrs, AxisAttrs, CacheWriteAttrs, CastAttrs, CumSumAttrs,
                             FusedAttrs, GatherNDAttrs, KVAttentionAttrs, LayerNormAttrs, MatMulAttrs, PadAttrs,
                             PermAttrs, QGatherAttrs, QMatMulAttrs, ReduceAttrs, RMSNormAttrs, RopeAttrs, ShapeAttrs,
                             SliceAttrs, TileAttrs, TopKAttrs, TriluAttrs)

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


def _layernorm(a: LayerNormAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    shape, dt = t[0]
    _float_only(t[:1], "layernorm")
    _check_axes([a.axis], len(shape))
    norm_shape = shape[a.axis:]
    for extra in t[1:]:
        if tuple(np.broadcast_shapes(extra[0], norm_shape)) != tuple(norm_shape):
            raise ValueError(f"layernorm scale/bias shape {list(extra[0])} does not fit {list(norm_shape)}")
    return [t[0]]


def _rmsnorm(a: RMSNormAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (shape, _), (wshape, wdt) = t[0], t[1]
    _float_only(t, "rmsnorm")
    if tuple(wshape) != (shape[-1],):
        raise ValueError(f"rmsnorm weight shape {list(wshape)} must be [{shape[-1]}]")
    return [(shape, wdt)]  # HF: weight * x.to(input_dtype); weight dtype wins


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


def _qmatmul(a: QMatMulAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    from fusec.quant import check_operands, get_format

    (sx, dx), packed = t[0], t[1:]
    _float_only([t[0]], "qmatmul")
    if len(sx) < 1 or sx[-1] != a.k:
        raise ValueError(f"qmatmul: x {list(sx)} must end in K={a.k}")
    check_operands(get_format(a.format), a.n, a.k, a.group, packed)
    return [(tuple(sx[:-1]) + (a.n,), dx)]


def _qgather(a: QGatherAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    from fusec.quant import check_operands, get_format

    (si, di), packed = t[0], t[1:]
    if di not in (DType.I32, DType.I64):
        raise ValueError(f"qgather ids must be int32/int64, got {di.value}")
    check_operands(get_format(a.format), a.n, a.k, a.group, packed)
    return [(tuple(si) + (a.k,), a.out_dtype)]


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


def _attention(a: AttentionAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (sq, _), (sk, _), (sv, dv) = t[0], t[1], t[2]
    _float_only(t[:3], "attention")
    if not (len(sq) == len(sk) == len(sv) == 4):
        raise ValueError(f"attention needs rank-4 q/k/v [B,H,S,D], got {list(sq)}, {list(sk)}, {list(sv)}")
    if sk[:3] != sv[:3] or sq[0] != sk[0] or sq[3] != sk[3]:
        raise ValueError(f"attention q/k/v shapes disagree: {list(sq)}, {list(sk)}, {list(sv)}")
    if sk[1] == 0 or sq[1] % sk[1]:
        raise ValueError(f"attention: {sq[1]} query heads is not a multiple of {sk[1]} kv heads")
    full = (sq[0], sq[1], sq[2], sk[2])
    if len(t) == 4 and _bcast([t[3], (full, t[3][1])]) != full:
        raise ValueError(f"attention mask {list(t[3][0])} does not broadcast to {list(full)}")
    return [((sq[0], sq[1], sq[2], sv[3]), dv)]


def _rope(a: RopeAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    shape = t[0][0]
    _float_only(t, "rope")
    rd = a.rotary_dim
    if not shape or rd <= 0 or rd % 2 or rd > shape[-1]:
        raise ValueError(f"rope rotary_dim {rd} must be even and in (0, {shape[-1] if shape else 0}]")
    rot = shape[:-1] + (rd,)
    for c in t[1:]:
        if _bcast([c, (rot, c[1])]) != rot:
            raise ValueError(f"rope cos/sin {list(c[0])} does not broadcast to {list(rot)}")
    return [t[0]]


def _cache_write(a: CacheWriteAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (sc, dc), (sn, dn), (sp, dp) = t[:3]
    if dc != dn:
        raise ValueError(f"cache_write: cache is {dc.value}, new values are {dn.value}")
    if not 1 <= a.axis < len(sc) or len(sn) != len(sc):
        raise ValueError(f"cache_write: axis {a.axis} must be in [1, {len(sc)}) and new {list(sn)} must have "
                         f"the cache's rank {len(sc)}")
    rows = sc[0]  # the rows new has: the cache's, or one per destination in ``rows``
    if len(t) == 4:
        sr, dr = t[3]
        if not dr.is_int or len(sr) != 1:
            raise ValueError(f"cache_write: rows must be integers of shape [N], got {dr.value}{list(sr)}")
        rows = sr[0]
    if not dp.is_int or tuple(sp) != (rows,):
        raise ValueError(f"cache_write: positions must be integers of shape [{rows}], got {dp.value}{list(sp)}")
    if sn[0] != rows or any(x != y for i, (x, y) in enumerate(zip(sc, sn)) if i not in (0, a.axis)) \
            or sn[a.axis] > sc[a.axis]:
        raise ValueError(f"cache_write: new {list(sn)} does not fit cache {list(sc)} along axis {a.axis}")
    return [(sc, dc)]


def _kv_attention(a: KVAttentionAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (sq, dq), (sk, dk), (sv, dv), (sp, dp) = t
    _float_only(t[:3], "kv_attention")
    if not (len(sq) == len(sk) == len(sv) == 4) or sk != sv or sq[0] != sk[0] or sq[3] != sk[3]:
        raise ValueError(f"kv_attention needs q [B,Hq,S,D] and k/v caches [B,Hkv,T,D], got {list(sq)}, "
                         f"{list(sk)}, {list(sv)}")
    if sk[1] == 0 or sq[1] % sk[1]:
        raise ValueError(f"kv_attention: {sq[1]} query heads is not a multiple of {sk[1]} kv heads")
    if not dp.is_int or tuple(sp) != (sq[0],):
        raise ValueError(f"kv_attention: positions must be integers of shape [{sq[0]}], got {dp.value}{list(sp)}")
    return [(sq, dq)]


def _sample(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    (sl, dl), *rest = t
    _float_only(t[:1], "sample")
    if len(sl) != 2 or sl[1] < 1:
        raise ValueError(f"sample needs logits [B, V], got {list(sl)}")
    rows = (sl[0],)
    kinds = (("seed", "an integer"), ("counter", "an integer"), ("temperature", "a float32"),
             ("top_k", "an integer"), ("top_p", "a float32"))
    for (name, kind), (s, d) in zip(kinds, rest):
        ok = d.is_int if kind == "an integer" else d == DType.F32
        if not ok or tuple(s) != rows:
            raise ValueError(f"sample needs {kind} {name} [{sl[0]}] (one per row), got {d.value}{list(s)}")
    return [(rows, DType.I64)]


def _fused(a: FusedAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    body = a.body
    want = [(v.shape, v.dtype) for v in body.inputs]
    if [(tuple(s), d) for s, d in t] != want:
        raise ValueError("fused node inputs do not match its body's inputs")
    return [(v.shape, v.dtype) for v in body.outputs]


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


def _tf32_split(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    shape, dt = t[0]
    if dt != DType.F32:
        raise ValueError(f"tf32_split takes float32, got {dt.value}")
    if len(shape) == 0:
        raise ValueError("tf32_split needs rank >= 1 (it splits the last axis)")
    return [(tuple(shape[:-1]) + (3 * shape[-1],), dt)]


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
