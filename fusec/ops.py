"""fusec's one op vocabulary: a closed ``Op`` enum, a typed frozen attribute record per op, and
one table per concern keyed by ``Op`` (shape/dtype inference and fusion kind here; the numpy
reference in ``fusec.reference``; CUDA expressions in the codegen).

ONNX ``op_type`` strings never appear outside the frontend. Every node has one or more outputs;
most ops have exactly one. Attribute values are normalized at construction time (axes
non-negative, shapes fully resolved) so that passes and backends never re-derive them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fusec.dtypes import DType

Shape = tuple[int, ...]
TensorType = tuple[Shape, DType]


class FusionKind(enum.IntEnum):
    """TVM's OpPatternKind: what a fusion rule may assume about an op. Fusion tests kinds, never names."""

    ELEMENTWISE = 0  # out[i] = f(in[i]) with identical shapes
    BROADCAST = 1  # out[i] = f(in[bcast(i)])
    INJECTIVE = 2  # a view or index remapping (reshape, transpose, slice, gather, concat)
    REDUCE = 3  # reduction along some axes (norms, softmax, sums)
    GEMM = 4  # matrix product: elementwise epilogues can fuse into it
    OPAQUE = 5  # anything else


class Op(enum.Enum):
    # elementwise, unary
    NEG = "neg"
    ABS = "abs"
    EXP = "exp"
    LOG = "log"
    SQRT = "sqrt"
    RECIPROCAL = "reciprocal"
    ERF = "erf"
    TANH = "tanh"
    SIGMOID = "sigmoid"
    RELU = "relu"
    COS = "cos"
    SIN = "sin"
    NOT = "not"
    ISNAN = "isnan"
    ISINF = "isinf"
    CAST = "cast"
    GELU = "gelu"
    SILU = "silu"
    # elementwise, binary (numpy broadcasting)
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    POW = "pow"
    MAX = "max"
    MIN = "min"
    EQUAL = "equal"
    LESS = "less"
    LESS_EQUAL = "less_equal"
    GREATER = "greater"
    GREATER_EQUAL = "greater_equal"
    AND = "and"
    OR = "or"
    WHERE = "where"
    # reductions
    REDUCE_SUM = "reduce_sum"
    REDUCE_MEAN = "reduce_mean"
    REDUCE_MAX = "reduce_max"
    SOFTMAX = "softmax"
    CUMSUM = "cumsum"
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"
    # matrix products
    MATMUL = "matmul"
    # data movement
    RESHAPE = "reshape"
    TRANSPOSE = "transpose"
    EXPAND = "expand"
    CONCAT = "concat"
    SLICE = "slice"
    GATHER = "gather"
    GATHER_ELEMENTS = "gather_elements"
    GATHER_ND = "gather_nd"
    SCATTER_ND = "scatter_nd"
    TILE = "tile"
    TRILU = "trilu"
    # high-level ops produced by the pattern passes and by fusion
    ATTENTION = "attention"
    ROPE = "rope"
    FUSED = "fused"
    # generation: in-place state updates and ops over a KV cache (see fusec/ir.py "state")
    CACHE_WRITE = "cache_write"
    KV_ATTENTION = "kv_attention"
    SAMPLE = "sample"


# --------------------------------------------------------------------------------------------
# Attribute records: one frozen dataclass per op that has attributes.


@dataclasses.dataclass(frozen=True)
class NoAttrs:
    pass


@dataclasses.dataclass(frozen=True)
class MatMulAttrs:
    """``trans_b``: B is stored [.., N, K] and read transposed (a weight kept in nn.Linear's
    [out, in] layout, e.g. a tied embedding table: cuBLAS reads it with a transpose flag)."""

    trans_b: bool = dataclasses.field(default=False, metadata={"omit_default": True})


@dataclasses.dataclass(frozen=True)
class CastAttrs:
    to: DType


@dataclasses.dataclass(frozen=True)
class GeluAttrs:
    approximate: str = "none"  # "none" (erf form) or "tanh"

    def __post_init__(self) -> None:
        if self.approximate not in ("none", "tanh"):
            raise ValueError(f"gelu approximate must be 'none' or 'tanh', got {self.approximate!r}")


@dataclasses.dataclass(frozen=True)
class IsInfAttrs:
    detect_positive: bool = True
    detect_negative: bool = True


@dataclasses.dataclass(frozen=True)
class ReduceAttrs:
    axes: tuple[int, ...]  # non-negative, sorted, unique
    keepdims: bool = True


@dataclasses.dataclass(frozen=True)
class AxisAttrs:
    axis: int  # non-negative


@dataclasses.dataclass(frozen=True)
class CumSumAttrs:
    axis: int
    exclusive: bool = False
    reverse: bool = False


@dataclasses.dataclass(frozen=True)
class LayerNormAttrs:
    """y = (x - mean) / sqrt(var + eps) * scale (+ bias), over axes [axis, rank)."""

    axis: int
    eps: float


@dataclasses.dataclass(frozen=True)
class RMSNormAttrs:
    """y = x / sqrt(mean(x^2) + eps) * (weight + weight_offset), over the last axis.

    ``weight_offset`` is 1.0 for Gemma's ``(1 + w)`` form. The statistic is always computed in
    fp32 (the HF "upcast" form); ``out_dtype`` is the dtype of the result.
    """

    eps: float
    weight_offset: float = 0.0


@dataclasses.dataclass(frozen=True)
class ShapeAttrs:
    shape: tuple[int, ...]  # fully resolved target shape (no -1, no 0-copy)


@dataclasses.dataclass(frozen=True)
class PermAttrs:
    perm: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SliceAttrs:
    """Normalized slice: for each listed axis, python ``range(start, end, step)`` already clamped."""

    axes: tuple[int, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    steps: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class GatherNDAttrs:
    batch_dims: int = 0


@dataclasses.dataclass(frozen=True)
class TileAttrs:
    repeats: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TriluAttrs:
    upper: bool
    k: int = 0


@dataclasses.dataclass(frozen=True)
class AttentionAttrs:
    """softmax(q @ k^T * scale + mask [+ causal]) @ v over [B, H, S, D] heads, all heads at once.

    k/v may have fewer heads than q (GQA/MQA): q head ``h`` reads kv head ``h // (Hq // Hkv)``
    (HF repeat_kv order). The optional 4th input is an additive float mask or a bool mask (True =
    attend), broadcastable to [B, Hq, S, T]. ``causal`` masks key ``j > i + (T - S)`` with -inf.
    ``nan_to_zero`` zeroes NaN probabilities (fully masked rows), as torch's SDPA export does.
    """

    scale: float
    causal: bool = False
    nan_to_zero: bool = False


@dataclasses.dataclass(frozen=True)
class RopeAttrs:
    """Rotate-half RoPE on the first ``rotary_dim`` features of the last axis (the rest pass
    through): y = x_rot * cos + rotate_half(x_rot) * sin; cos/sin broadcast to x_rot's shape."""

    rotary_dim: int


@dataclasses.dataclass(frozen=True)
class CacheWriteAttrs:
    """out = cache with ``new`` written along ``axis`` at a per-row offset:
    ``out[b, ..., pos[b] + s, ...] = new[b, ..., s, ...]`` (axis >= 1; axis 0 is the row b).
    Writes that would land past the cache's end are dropped. The write is in place: the output
    lives in the cache's storage, so the cache input must be a state (or a cache_write of one)
    that no later node reads (``fusec.ir.verify`` checks)."""

    axis: int


@dataclasses.dataclass(frozen=True)
class KVAttentionAttrs:
    """softmax(q @ k^T * scale) @ v of q [B, Hq, S, D] over a KV cache k/v [B, Hkv, T, D]:
    query s of row b attends keys j <= pos[b] + s (and j < T); the rest of the cache is never
    read. GQA as in ``AttentionAttrs`` (q head h reads kv head h // (Hq // Hkv))."""

    scale: float


@dataclasses.dataclass(frozen=True)
class SampleAttrs:
    """Next-token choice from logits [B, V] (see fusec/sampling.py for the exact definition):
    ``temperature`` 0 is greedy argmax (lowest index among equal maxima); otherwise the logits are
    divided by the temperature, cut to the ``top_k`` largest (0: no cut) and to the nucleus of
    mass ``top_p`` (1.0: no cut), and one token is drawn by the Gumbel-max trick with noise that
    is a pure function of (seed, counter[b], b, token), so the same seed gives the same tokens on
    every backend."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


@dataclasses.dataclass(frozen=True, eq=False)
class FusedAttrs:
    """One kernel made of the nodes of ``body`` (a ``fusec.ir.Graph`` whose inputs/outputs match the
    node's, positionally). ``kind`` is the group's fusion kind, ``rule`` the fusion rule(s) that
    built it. Compared by identity: two fused nodes are never interchangeable (CSE)."""

    kind: FusionKind = dataclasses.field(metadata={"format": lambda k: k.name.lower()})
    rule: str
    body: Any = dataclasses.field(metadata={"format": lambda g: f"<{len(g.nodes)} nodes>"})


# --------------------------------------------------------------------------------------------
# Shape and dtype inference. Each rule takes (attrs, input types) and returns output types, or
# raises ValueError with a message that says what is inconsistent.


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


def _gather_elements(a: AxisAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    if len(t[0][0]) != len(t[1][0]):
        raise ValueError("gather_elements: data and indices must have the same rank")
    return [(t[1][0], t[0][1])]


def _gather_nd(a: GatherNDAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (sd, dd), (si, _) = t[0], t[1]
    b = a.batch_dims
    last = si[-1]
    if b + last > len(sd):
        raise ValueError("gather_nd: index tuples longer than the data rank")
    return [(tuple(si[:-1]) + tuple(sd[b + last:]), dd)]


def _scatter_nd(a: Any, t: Sequence[TensorType]) -> list[TensorType]:
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
    (sc, dc), (sn, dn), (sp, dp) = t
    if dc != dn:
        raise ValueError(f"cache_write: cache is {dc.value}, new values are {dn.value}")
    if not sc or not dp.is_int or tuple(sp) != (sc[0],):
        raise ValueError(f"cache_write: positions must be integers of shape [{sc[0] if sc else '?'}], "
                         f"got {dp.value}{list(sp)}")
    if not 1 <= a.axis < len(sc) or len(sn) != len(sc):
        raise ValueError(f"cache_write: axis {a.axis} must be in [1, {len(sc)}) and new {list(sn)} must have "
                         f"the cache's rank {len(sc)}")
    if any(x != y for i, (x, y) in enumerate(zip(sc, sn)) if i != a.axis) or sn[a.axis] > sc[a.axis]:
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


def _sample(a: SampleAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (sl, dl), (ss, ds), (sc, dc) = t
    _float_only(t[:1], "sample")
    if len(sl) != 2 or sl[1] < 1:
        raise ValueError(f"sample needs logits [B, V], got {list(sl)}")
    if not ds.is_int or tuple(ss) != (1,) or not dc.is_int or tuple(sc) != (sl[0],):
        raise ValueError(f"sample needs an integer seed [1] and integer counters [{sl[0]}], "
                         f"got {ds.value}{list(ss)}, {dc.value}{list(sc)}")
    if not (a.temperature >= 0 and a.top_k >= 0 and 0 < a.top_p <= 1):
        raise ValueError(f"sample: temperature {a.temperature} must be >= 0, top_k {a.top_k} >= 0 and "
                         f"top_p {a.top_p} in (0, 1]")
    return [((sl[0],), DType.I64)]


def _fused(a: FusedAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    body = a.body
    want = [(v.shape, v.dtype) for v in body.inputs]
    if [(tuple(s), d) for s, d in t] != want:
        raise ValueError("fused node inputs do not match its body's inputs")
    return [(v.shape, v.dtype) for v in body.outputs]


@dataclasses.dataclass(frozen=True)
class OpInfo:
    kind: FusionKind
    attrs: type
    infer: Callable[[Any, Sequence[TensorType]], list[TensorType]]
    arity: tuple[int, int]  # (min, max) number of inputs; max -1 = variadic


_E, _B, _I, _R, _G, _O = (FusionKind.ELEMENTWISE, FusionKind.BROADCAST, FusionKind.INJECTIVE,
                          FusionKind.REDUCE, FusionKind.GEMM, FusionKind.OPAQUE)

OP_INFO: dict[Op, OpInfo] = {
    Op.NEG: OpInfo(_E, NoAttrs, _unary_same, (1, 1)),
    Op.ABS: OpInfo(_E, NoAttrs, _unary_same, (1, 1)),
    Op.EXP: OpInfo(_E, NoAttrs, _unary_float, (1, 1)),
    Op.LOG: OpInfo(_E, NoAttrs, _unary_float, (1, 1)),
    Op.SQRT: OpInfo(_E, NoAttrs, _unary_float, (1, 1)),
    Op.RECIPROCAL: OpInfo(_E, NoAttrs, _unary_float, (1, 1)),
    Op.ERF: OpInfo(_E, NoAttrs, _unary_float, (1, 1)),
    Op.TANH: OpInfo(_E, NoAttrs, _unary_float, (1, 1)),
    Op.SIGMOID: OpInfo(_E, NoAttrs, _unary_float, (1, 1)),
    Op.RELU: OpInfo(_E, NoAttrs, _unary_same, (1, 1)),
    Op.COS: OpInfo(_E, NoAttrs, _unary_float, (1, 1)),
    Op.SIN: OpInfo(_E, NoAttrs, _unary_float, (1, 1)),
    Op.NOT: OpInfo(_E, NoAttrs, _not, (1, 1)),
    Op.ISNAN: OpInfo(_E, NoAttrs, _unary_pred, (1, 1)),
    Op.ISINF: OpInfo(_E, IsInfAttrs, _unary_pred, (1, 1)),
    Op.CAST: OpInfo(_E, CastAttrs, _cast, (1, 1)),
    Op.GELU: OpInfo(_E, GeluAttrs, _unary_float, (1, 1)),
    Op.SILU: OpInfo(_E, NoAttrs, _unary_float, (1, 1)),
    Op.ADD: OpInfo(_B, NoAttrs, _binary, (2, 2)),
    Op.SUB: OpInfo(_B, NoAttrs, _binary, (2, 2)),
    Op.MUL: OpInfo(_B, NoAttrs, _binary, (2, 2)),
    Op.DIV: OpInfo(_B, NoAttrs, _binary, (2, 2)),
    Op.POW: OpInfo(_B, NoAttrs, _pow, (2, 2)),
    Op.MAX: OpInfo(_B, NoAttrs, _binary, (2, 2)),
    Op.MIN: OpInfo(_B, NoAttrs, _binary, (2, 2)),
    Op.EQUAL: OpInfo(_B, NoAttrs, _compare, (2, 2)),
    Op.LESS: OpInfo(_B, NoAttrs, _compare, (2, 2)),
    Op.LESS_EQUAL: OpInfo(_B, NoAttrs, _compare, (2, 2)),
    Op.GREATER: OpInfo(_B, NoAttrs, _compare, (2, 2)),
    Op.GREATER_EQUAL: OpInfo(_B, NoAttrs, _compare, (2, 2)),
    Op.AND: OpInfo(_B, NoAttrs, _logical, (2, 2)),
    Op.OR: OpInfo(_B, NoAttrs, _logical, (2, 2)),
    Op.WHERE: OpInfo(_B, NoAttrs, _where, (3, 3)),
    Op.REDUCE_SUM: OpInfo(_R, ReduceAttrs, _reduce, (1, 1)),
    Op.REDUCE_MEAN: OpInfo(_R, ReduceAttrs, _reduce, (1, 1)),
    Op.REDUCE_MAX: OpInfo(_R, ReduceAttrs, _reduce, (1, 1)),
    Op.SOFTMAX: OpInfo(_R, AxisAttrs, _axis_same, (1, 1)),
    Op.CUMSUM: OpInfo(_O, CumSumAttrs, _axis_same, (1, 1)),
    Op.LAYERNORM: OpInfo(_R, LayerNormAttrs, _layernorm, (2, 3)),
    Op.RMSNORM: OpInfo(_R, RMSNormAttrs, _rmsnorm, (2, 2)),
    Op.MATMUL: OpInfo(_G, MatMulAttrs, _matmul, (2, 2)),
    Op.RESHAPE: OpInfo(_I, ShapeAttrs, _reshape, (1, 1)),
    Op.TRANSPOSE: OpInfo(_I, PermAttrs, _transpose, (1, 1)),
    Op.EXPAND: OpInfo(_B, ShapeAttrs, _expand, (1, 1)),
    Op.CONCAT: OpInfo(_I, AxisAttrs, _concat, (1, -1)),
    Op.SLICE: OpInfo(_I, SliceAttrs, _slice, (1, 1)),
    Op.GATHER: OpInfo(_I, AxisAttrs, _gather, (2, 2)),
    Op.GATHER_ELEMENTS: OpInfo(_I, AxisAttrs, _gather_elements, (2, 2)),
    Op.GATHER_ND: OpInfo(_I, GatherNDAttrs, _gather_nd, (2, 2)),
    Op.SCATTER_ND: OpInfo(_O, NoAttrs, _scatter_nd, (3, 3)),
    Op.TILE: OpInfo(_I, TileAttrs, _tile, (1, 1)),
    Op.TRILU: OpInfo(_I, TriluAttrs, _trilu, (1, 1)),
    # Attention is two batched matrix products: like a GEMM, it takes elementwise epilogues and
    # layout (injective) prologues/epilogues. RoPE reads x at i and at i +- rotary_dim/2: an index
    # remap plus arithmetic, fusable wherever an injective op is.
    Op.ATTENTION: OpInfo(_G, AttentionAttrs, _attention, (3, 4)),
    Op.ROPE: OpInfo(_I, RopeAttrs, _rope, (3, 3)),
    Op.FUSED: OpInfo(_O, FusedAttrs, _fused, (0, -1)),
    # (cache, new, pos) -> cache'; (q, k_cache, v_cache, pos) -> out; (logits, seed, counter) -> ids
    Op.CACHE_WRITE: OpInfo(_O, CacheWriteAttrs, _cache_write, (3, 3)),
    Op.KV_ATTENTION: OpInfo(_O, KVAttentionAttrs, _kv_attention, (4, 4)),
    Op.SAMPLE: OpInfo(_O, SampleAttrs, _sample, (3, 3)),
}


def infer(op: Op, attrs: Any, types: Sequence[TensorType]) -> list[TensorType]:
    """Output types of ``op`` applied to inputs of ``types``; raises ValueError if inconsistent."""
    info = OP_INFO[op]
    lo, hi = info.arity
    if len(types) < lo or (hi >= 0 and len(types) > hi):
        raise ValueError(f"{op.value} takes {lo}..{hi if hi >= 0 else 'n'} inputs, got {len(types)}")
    if not isinstance(attrs, info.attrs):
        raise TypeError(f"{op.value} takes {info.attrs.__name__} attributes, got {type(attrs).__name__}")
    return info.infer(attrs, types)


def make_attrs(op: Op, **kw: Any) -> Any:
    """Build the attribute record of ``op`` from keyword arguments (used by the builder)."""
    return OP_INFO[op].attrs(**kw)


def format_attrs(attrs: Any) -> str:
    """Deterministic ``[k=v, ...]`` rendering for the printer (empty for ops without attributes)."""
    if not dataclasses.is_dataclass(attrs) or not dataclasses.fields(attrs):
        return ""
    parts = []
    for f in dataclasses.fields(attrs):
        v = getattr(attrs, f.name)
        if f.metadata.get("omit_default") and v == f.default:
            continue
        if "format" in f.metadata:  # e.g. a fused node's body: summarized, printed on its own
            v = f.metadata["format"](v)
        elif isinstance(v, DType):
            v = v.value
        elif isinstance(v, tuple):
            v = "(" + ",".join(str(x) for x in v) + ")"
        elif isinstance(v, float):
            v = repr(v)
        parts.append(f"{f.name}={v}")
    return "[" + ", ".join(parts) + "]" if parts else ""
