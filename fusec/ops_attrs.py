"""The attribute records of fusec's ops: one frozen dataclass per op that has attributes.

Values are normalized at construction time (axes non-negative, shapes fully resolved) so that
passes and backends never re-derive them. ``fusec.ops`` re-exports every record.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from fusec.dtypes import DType

if TYPE_CHECKING:
    from fusec.ops import FusionKind


@dataclasses.dataclass(frozen=True)
class NoAttrs:
    pass


@dataclasses.dataclass(frozen=True)
class MatMulAttrs:
    """``trans_b``: B is stored [.., N, K] and read transposed (a weight kept in nn.Linear's
    [out, in] layout, e.g. a tied embedding table: cuBLAS reads it with a transpose flag).
    ``trans_a``: A is stored [.., K, M] and read transposed (a weight gradient dy^T @ x, made by
    ``fusec.autodiff``: cuBLAS reads it with its other transpose flag)."""

    trans_b: bool = dataclasses.field(default=False, metadata={"omit_default": True})
    # "tf32": an fp32 product computed on tf32 tensor cores (inputs rounded to 10 mantissa bits;
    # passes/split_tf32.py feeds it hi/lo splits, so that the sum is fp32-accurate); "f32": exact.
    precision: str = dataclasses.field(default="f32", metadata={"omit_default": True})
    trans_a: bool = dataclasses.field(default=False, metadata={"omit_default": True})

    def __post_init__(self) -> None:
        if self.precision not in ("f32", "tf32"):
            raise ValueError(f"matmul precision must be 'f32' or 'tf32', got {self.precision!r}")


@dataclasses.dataclass(frozen=True)
class QMatMulAttrs:
    """QMATMUL: x[.., K] @ W^T -> [.., N] with W [N, K] held packed in ``format`` (``fusec.quant``:
    the operands after x, their layout and the exact dequantization); ``group`` weights share one
    scale (the format's own for the GGUF formats). The product accumulates in fp32; the result has
    x's dtype."""

    format: str
    n: int
    k: int
    group: int

    def __post_init__(self) -> None:
        from fusec.quant import check_layout, get_format

        check_layout(get_format(self.format), self.n, self.k, self.group)


@dataclasses.dataclass(frozen=True)
class QGatherAttrs:
    """QGATHER: rows ``ids`` of a packed table W [N, K] (``fusec.quant``; a GGUF file's embedding
    table), dequantized: out[..., :] = W[ids[...], :] as ``out_dtype`` (fp32 when imported; the
    precision pass retypes it to the storage dtype). Ids count from the end when negative; one outside
    [-N, N) is an error (the reference) or a NaN row (the kernel), as GATHER's."""

    format: str
    n: int
    k: int
    group: int
    out_dtype: DType = DType.F32

    def __post_init__(self) -> None:
        from fusec.quant import check_layout, get_format

        check_layout(get_format(self.format), self.n, self.k, self.group)
        if not self.out_dtype.is_float:
            raise ValueError(f"qgather writes floats, got {self.out_dtype.value}")


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


def check_softcap(cap: Any) -> float:
    """An attention soft-cap as a float: 0.0 for none (0 or None), else finite and positive."""
    if cap is None:
        return 0.0
    c = float(cap)
    if not math.isfinite(c) or c < 0:
        raise ValueError(f"attention softcap must be a finite number >= 0 (0 = none), got {cap!r}")
    return c


@dataclasses.dataclass(frozen=True)
class AttentionAttrs:
    """softmax(q @ k^T * scale + mask [+ causal]) @ v over [B, H, S, D] heads, all heads at once.

    k/v may have fewer heads than q (GQA/MQA): q head ``h`` reads kv head ``h // (Hq // Hkv)``
    (HF repeat_kv order). The optional 4th input is an additive float mask or a bool mask (True =
    attend), broadcastable to [B, Hq, S, T]. ``causal`` masks key ``j > i + (T - S)`` with -inf.
    ``nan_to_zero`` zeroes NaN probabilities (fully masked rows), as torch's SDPA export does.
    ``softcap`` > 0 caps the scaled scores before any mask: s = softcap * tanh(s / softcap)
    (Gemma-2's attn_logit_softcapping, ONNX Attention's ``softcap``); 0 (or None) = no cap.
    """

    scale: float
    causal: bool = False
    nan_to_zero: bool = False
    softcap: float = dataclasses.field(default=0.0, metadata={"omit_default": True})

    def __post_init__(self) -> None:
        object.__setattr__(self, "softcap", check_softcap(self.softcap))


@dataclasses.dataclass(frozen=True)
class RopeAttrs:
    """Rotate-half RoPE on the first ``rotary_dim`` features of the last axis (the rest pass
    through): y = x_rot * cos + rotate_half(x_rot) * sin; cos/sin broadcast to x_rot's shape."""

    rotary_dim: int


@dataclasses.dataclass(frozen=True)
class CacheWriteAttrs:
    """out = cache with ``new`` written along ``axis`` at a per-row offset:
    ``out[b, ..., pos[b] + s, ...] = new[b, ..., s, ...]`` (axis >= 1; axis 0 is the row b).
    With a fourth input ``rows`` [N] (integers), ``new`` has N rows of its own and row i goes to
    cache row ``rows[i]`` at ``pos[i]``: ``out[rows[i], ..., pos[i] + s, ...] = new[i, ..., s, ...]``
    (the rows must differ where a write lands; a row outside the cache is dropped).
    Writes that would land past the cache's end are dropped. The write is in place: the output
    lives in the cache's storage, so the cache input must be a state (or a cache_write of one)
    that no later node reads (``fusec.ir.verify`` checks)."""

    axis: int


@dataclasses.dataclass(frozen=True)
class KVAttentionAttrs:
    """softmax(q @ k^T * scale) @ v of q [B, Hq, S, D] over a KV cache k/v [B, Hkv, T, D]:
    query s of row b attends keys j <= pos[b] + s (and j < T); the rest of the cache is never
    read. GQA as in ``AttentionAttrs`` (q head h reads kv head h // (Hq // Hkv)); ``softcap`` as
    there (applied to the scaled scores). ``window`` > 0: a sliding window of that many keys,
    the query's own included: keys j <= pos[b] + s - window are skipped too (0 = no window)."""

    scale: float
    softcap: float = dataclasses.field(default=0.0, metadata={"omit_default": True})
    window: int = dataclasses.field(default=0, metadata={"omit_default": True})

    def __post_init__(self) -> None:
        object.__setattr__(self, "softcap", check_softcap(self.softcap))
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"kv_attention window must be an integer >= 0 (0 = none), got {self.window!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class FusedAttrs:
    """One kernel made of the nodes of ``body`` (a ``fusec.ir.Graph`` whose inputs/outputs match the
    node's, positionally). ``kind`` is the group's fusion kind, ``rule`` the fusion rule(s) that
    built it. Compared by identity: two fused nodes are never interchangeable (CSE)."""

    kind: FusionKind = dataclasses.field(metadata={"format": lambda k: k.name.lower()})
    rule: str
    body: Any = dataclasses.field(metadata={"format": lambda g: f"<{len(g.nodes)} nodes>"})


@dataclasses.dataclass(frozen=True)
class ModAttrs:
    """ONNX Mod: ``fmod`` False takes the divisor's sign (Python's %, integers only in ONNX),
    True the dividend's (C fmod); an integer remainder by zero is 0 (numpy's convention)."""

    fmod: bool = False


@dataclasses.dataclass(frozen=True)
class BitShiftAttrs:
    """x << y (``left``) or x >> y (arithmetic for signed types); a shift amount that is negative
    or at least the bit width gives what the sign fill alone gives: -1 for a right shift of a
    negative x, else 0."""

    left: bool


@dataclasses.dataclass(frozen=True)
class ArgAttrs:
    """ARGMAX/ARGMIN along ``axis``: int64 index of the first extremum (the last with
    ``select_last_index``); NaN counts as the extremum, as numpy's argmax does."""

    axis: int  # non-negative
    keepdims: bool = True
    select_last_index: bool = False


@dataclasses.dataclass(frozen=True)
class TopKAttrs:
    """TOPK: int64 indices of the ``k`` largest (``largest``) or smallest elements along ``axis``,
    ordered from the extremum on; equal elements keep index order. The values are
    ``gather_elements(x, indices, axis)`` (the importer emits that second op)."""

    axis: int
    k: int
    largest: bool = True

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"topk k must be >= 0, got {self.k}")


PAD_MODES = ("constant", "reflect", "edge", "wrap")


@dataclasses.dataclass(frozen=True)
class PadAttrs:
    """PAD: ``pads`` = (begin_0, .., begin_{r-1}, end_0, .., end_{r-1}) over every axis; a negative
    pad removes elements (applied first), a positive one adds them per ``mode``. In constant mode
    the fill is the optional scalar second input (0 without it)."""

    pads: tuple[int, ...]
    mode: str = "constant"

    def __post_init__(self) -> None:
        if self.mode not in PAD_MODES:
            raise ValueError(f"pad mode must be one of {', '.join(PAD_MODES)}, got {self.mode!r}")
        if len(self.pads) % 2:
            raise ValueError(f"pads must have two entries per axis, got {len(self.pads)}")
