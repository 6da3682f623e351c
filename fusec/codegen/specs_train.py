"""Kernel specs of the training ops (``fusec.ops_train``): cross-entropy rows, scatter-add (a
gather's gradient), seeded init, and AdamW's three kernels (gradient norm partials, the step's
scalars, the multi-tensor update). Frozen records of ints, floats and allow-listed dtypes,
validated on construction like every spec (``fusec.codegen.specs``)."""

from __future__ import annotations

import dataclasses
import math

from fusec.codegen.spec_base import FLOATS, _ints, _pos, _req
from fusec.dtypes import DType
from fusec.ops_train import INIT_KINDS, SCHEDULES

INDEX_DTYPES = (DType.I64, DType.I32)
ADAMW_CHUNK = 2048  # elements one block of the norm and update kernels covers (one segment only)
ADAMW_MAX_SEGMENTS = 480  # gradient pointers a kernel takes (CUDA's 4 KB of kernel parameters)


@dataclasses.dataclass(frozen=True)
class CrossEntropySpec:
    """loss[r] = logsumexp(x[r, :]) - x[r, label[r]] over ``rows`` rows of ``classes`` logits; 0 where
    label == ignore_index; NaN for any other label outside [0, classes) (nothing read out of
    bounds). Params: logits, labels, out. ``grad``: the gradient instead, dlogits[r] =
    (softmax(x[r]) - onehot(label[r])) * dloss[r] (0 on ignored rows, NaN rows for a bad label);
    params: logits, labels, dloss, out."""

    rows: int
    classes: int
    dtype: DType
    label_dtype: DType = DType.I64
    ignore_index: int = -100
    grad: bool = False

    def __post_init__(self) -> None:
        _pos(("rows", self.rows), ("classes", self.classes))
        _req(self.dtype in FLOATS, "cross_entropy logits are float")
        _req(self.label_dtype in INDEX_DTYPES, "cross_entropy labels are int32/int64")
        _ints((self.ignore_index,), "ignore_index")


@dataclasses.dataclass(frozen=True)
class ScatterAddSpec:
    """out[p, idx[n], q] += upd[p, n, q] (out viewed [pre, size, post], upd [pre, n_idx, post]);
    ``zero``: the kernel that first clears out. Indices outside [-size, size) are skipped.
    Params: zero: out; add: upd, idx, out. fp32 only (atomic adds)."""

    pre: int
    n_idx: int
    size: int
    post: int
    zero: bool = False
    idx_dtype: DType = DType.I64

    def __post_init__(self) -> None:
        _pos(("pre", self.pre), ("n_idx", self.n_idx), ("size", self.size), ("post", self.post))
        _req(self.idx_dtype in INDEX_DTYPES, "scatter_add indices are int32/int64")

    @property
    def dtype(self) -> DType:
        return DType.F32


@dataclasses.dataclass(frozen=True)
class InitSpec:
    """out[i] for i in [0, sum of sizes): segment by segment zeros, ones or bound * a 23-bit uniform
    from the seed (fusec.reference_train.init). Params: seed, out."""

    segments: tuple[tuple[int, str, float], ...]
    dtype: DType
    seed_dtype: DType = DType.I64

    def __post_init__(self) -> None:
        _req(len(self.segments) >= 1, "init needs a segment")
        for n, kind, bound in self.segments:
            _ints((n,), "segment size", 0)
            _req(kind in INIT_KINDS, f"init segment kind must be one of {INIT_KINDS}")
            _req(isinstance(bound, float) and math.isfinite(bound) and abs(bound) < 3e38, "init bound is a finite float")
            _req(kind != "uniform" or self.dtype in FLOATS, "uniform init needs a float dtype")
        _req(self.dtype in FLOATS + INDEX_DTYPES, "init writes a float or an integer tensor")
        _req(self.seed_dtype in INDEX_DTYPES, "the seed is int32/int64")
        _pos(("init size", self.numel))

    @property
    def numel(self) -> int:
        return sum(s[0] for s in self.segments)


@dataclasses.dataclass(frozen=True)
class AdamWSpec:
    """One phase of ``adamw`` over gradients of ``sizes`` laid end to end (each segment split into
    chunks of ADAMW_CHUNK elements, one block per chunk):

    - "norm": partial sums of squares of the gradients, one double per chunk. Params: partial, g0..;
    - "scalars" (one block): the step counter += 1; then from it and the partials (when clipping)
      the fp32 scalars [clip coef, step size, sqrt(1 - beta2^t), 1 - lr_t * wd]. Params: step, partial, scalars;
    - "update": the AdamW update of each element (fusec.reference_train.adamw's arithmetic,
      operation for operation, no fused multiply-adds). Params: params, m, v, scalars, g0..
    """

    phase: str
    sizes: tuple[int, ...]
    grad_dtypes: tuple[DType, ...]
    decay: tuple[bool, ...]
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    schedule: str
    warmup_steps: int
    total_steps: int
    max_grad_norm: float

    def __post_init__(self) -> None:
        _req(self.phase in ("norm", "scalars", "update"), f"adamw phase {self.phase!r}")
        _req(1 <= len(self.sizes) <= ADAMW_MAX_SEGMENTS, f"adamw takes 1..{ADAMW_MAX_SEGMENTS} gradients")
        _ints(self.sizes, "segment sizes", 1)
        _req(len(self.grad_dtypes) == len(self.sizes) == len(self.decay), "one dtype and decay flag per gradient")
        _req(all(d in FLOATS for d in self.grad_dtypes), "gradients are float")
        for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm"):
            v = getattr(self, name)
            _req(isinstance(v, float) and math.isfinite(v) and v >= 0, f"adamw {name} must be a finite float >= 0")
        _req(self.schedule in SCHEDULES, "adamw schedule")
        _ints((self.warmup_steps, self.total_steps), "adamw steps", 0)

    @property
    def chunks(self) -> tuple[int, ...]:
        """Blocks per segment."""
        return tuple(-(-n // ADAMW_CHUNK) for n in self.sizes)

    @property
    def blocks(self) -> int:
        return sum(self.chunks)


@dataclasses.dataclass(frozen=True)
class SoftmaxGradSpec:
    """dx = scale * p * (dp - sum(dp * p)) over rows of ``cols`` elements (x viewed [outer, cols,
    inner]; one warp per row). Params: p, dp, out."""

    outer: int
    cols: int
    inner: int
    dtype: DType
    scale: float = 1.0

    def __post_init__(self) -> None:
        _pos(("outer", self.outer), ("cols", self.cols), ("inner", self.inner))
        _req(self.dtype in FLOATS, "softmax_grad is float")
        _req(isinstance(self.scale, float) and math.isfinite(self.scale), "softmax_grad scale is a finite float")


@dataclasses.dataclass(frozen=True)
class LayerNormGradSpec:
    """LayerNorm's input gradient per row of ``cols`` (one warp per row, statistics recomputed):
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * scale; also dy * xhat.
    Params: x, scale, dy, dx, dyxhat."""

    rows: int
    cols: int
    dtype: DType
    w_dtype: DType
    eps: float

    def __post_init__(self) -> None:
        _pos(("rows", self.rows), ("cols", self.cols))
        _req(self.dtype in FLOATS and self.w_dtype in FLOATS, "layernorm_grad is float")
        _req(isinstance(self.eps, float) and math.isfinite(self.eps) and self.eps >= 0, "eps must be finite and >= 0")

