"""Kernel specs: the typed layer between the IR and the templates.

A spec is a frozen record of ints, bools, floats, allow-listed dtypes and fusec expression trees;
nothing from a model file (names, strings) fits in one. ``kernels.build`` renders a spec's
template, compiles it and computes its launch geometry. Every spec validates itself on
construction, so a bad spec fails in Python with a message, never as a CUDA error.

Layout conventions: shapes and strides count elements; a stride of 0 broadcasts. Pointers passed
at launch must be aligned to 16 bytes (the runtime's arena guarantees it) wherever a spec uses
vector accesses.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fusec.codegen.elementwise import Expr, dtype_of
from fusec.codegen.spec_base import FLOATS, HALFS, _ints, _pos, _req, _softcap_ok, contiguous_strides  # noqa: F401
from fusec.codegen.specs_decode import (  # noqa: F401  (one namespace for every spec: S.KVAttentionSpec, ...)
    CACHE_DTYPES,
    KV_CHUNK_GRANULE,
    KV_HEADS_SMEM,
    KV_MAX_CLUSTER,
    KV_MAX_SPLITS,
    POS_DTYPES,
    CacheWriteSpec,
    HeadRopeSpec,
    KVAttentionSpec,
    SamplePartSpec,
    SampleSpec,
    cache_write_spec,
    kv_heads_refusal,
)
from fusec.codegen.specs_gemm import (  # noqa: F401  (the matrix products)
    ACTIVATIONS,
    GEMM_STREAM_BK,
    GEMM_STREAM_MAX_M,
    GEMV_MAX_M,
    GEMV_MAX_STAGES,
    GEMV_SPREADS,
    GLU_ACTS,
    Epilogue,
    GemmSpec,
    GemvSpec,
    check_norm_glu,
    gemv_geometry,
    gemv_group,
)
from fusec.codegen.specs_mlp import MlpOperand, MlpSpec  # noqa: F401  (the fused MLP: fusec.codegen.build_mlp)
from fusec.dtypes import DType


@dataclasses.dataclass(frozen=True)
class Operand:
    """An elementwise input: dtype and strides over the kernel's iteration shape."""

    dtype: DType
    strides: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ElementwiseSpec:
    expr: Expr
    shape: tuple[int, ...]  # iteration (= output) shape, contiguous output
    inputs: tuple[Operand, ...]
    out_dtype: DType
    vec: int = 1  # elements per thread access; >1 needs shape[-1] % vec == 0 (see elementwise_spec)
    # more outputs (a multi-output group's): each (expression, dtype), written contiguously at the same index as out
    more: tuple[tuple[Expr, DType], ...] = ()

    def __post_init__(self) -> None:
        _ints(self.shape, "shape", 1)
        for op in self.inputs:
            _req(len(op.strides) == len(self.shape), "operand strides must match the iteration rank")
            _ints(op.strides, "operand strides", 0)
        for e, dt in ((self.expr, self.out_dtype), *self.more):
            _req(dtype_of(e, [o.dtype for o in self.inputs]) == dt,
                 "out_dtype (or a `more` output's dtype) differs from its expression's dtype")
        _req(self.vec in (1, 2, 4, 8, 16), f"vec must be 1, 2, 4, 8 or 16, got {self.vec}")
        if self.vec > 1:
            _req(len(self.shape) > 0 and self.shape[-1] % self.vec == 0, "vec must divide the last dim")
            for op in self.inputs:
                _req(op.strides[-1] in (0, 1), "vectorized operands need last stride 0 or 1")
                # a stride-0 operand is one load a group, wherever it sits; a vector operand's rows are whole vectors
                _req(op.strides[-1] == 0 or all(s % self.vec == 0 for s in op.strides[:-1]),
                     "vectorized operands need aligned rows")
            widest = max([o.dtype.itemsize for o in self.inputs] + [self.out_dtype.itemsize]
                         + [dt.itemsize for _, dt in self.more])
            _req(self.vec * widest <= 16, "a vector access may not exceed 16 bytes")


def vector_width(shape: tuple[int, ...], strides: list[tuple[int, ...]], itemsizes: list[int],
                 fits: Any = None) -> int:
    """Elements an elementwise thread moves a step (``ElementwiseSpec.vec``): 16 bytes of the widest type, halved
    until the last dim is whole vectors and every operand along it is stride 1 with rows whole vectors apart, or
    stride 0 (one load a group, wherever it sits), and ``fits(vec)`` (the caller's addresses) holds."""
    vec = 16 // max(itemsizes)
    while vec > 1 and not (shape[-1] % vec == 0
                           and all(s[-1] == 0 or (s[-1] == 1 and all(x % vec == 0 for x in s[:-1])) for s in strides)
                           and (fits is None or fits(vec))):
        vec //= 2
    return vec


def elementwise_spec(expr: Expr, in_shapes: list[tuple[int, ...]], in_dtypes: list[DType],
                     out_shape: tuple[int, ...], vectorize: bool = True) -> ElementwiseSpec:
    """Broadcast strides, merge dims that are contiguous for every operand, and pick the widest
    vector access that all operands allow (at render time: DESIGN §5)."""
    rank = len(out_shape)
    strides = []
    for shp in in_shapes:
        _req(len(shp) <= rank, "an input has a higher rank than the output")
        full = (1,) * (rank - len(shp)) + tuple(shp)
        cs = contiguous_strides(full)
        strides.append([0 if full[d] == 1 and out_shape[d] != 1 else cs[d] for d in range(rank)])
        _req(all(full[d] in (1, out_shape[d]) for d in range(rank)), f"{list(shp)} does not broadcast to {list(out_shape)}")
    dims = [d for d in range(rank) if out_shape[d] != 1]
    shape = [out_shape[d] for d in dims] or [1]
    st = [[s[d] for d in dims] or [0] for s in strides]
    ostr = list(contiguous_strides(tuple(shape)))
    i = len(shape) - 1
    while i > 0:  # merge dim i-1 into dim i where every operand (and the output) is contiguous across them
        if all(s[i - 1] == s[i] * shape[i] for s in st + [ostr]):
            shape[i] *= shape[i - 1]
            for s in st + [ostr]:
                del s[i - 1]
            del shape[i - 1]
        i -= 1
    vec = 1
    if vectorize:
        vec = vector_width(tuple(shape), [tuple(s) for s in st],
                           [d.itemsize for d in in_dtypes] + [dtype_of(expr, in_dtypes).itemsize])
    return ElementwiseSpec(expr, tuple(shape), tuple(Operand(d, tuple(s)) for d, s in zip(in_dtypes, st)),
                           dtype_of(expr, in_dtypes), vec)


ROW_KINDS = ("layernorm", "rmsnorm", "add_layernorm", "add_rmsnorm", "softmax", "sum", "mean", "max", "prod")


@dataclasses.dataclass(frozen=True)
class RowReduceSpec:
    """Reduce each row of ``x`` viewed as [outer, cols, inner]; a row is (outer, inner) pair.

    Launch params, in order:
      layernorm: x, gamma, [beta], out          add_layernorm: x, res, gamma, [beta], sum_out, out
      rmsnorm: x, weight, out                    add_rmsnorm: x, res, weight, sum_out, out
      softmax: x, [mask], out                    sum / mean / max: x, out (one value per row)
    rmsnorm's output has ``w_dtype`` (HF: the weight's dtype wins); others have ``dtype``.
    Softmax computes softmax(x * scale + mask); the mask element of row r, column c lies at
    sum(coord_i(r) * mask_row_strides[i]) + c * mask_col_stride, coords of r over ``rows_shape``.
    """

    kind: str
    outer: int
    cols: int
    dtype: DType
    inner: int = 1
    w_dtype: DType | None = None
    has_bias: bool = False
    eps: float = 1e-5
    weight_offset: float = 0.0
    scale: float | None = None
    mask_dtype: DType | None = None
    rows_shape: tuple[int, ...] = ()
    mask_row_strides: tuple[int, ...] = ()
    mask_col_stride: int = 1

    def __post_init__(self) -> None:
        _req(self.kind in ROW_KINDS, f"row reduce kind must be one of {ROW_KINDS}, got {self.kind!r}")
        _pos(("outer", self.outer), ("cols", self.cols), ("inner", self.inner))
        _req(isinstance(self.dtype, DType), "dtype must be a DType")
        if self.kind not in ("sum", "max", "prod"):
            _req(self.dtype in FLOATS, f"{self.kind} needs a float dtype")
        if self.kind in ("layernorm", "add_layernorm", "rmsnorm", "add_rmsnorm"):
            _req(self.w_dtype in FLOATS, f"{self.kind} needs w_dtype")
            _req(math.isfinite(self.eps) and self.eps >= 0, "eps must be finite and >= 0")
            _req(math.isfinite(self.weight_offset), "weight_offset must be finite")
        if self.kind.startswith("add_") or self.kind.endswith("norm"):
            _req(self.inner == 1, "norms reduce the innermost axis")
        _req(not self.has_bias or "layernorm" in self.kind, "only layernorm takes a bias")
        if self.scale is not None:
            _req(self.kind == "softmax" and math.isfinite(self.scale), "scale is a finite softmax option")
        if self.mask_dtype is not None:
            _req(self.kind == "softmax" and self.inner == 1 and self.mask_dtype in FLOATS, "masks are float, softmax only")
            _ints(self.rows_shape, "rows_shape", 1)
            _req(math.prod(self.rows_shape) == self.outer, "rows_shape must multiply to the row count")
            _req(len(self.mask_row_strides) == len(self.rows_shape), "one mask stride per rows_shape dim")
            _ints(self.mask_row_strides + (self.mask_col_stride,), "mask strides", 0)

    @property
    def rows(self) -> int:
        return self.outer * self.inner


@dataclasses.dataclass(frozen=True)
class CumsumSpec:
    """Inclusive/exclusive, forward/reverse scan along the middle axis of [outer, n, inner]."""

    outer: int
    n: int
    inner: int
    dtype: DType
    exclusive: bool = False
    reverse: bool = False

    def __post_init__(self) -> None:
        _pos(("outer", self.outer), ("n", self.n), ("inner", self.inner))
        _req(self.dtype in FLOATS + (DType.I64, DType.I32), "cumsum needs a numeric dtype")


@dataclasses.dataclass(frozen=True)
class EmbeddingSpec:
    """out[t, :] = table[ids[t], :] (+ pos_table[pos_ids[t], :]); params: ids, table, [pos_ids, pos_table], out.

    An id outside [-vocab, vocab) writes a NaN row (negative ids count from the end, as in the
    reference's gather): visible downstream, and nothing is read out of bounds.
    """

    tokens: int
    vocab: int
    hidden: int
    dtype: DType
    id_dtype: DType = DType.I64
    pos_vocab: int = 0  # 0: no position embedding
    pos_id_dtype: DType = DType.I64

    def __post_init__(self) -> None:
        _pos(("tokens", self.tokens), ("vocab", self.vocab), ("hidden", self.hidden))
        _req(self.dtype in FLOATS, "embedding tables are float")
        _req(self.id_dtype in (DType.I64, DType.I32) and self.pos_id_dtype in (DType.I64, DType.I32), "ids are int32/int64")
        _ints((self.pos_vocab,), "pos_vocab", 0)


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Rotate-half rotary embedding on x[B, H, S, D] (strides per b, h, s; d contiguous).

    cos/sin have ``rotary_dim`` columns (HF's cat(freqs, freqs) form), rows addressed by
    b * cs_strides[0] + s * cs_strides[1]. Columns >= rotary_dim pass through. Params: x, cos, sin, out.
    """

    B: int
    H: int
    S: int
    D: int
    rotary_dim: int
    dtype: DType
    x_strides: tuple[int, int, int]
    out_strides: tuple[int, int, int]
    cs_strides: tuple[int, int]
    cs_dtype: DType | None = None

    def __post_init__(self) -> None:
        _pos(("B", self.B), ("H", self.H), ("S", self.S), ("D", self.D), ("rotary_dim", self.rotary_dim))
        _req(self.rotary_dim % 2 == 0 and self.rotary_dim <= self.D, "rotary_dim must be even and <= head_dim")
        _req(self.dtype in FLOATS and (self.cs_dtype or self.dtype) in FLOATS, "rope is float")
        _ints(self.x_strides + self.out_strides + self.cs_strides, "strides", 0)


MASKS = ("none", "additive", "bool")


def mask_rows_16(strides: tuple[int, ...], dtype: DType | None, offset: int = 0) -> bool:
    """Whether an attention mask read at element ``strides`` (b, h, query, key) from element ``offset`` of a 16-byte
    aligned buffer has contiguous rows that start on 16 bytes (``AttentionSpec.mask_vec``: 16-byte copies)."""
    e = dtype.itemsize if dtype is not None else 0
    return bool(e) and strides[3] == 1 and all(st * e % 16 == 0 for st in (*strides[:3], offset))


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """out = softmax(q k^T * scale + mask) v for all batches and heads in one launch.

    q [B, Hq, S, D], k/v [B, Hkv, T, D], out [B, Hq, S, D]; strides per (b, h, s) for each, d
    contiguous. Query head h reads kv head h // (Hq // Hkv) (GQA/MQA). ``causal``: query i may see
    key j <= i + (T - S) (bottom-right aligned, so decode with a KV cache sees all past keys).
    mask "additive": added to the scaled scores; "bool": True keeps. Mask element (b, h, i, j) at
    b*ms[0] + h*ms[1] + i*ms[2] + j*ms[3] (0 broadcasts). Params: q, k, v, [mask], out.
    A row that sees no key gives NaN, as softmax of all -inf does in the reference.
    ``softcap`` > 0: the scaled scores become softcap * tanh(s / softcap) before the mask (0: none).
    """

    B: int
    Hq: int
    Hkv: int
    S: int
    T: int
    D: int
    dtype: DType
    scale: float
    causal: bool = False
    mask: str = "none"
    mask_dtype: DType | None = None
    mask_strides: tuple[int, int, int, int] = (0, 0, 0, 0)
    q_strides: tuple[int, int, int] | None = None
    k_strides: tuple[int, int, int] | None = None
    v_strides: tuple[int, int, int] | None = None
    o_strides: tuple[int, int, int] | None = None
    # fp32 math: "3xtf32" (tensor cores, each product split into big + small tf32 parts: fp32
    # accuracy), "tf32" (one tf32 product, for --dtype tf32), "simt" (one warp per query row, FMA);
    # "" picks 3xtf32 where the tensor-core path fits (head_dim <= 128), else simt. Halfs: mma.sync f16/bf16.
    fp32_math: str = ""
    softcap: float = 0.0
    # fp16/bf16: warps of a 4-warp block along the query rows (16 rows each); the other 4 / qwarps split each key
    # tile (``build_attention.query_warps``: the kernel selection's rule)
    qwarps: int = 4
    # the mask's rows contiguous (key stride 1) and 16-byte aligned, its view's offset included (the lowering knows
    # it): fp16/bf16 attention copies its tiles with 16-byte cp.async
    mask_vec: bool = False
    # fp16/bf16: K/V tile buffers (1 or 2: the next tile's copy overlapping this one's products); 0: the builder's
    # rule, two where the keys span more than one tile
    stages: int = 0
    # fp16/bf16: keys a K/V tile (32 or 64; each key split's share a multiple of 16); 0: the builder's rule (64)
    bn: int = 0

    def __post_init__(self) -> None:
        _pos(("B", self.B), ("Hq", self.Hq), ("Hkv", self.Hkv), ("S", self.S), ("T", self.T), ("D", self.D))
        _req(self.qwarps in (1, 2, 4), "qwarps must be 1, 2 or 4")
        _req(self.stages in (0, 1, 2), "stages must be 0 (the rule), 1 or 2")
        _req(self.bn in (0, 32, 64) and (self.bn == 0 or self.bn * self.qwarps // 4 % 16 == 0),
             "bn must be 0 (the rule), 32 or 64, with bn / (4 / qwarps) keys a split a multiple of 16")
        if self.mask_vec:
            _req(self.mask != "none" and mask_rows_16(self.mask_strides, self.mask_dtype),
                 "mask_vec needs a mask whose key stride is 1 and whose other strides are multiples of 16 bytes")
        _req(self.Hq % self.Hkv == 0, "Hq must be a multiple of Hkv")
        _req(self.fp32_math in ("", "3xtf32", "tf32", "simt"), "fp32_math must be '', 3xtf32, tf32 or simt")
        if self.fp32_math in ("3xtf32", "tf32"):
            _req(self.dtype == DType.F32 and self.D <= 128, "tf32 attention is for fp32 tensors with head_dim <= 128")
        _req(self.dtype in FLOATS, "attention is float")
        _req(self.D % 8 == 0 and 8 <= self.D <= 256, "head_dim must be a multiple of 8 in [8, 256]")
        if self.dtype in HALFS:
            _req(self.D % 16 == 0 and self.D <= 128, "tensor-core attention needs head_dim % 16 == 0 and <= 128")
        _req(math.isfinite(self.scale), "scale must be finite")
        _req(_softcap_ok(self.softcap), "softcap must be finite and >= 0 (0 = none)")
        _req(self.mask in MASKS, f"mask must be one of {MASKS}")
        if self.mask == "additive":
            _req(self.mask_dtype in FLOATS, "an additive mask is float")
        if self.mask == "bool":
            _req(self.mask_dtype == DType.BOOL, "a bool mask has dtype bool")
        _ints(self.mask_strides, "mask strides", 0)
        for st in self.strides():
            _ints(st, "strides", 0)
            if self.dtype in HALFS:
                _req(all(x % 8 == 0 for x in st), "tensor-core attention needs strides that keep rows 16-byte aligned")

    def math(self) -> str:
        """The kernel variant: "mma16" (fp16/bf16), "3xtf32", "tf32" or "simt"."""
        if self.dtype in HALFS:
            return "mma16"
        return self.fp32_math or ("3xtf32" if self.D <= 128 else "simt")

    def strides(self) -> tuple[tuple[int, int, int], ...]:
        def dflt(h: int, n: int) -> tuple[int, int, int]:
            return (h * n * self.D, n * self.D, self.D)

        return (self.q_strides or dflt(self.Hq, self.S), self.k_strides or dflt(self.Hkv, self.T),
                self.v_strides or dflt(self.Hkv, self.T), self.o_strides or dflt(self.Hq, self.S))
