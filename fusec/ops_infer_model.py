"""Shape and dtype inference of the model-level ops (norms, packed products, attention, RoPE, the KV cache's
write, sampling, fused groups, the TF32 split); the tensor ops' rules are in ``fusec.ops_infer``, whose contract
these follow: each rule takes (attrs, input types) and returns output types, or raises ValueError with a message
that says what is inconsistent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fusec.dtypes import DType
from fusec.ops_attrs import (AttentionAttrs, CacheWriteAttrs, FusedAttrs, KVAttentionAttrs, LayerNormAttrs,
                             QGatherAttrs, QMatMulAttrs, RMSNormAttrs, RopeAttrs)
from fusec.ops_infer import TensorType, _bcast, _check_axes, _float_only


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


def _tf32_split(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
    shape, dt = t[0]
    if dt != DType.F32:
        raise ValueError(f"tf32_split takes float32, got {dt.value}")
    if len(shape) == 0:
        raise ValueError("tf32_split needs rank >= 1 (it splits the last axis)")
    return [(tuple(shape[:-1]) + (3 * shape[-1],), dt)]
