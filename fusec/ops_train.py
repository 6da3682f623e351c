"""The training ops' attribute records and shape/dtype rules (``fusec.ops`` maps the ops to them).

- ``SCATTER_ADD`` (updates, indices): the gradient of ``GATHER``: a zero tensor with ``size``
  entries along ``axis``, each update row added at its index (repeated indices add up);
- ``CROSS_ENTROPY`` (logits [.., C], labels [..] int): per row ``logsumexp(x) - x[label]``, 0 on
  rows whose label is ``ignore_index``;
- ``ADAMW`` (params [P], m [P], v [P], step [1] i64, grad_1, .., grad_n) -> (params', m', v',
  step'): one AdamW step over every parameter at once, in place (the four outputs live in their
  inputs' storage, like ``cache_write``); the gradients are laid end to end over the flat
  parameter vector, in input order. The exact arithmetic is ``fusec.reference_train.adamw``;
- ``INIT`` (seed [1] int) -> [P]: a flat vector of segments, each zeros, ones or uniform
  ``(-bound, bound)`` from a counter-based hash of (seed, element index), the same on every
  backend (``fusec.reference_train.init``);
- the fused gradients the VJP rules emit, one row kernel each on the GPU: ``SOFTMAX_GRAD`` (p, dp),
  ``LAYERNORM_GRAD`` (x, scale, dy) -> (dx, dy * xhat) and ``CROSS_ENTROPY_GRAD`` (logits,
  labels, dloss) -> dlogits = (softmax(logits) - onehot(label)) * dloss, 0 on ignored rows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from fusec.dtypes import DType

Shape = tuple[int, ...]
TensorType = tuple[Shape, DType]

SCHEDULES = ("constant", "linear", "cosine")
INIT_KINDS = ("zeros", "ones", "uniform")


@dataclasses.dataclass(frozen=True)
class ScatterAddAttrs:
    """out = zeros with ``size`` entries along ``axis``; ``out[.., idx[j], ..] += upd[.., j, ..]``."""

    axis: int
    size: int


@dataclasses.dataclass(frozen=True)
class CrossEntropyAttrs:
    ignore_index: int = -100


@dataclasses.dataclass(frozen=True)
class SoftmaxGradAttrs:
    """dx = scale * p * (dp - sum(dp * p along ``axis``)): softmax's gradient from its output p."""

    axis: int
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class LayerNormGradAttrs:
    """LayerNorm's input gradient over axes [axis, rank), recomputing mean and variance from x."""

    axis: int
    eps: float


def _finite(x: float, what: str, lo: float = 0.0, lo_open: bool = False) -> float:
    x = float(x)
    if not math.isfinite(x) or x < lo or (lo_open and x == lo):
        raise ValueError(f"{what} must be a finite number {'>' if lo_open else '>='} {lo}, got {x!r}")
    return x


@dataclasses.dataclass(frozen=True)
class AdamWAttrs:
    """AdamW (Loshchilov & Hutter; PyTorch's ``torch.optim.AdamW`` arithmetic) with a learning-rate
    schedule and clipping of the gradients' global norm, all computed on the device.

    At step t (1 for the first step; the ``step`` state counts the steps taken): the learning rate
    is ``lr * f(t)`` with f(t) = t / warmup_steps while t <= warmup_steps, then 1 ("constant"),
    (total - t) / (total - warmup) floored at 0 ("linear"), or 0.5 (1 + cos(pi * min(1, (t -
    warmup) / (total - warmup)))) ("cosine"). With ``max_grad_norm`` > 0 every gradient is first
    scaled by min(1, max_grad_norm / (norm + 1e-6)), norm = the L2 norm of all gradients together.
    ``decay[i]``: whether parameter i (gradient input i) takes weight decay."""

    lr: float
    decay: tuple[bool, ...]
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    max_grad_norm: float = 0.0

    def __post_init__(self) -> None:
        _finite(self.lr, "learning rate", 0.0, lo_open=True)
        for name in ("beta1", "beta2"):
            b = _finite(getattr(self, name), name)
            if b >= 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {b!r}")
        _finite(self.eps, "eps", 0.0, lo_open=True)
        _finite(self.weight_decay, "weight decay")
        _finite(self.max_grad_norm, "max grad norm")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        for name in ("warmup_steps", "total_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"a {self.schedule} schedule needs total_steps ({self.total_steps}) > warmup_steps "
                             f"({self.warmup_steps})")
        object.__setattr__(self, "decay", tuple(bool(d) for d in self.decay))


@dataclasses.dataclass(frozen=True)
class InitAttrs:
    """``segments``: (numel, kind, bound) laid end to end: kind "zeros", "ones" or "uniform" in
    (-bound, bound). ``dtype``: the output's (a float type, or an integer type for zeros/ones)."""

    segments: tuple[tuple[int, str, float], ...]
    dtype: DType = DType.F32

    def __post_init__(self) -> None:
        segs = []
        for seg in self.segments:
            n, kind, bound = seg
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"init segment size must be an integer >= 0, got {n!r}")
            if kind not in INIT_KINDS:
                raise ValueError(f"init segment kind must be one of {', '.join(INIT_KINDS)}, got {kind!r}")
            if kind == "uniform" and not self.dtype.is_float:
                raise ValueError(f"a uniform init segment needs a float dtype, got {self.dtype.value}")
            segs.append((n, kind, _finite(bound, "init bound")))
        object.__setattr__(self, "segments", tuple(segs))

    @property
    def numel(self) -> int:
        return sum(s[0] for s in self.segments)


def scatter_add(a: ScatterAddAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (su, du), (si, di) = t
    if not di.is_int:
        raise ValueError(f"scatter_add indices must be integers, got {di.value}")
    if a.size < 1 or not 0 <= a.axis <= len(su) - len(si):
        raise ValueError(f"scatter_add: axis {a.axis} and size {a.size} do not fit updates {list(su)} "
                         f"indexed by {list(si)}")
    if tuple(su[a.axis:a.axis + len(si)]) != tuple(si):
        raise ValueError(f"scatter_add: updates {list(su)} do not hold indices {list(si)} at axis {a.axis}")
    return [(tuple(su[:a.axis]) + (a.size,) + tuple(su[a.axis + len(si):]), du)]


def cross_entropy(a: CrossEntropyAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (sx, dx), (sl, dl) = t
    if not dx.is_float:
        raise ValueError(f"cross_entropy logits must be floats, got {dx.value}")
    if not dl.is_int:
        raise ValueError(f"cross_entropy labels must be integers, got {dl.value}")
    if len(sx) < 1 or tuple(sx[:-1]) != tuple(sl) or sx[-1] < 1:
        raise ValueError(f"cross_entropy: labels {list(sl)} do not match logits {list(sx)} (one label per row)")
    return [(tuple(sl), dx)]


def adamw(a: AdamWAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    if len(t) < 5:
        raise ValueError("adamw takes params, m, v, step and at least one gradient")
    (sp, dp), (sm, dm), (sv, dv), (ss, ds) = t[:4]
    if len(sp) != 1 or dp not in (DType.F32, DType.F64) or (sm, dm) != (sp, dp) or (sv, dv) != (sp, dp):
        raise ValueError(f"adamw: params, m and v must be one flat f32 (or f64) vector each, got {dp.value}{list(sp)}, "
                         f"{dm.value}{list(sm)}, {dv.value}{list(sv)}")
    if tuple(ss) != (1,) or ds != DType.I64:
        raise ValueError(f"adamw: the step counter must be i64[1], got {ds.value}{list(ss)}")
    grads = t[4:]
    if any(not g[1].is_float for g in grads):
        raise ValueError("adamw: gradients must be floats")
    total = sum(math.prod(g[0]) for g in grads)
    if total != sp[0]:
        raise ValueError(f"adamw: the gradients hold {total} elements, the parameters {sp[0]}")
    if len(a.decay) != len(grads):
        raise ValueError(f"adamw: {len(a.decay)} weight-decay flags for {len(grads)} gradients")
    return [t[0], t[1], t[2], t[3]]


def init(a: InitAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (ss, ds), = t
    if tuple(ss) != (1,) or not ds.is_int:
        raise ValueError(f"init: the seed must be an integer [1], got {ds.value}{list(ss)}")
    return [((a.numel,), a.dtype)]



def softmax_grad(a: SoftmaxGradAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (sp, dp), (sd, dd) = t
    if tuple(sp) != tuple(sd) or dp != dd or not dp.is_float or not 0 <= a.axis < len(sp):
        raise ValueError(f"softmax_grad: p and dp must be one float shape, axis within it; got "
                         f"{dp.value}{list(sp)}, {dd.value}{list(sd)}, axis {a.axis}")
    return [t[0]]


def layernorm_grad(a: LayerNormGradAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (sx, dx), (ss, ds), (sy, dy) = t
    if tuple(sx) != tuple(sy) or dx != dy or not dx.is_float or not 0 <= a.axis < len(sx):
        raise ValueError(f"layernorm_grad: x and dy must be one float shape, axis within it; got "
                         f"{dx.value}{list(sx)}, {dy.value}{list(sy)}, axis {a.axis}")
    if math.prod(ss) != math.prod(sx[a.axis:]) or not ds.is_float:
        raise ValueError(f"layernorm_grad: scale {list(ss)} does not cover the normalized axes {list(sx[a.axis:])}")
    return [t[0], t[0]]


def cross_entropy_grad(a: CrossEntropyAttrs, t: Sequence[TensorType]) -> list[TensorType]:
    (sx, dx), (sl, dl), (sg, dg) = t
    cross_entropy(a, t[:2])
    if tuple(sg) != tuple(sl) or dg != dx:
        raise ValueError(f"cross_entropy_grad: the loss gradient must be {dx.value}{list(sl)}, got {dg.value}{list(sg)}")
    return [t[0]]
