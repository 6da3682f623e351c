"""fusec's one op vocabulary: a closed ``Op`` enum, a typed frozen attribute record per op, and
one table per concern keyed by ``Op`` (fusion kind, attrs, shape/dtype inference and arity here;
the numpy reference in ``fusec.reference``; CUDA expressions in the codegen). The attribute
records live in ``fusec.ops_attrs`` and the inference rules in ``fusec.ops_infer`` (tensor ops) and
``fusec.ops_infer_model`` (norms, packed products, attention, caches, sampling, fused groups); this module
re-exports the records, so ``from fusec.ops import ReduceAttrs`` keeps working.

ONNX ``op_type`` strings never appear outside the frontend. Every node has one or more outputs;
most ops have exactly one. Attribute values are normalized at construction time (axes
non-negative, shapes fully resolved) so that passes and backends never re-derive them.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

from fusec import ops_infer as I
from fusec import ops_infer_model as M
from fusec.dtypes import DType
from fusec.ops_attrs import (PAD_MODES, ArgAttrs, AttentionAttrs, AxisAttrs, BitShiftAttrs, CacheWriteAttrs,  # noqa: F401
                             CastAttrs, CumSumAttrs, FusedAttrs, GatherNDAttrs, GeluAttrs, IsInfAttrs,
                             KVAttentionAttrs, LayerNormAttrs, MatMulAttrs, ModAttrs, NoAttrs, PadAttrs, PermAttrs,
                             QGatherAttrs, QMatMulAttrs, ReduceAttrs, RMSNormAttrs, RopeAttrs, ShapeAttrs, SliceAttrs,
                             TileAttrs, TopKAttrs, TriluAttrs)
from fusec.ops_infer import Shape, TensorType  # noqa: F401
from fusec import ops_train as T
from fusec.ops_train import (AdamWAttrs, CrossEntropyAttrs, InitAttrs, LayerNormGradAttrs, ScatterAddAttrs,  # noqa: F401
                             SoftmaxGradAttrs)


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
    FLOOR = "floor"
    CEIL = "ceil"
    ROUND = "round"  # half to even
    SIGN = "sign"
    BITWISE_NOT = "bitwise_not"
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
    XOR = "xor"
    WHERE = "where"
    MOD = "mod"
    BITWISE_AND = "bitwise_and"
    BITWISE_OR = "bitwise_or"
    BITWISE_XOR = "bitwise_xor"
    BIT_SHIFT = "bit_shift"
    # reductions
    REDUCE_SUM = "reduce_sum"
    REDUCE_MEAN = "reduce_mean"
    REDUCE_MAX = "reduce_max"
    REDUCE_MIN = "reduce_min"
    REDUCE_PROD = "reduce_prod"
    ARGMAX = "argmax"
    ARGMIN = "argmin"
    TOPK = "topk"
    SOFTMAX = "softmax"
    CUMSUM = "cumsum"
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"
    # matrix products
    MATMUL = "matmul"
    # x [.., K] @ W^T with W [N, K] held packed (weight-only quantization, fusec/quant.py)
    QMATMUL = "qmatmul"
    # x [.., K] -> [lo(x), hi(x), hi(x)] [.., 3K]: the A operand of a 3xTF32 product (passes/split_tf32.py)
    TF32_SPLIT = "tf32_split"
    # data movement
    RESHAPE = "reshape"
    TRANSPOSE = "transpose"
    EXPAND = "expand"
    CONCAT = "concat"
    SLICE = "slice"
    GATHER = "gather"
    # rows of a packed table (a GGUF embedding), dequantized (fusec/quant.py)
    QGATHER = "qgather"
    GATHER_ELEMENTS = "gather_elements"
    GATHER_ND = "gather_nd"
    SCATTER_ND = "scatter_nd"
    TILE = "tile"
    TRILU = "trilu"
    PAD = "pad"
    # high-level ops produced by the pattern passes and by fusion
    ATTENTION = "attention"
    ROPE = "rope"
    FUSED = "fused"
    # generation: in-place state updates and ops over a KV cache (see fusec/ir.py "state")
    CACHE_WRITE = "cache_write"
    KV_ATTENTION = "kv_attention"
    SAMPLE = "sample"
    # training (fusec/ops_train.py): a gather's gradient, the loss, the optimizer step, initialization
    SCATTER_ADD = "scatter_add"
    CROSS_ENTROPY = "cross_entropy"
    ADAMW = "adamw"
    INIT = "init"
    SOFTMAX_GRAD = "softmax_grad"
    LAYERNORM_GRAD = "layernorm_grad"
    CROSS_ENTROPY_GRAD = "cross_entropy_grad"


@dataclasses.dataclass(frozen=True)
class OpInfo:
    kind: FusionKind
    attrs: type
    infer: Callable[[Any, Sequence[TensorType]], list[TensorType]]
    arity: tuple[int, int]  # (min, max) number of inputs; max -1 = variadic


_E, _B, _I, _R, _G, _O = (FusionKind.ELEMENTWISE, FusionKind.BROADCAST, FusionKind.INJECTIVE,
                          FusionKind.REDUCE, FusionKind.GEMM, FusionKind.OPAQUE)

OP_INFO: dict[Op, OpInfo] = {
    Op.NEG: OpInfo(_E, NoAttrs, I._unary_same, (1, 1)),
    Op.ABS: OpInfo(_E, NoAttrs, I._unary_same, (1, 1)),
    Op.EXP: OpInfo(_E, NoAttrs, I._unary_float, (1, 1)),
    Op.LOG: OpInfo(_E, NoAttrs, I._unary_float, (1, 1)),
    Op.SQRT: OpInfo(_E, NoAttrs, I._unary_float, (1, 1)),
    Op.RECIPROCAL: OpInfo(_E, NoAttrs, I._unary_float, (1, 1)),
    Op.ERF: OpInfo(_E, NoAttrs, I._unary_float, (1, 1)),
    Op.TANH: OpInfo(_E, NoAttrs, I._unary_float, (1, 1)),
    Op.SIGMOID: OpInfo(_E, NoAttrs, I._unary_float, (1, 1)),
    Op.RELU: OpInfo(_E, NoAttrs, I._unary_same, (1, 1)),
    Op.COS: OpInfo(_E, NoAttrs, I._unary_float, (1, 1)),
    Op.SIN: OpInfo(_E, NoAttrs, I._unary_float, (1, 1)),
    Op.NOT: OpInfo(_E, NoAttrs, I._not, (1, 1)),
    Op.ISNAN: OpInfo(_E, NoAttrs, I._unary_pred, (1, 1)),
    Op.ISINF: OpInfo(_E, IsInfAttrs, I._unary_pred, (1, 1)),
    Op.CAST: OpInfo(_E, CastAttrs, I._cast, (1, 1)),
    Op.GELU: OpInfo(_E, GeluAttrs, I._unary_float, (1, 1)),
    Op.SILU: OpInfo(_E, NoAttrs, I._unary_float, (1, 1)),
    Op.FLOOR: OpInfo(_E, NoAttrs, I._unary_float, (1, 1)),
    Op.CEIL: OpInfo(_E, NoAttrs, I._unary_float, (1, 1)),
    Op.ROUND: OpInfo(_E, NoAttrs, I._unary_float, (1, 1)),
    Op.SIGN: OpInfo(_E, NoAttrs, I._unary_numeric, (1, 1)),
    Op.BITWISE_NOT: OpInfo(_E, NoAttrs, I._unary_int, (1, 1)),
    Op.ADD: OpInfo(_B, NoAttrs, I._binary, (2, 2)),
    Op.SUB: OpInfo(_B, NoAttrs, I._binary, (2, 2)),
    Op.MUL: OpInfo(_B, NoAttrs, I._binary, (2, 2)),
    Op.DIV: OpInfo(_B, NoAttrs, I._binary, (2, 2)),
    Op.POW: OpInfo(_B, NoAttrs, I._pow, (2, 2)),
    Op.MAX: OpInfo(_B, NoAttrs, I._binary, (2, 2)),
    Op.MIN: OpInfo(_B, NoAttrs, I._binary, (2, 2)),
    Op.EQUAL: OpInfo(_B, NoAttrs, I._compare, (2, 2)),
    Op.LESS: OpInfo(_B, NoAttrs, I._compare, (2, 2)),
    Op.LESS_EQUAL: OpInfo(_B, NoAttrs, I._compare, (2, 2)),
    Op.GREATER: OpInfo(_B, NoAttrs, I._compare, (2, 2)),
    Op.GREATER_EQUAL: OpInfo(_B, NoAttrs, I._compare, (2, 2)),
    Op.AND: OpInfo(_B, NoAttrs, I._logical, (2, 2)),
    Op.OR: OpInfo(_B, NoAttrs, I._logical, (2, 2)),
    Op.XOR: OpInfo(_B, NoAttrs, I._logical, (2, 2)),
    Op.WHERE: OpInfo(_B, NoAttrs, I._where, (3, 3)),
    Op.MOD: OpInfo(_B, ModAttrs, I._binary_numeric, (2, 2)),
    Op.BITWISE_AND: OpInfo(_B, NoAttrs, I._binary_int, (2, 2)),
    Op.BITWISE_OR: OpInfo(_B, NoAttrs, I._binary_int, (2, 2)),
    Op.BITWISE_XOR: OpInfo(_B, NoAttrs, I._binary_int, (2, 2)),
    Op.BIT_SHIFT: OpInfo(_B, BitShiftAttrs, I._binary_int, (2, 2)),
    Op.REDUCE_SUM: OpInfo(_R, ReduceAttrs, I._reduce, (1, 1)),
    Op.REDUCE_MEAN: OpInfo(_R, ReduceAttrs, I._reduce, (1, 1)),
    Op.REDUCE_MAX: OpInfo(_R, ReduceAttrs, I._reduce, (1, 1)),
    Op.REDUCE_MIN: OpInfo(_R, ReduceAttrs, I._reduce, (1, 1)),
    Op.REDUCE_PROD: OpInfo(_R, ReduceAttrs, I._reduce, (1, 1)),
    # one index per row: opaque, so no fusion rule treats them as a plain reduction
    Op.ARGMAX: OpInfo(_O, ArgAttrs, I._arg, (1, 1)),
    Op.ARGMIN: OpInfo(_O, ArgAttrs, I._arg, (1, 1)),
    Op.TOPK: OpInfo(_O, TopKAttrs, I._topk, (1, 1)),
    Op.SOFTMAX: OpInfo(_R, AxisAttrs, I._axis_same, (1, 1)),
    Op.CUMSUM: OpInfo(_O, CumSumAttrs, I._axis_same, (1, 1)),
    Op.LAYERNORM: OpInfo(_R, LayerNormAttrs, M._layernorm, (2, 3)),
    Op.RMSNORM: OpInfo(_R, RMSNormAttrs, M._rmsnorm, (2, 2)),
    Op.MATMUL: OpInfo(_G, MatMulAttrs, I._matmul, (2, 2)),
    # (x, codes[, high], scale[, sub_scale][, zero][, min | dmin, mins]): fusec/quant.py's layout
    Op.QMATMUL: OpInfo(_G, QMatMulAttrs, M._qmatmul, (3, 7)),
    Op.TF32_SPLIT: OpInfo(_O, NoAttrs, M._tf32_split, (1, 1)),
    Op.RESHAPE: OpInfo(_I, ShapeAttrs, I._reshape, (1, 1)),
    Op.TRANSPOSE: OpInfo(_I, PermAttrs, I._transpose, (1, 1)),
    Op.EXPAND: OpInfo(_B, ShapeAttrs, I._expand, (1, 1)),
    Op.CONCAT: OpInfo(_I, AxisAttrs, I._concat, (1, -1)),
    Op.SLICE: OpInfo(_I, SliceAttrs, I._slice, (1, 1)),
    Op.GATHER: OpInfo(_I, AxisAttrs, I._gather, (2, 2)),
    # (ids, codes[, high], scale...): opaque, one kernel of its own (no fusion reads it through an index)
    Op.QGATHER: OpInfo(_O, QGatherAttrs, M._qgather, (3, 7)),
    Op.GATHER_ELEMENTS: OpInfo(_I, AxisAttrs, I._gather_elements, (2, 2)),
    Op.GATHER_ND: OpInfo(_I, GatherNDAttrs, I._gather_nd, (2, 2)),
    Op.SCATTER_ND: OpInfo(_O, NoAttrs, I._scatter_nd, (3, 3)),
    Op.TILE: OpInfo(_I, TileAttrs, I._tile, (1, 1)),
    Op.TRILU: OpInfo(_I, TriluAttrs, I._trilu, (1, 1)),
    # (x[, fill value]) -> x padded; reflect/edge/wrap read other positions of x: opaque
    Op.PAD: OpInfo(_O, PadAttrs, I._pad, (1, 2)),
    # Attention is two batched matrix products: like a GEMM, it takes elementwise epilogues and
    # layout (injective) prologues/epilogues. RoPE reads x at i and at i +- rotary_dim/2: an index
    # remap plus arithmetic, fusable wherever an injective op is.
    Op.ATTENTION: OpInfo(_G, AttentionAttrs, M._attention, (3, 4)),
    Op.ROPE: OpInfo(_I, RopeAttrs, M._rope, (3, 3)),
    Op.FUSED: OpInfo(_O, FusedAttrs, M._fused, (0, -1)),
    # (cache, new, pos) -> cache'; (q, k_cache, v_cache, pos) -> out;
    # (logits, seed, counter, temperature, top_k, top_p) -> ids (fusec/sampling.py: per-row settings)
    Op.CACHE_WRITE: OpInfo(_O, CacheWriteAttrs, M._cache_write, (3, 4)),
    Op.KV_ATTENTION: OpInfo(_O, KVAttentionAttrs, M._kv_attention, (4, 4)),
    Op.SAMPLE: OpInfo(_O, NoAttrs, M._sample, (6, 6)),
    # (updates, indices) -> zeros + updates added at their indices; (logits, labels) -> loss per row;
    # (params, m, v, step, grads...) -> the four states after one AdamW step (in place); (seed) -> [P]
    Op.SCATTER_ADD: OpInfo(_O, ScatterAddAttrs, T.scatter_add, (2, 2)),
    Op.CROSS_ENTROPY: OpInfo(_O, CrossEntropyAttrs, T.cross_entropy, (2, 2)),
    Op.ADAMW: OpInfo(_O, AdamWAttrs, T.adamw, (5, -1)),
    Op.INIT: OpInfo(_O, InitAttrs, T.init, (1, 1)),
    # fused gradients (one row kernel each): opaque, so no fusion rule takes them for forward ops
    Op.SOFTMAX_GRAD: OpInfo(_O, SoftmaxGradAttrs, T.softmax_grad, (2, 2)),
    Op.LAYERNORM_GRAD: OpInfo(_O, LayerNormGradAttrs, T.layernorm_grad, (3, 3)),
    Op.CROSS_ENTROPY_GRAD: OpInfo(_O, CrossEntropyAttrs, T.cross_entropy_grad, (3, 3)),
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
