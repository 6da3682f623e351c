"""What a training model's forward is written against: ``TrainBlocks``, a GraphBuilder whose
parameters are views of one flat fp32 parameter vector (the plan's ``params`` state), or
constants (an inference graph of trained weights), with the compute dtype's casts.

Every parameter is a ``ParamSpec``; the specs' order is the flat vector's layout (each one a
contiguous run, so a parameter is a zero-copy SLICE + RESHAPE view of the state). With a bf16
compute dtype the flat vector is cast once per step (one kernel) and products read views of the
cast copy, while LayerNorm weights and embedding tables (``master=True``) read the fp32 master
values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.errors import ModelError
from fusec.ir import Value
from fusec.ops import Op

INITS = ("normal", "zeros", "ones")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """A trainable tensor: its (Hugging Face) name, shape, initialization and weight decay.
    ``normal`` draws mean 0 and standard deviation ``std`` (uniform on +-std*sqrt(3) on the device:
    the same variance)."""

    name: str
    shape: tuple[int, ...]
    init: str = "normal"
    std: float = 0.02
    decay: bool = True

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ModelError(f"parameter {self.name!r}: init must be one of {', '.join(INITS)}, got {self.init!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def layout(specs: Sequence[ParamSpec]) -> dict[str, tuple[int, ParamSpec]]:
    """{name: (element offset in the flat vector, spec)}; names must be unique."""
    out: dict[str, tuple[int, ParamSpec]] = {}
    off = 0
    for s in specs:
        if s.name in out:
            raise ModelError(f"parameter {s.name!r} is declared twice")
        out[s.name] = (off, s)
        off += s.numel
    return out


def init_segments(specs: Sequence[ParamSpec]) -> tuple[tuple[int, str, float], ...]:
    """The ``INIT`` op's segments for ``specs`` (see fusec.ops_train.InitAttrs)."""
    kind = {"normal": "uniform", "zeros": "zeros", "ones": "ones"}
    return tuple((s.numel, kind[s.init], s.std * math.sqrt(3.0) if s.init == "normal" else 0.0) for s in specs)


@dataclasses.dataclass(frozen=True)
class Unit:
    """What the optimizer steps as one segment: a parameter, or a group of consecutive parameters
    read as one tensor (a fused q/k/v projection); ``view`` is what the model reads."""

    view: Value
    names: tuple[str, ...]
    decay: bool


class TrainBlocks:
    """A GraphBuilder plus the parameters. ``flat``: the fp32 parameter state (training and eval
    graphs); ``weights``: {name: array} to read parameters as constants instead (an inference graph).
    ``cdt``: the dtype products compute in (f32, or bf16 with fp32 master weights)."""

    def __init__(self, b: GraphBuilder, specs: Sequence[ParamSpec], cdt: DType = DType.F32, *,
                 flat: Value | None = None, weights: Mapping[str, np.ndarray] | None = None):
        if (flat is None) == (weights is None):
            raise ValueError("TrainBlocks reads parameters from a flat state or from weights, one of them")
        if cdt not in (DType.F32, DType.BF16):
            raise ModelError(f"training computes in f32 or bf16, not {cdt.value}")
        self.b, self.cdt, self.flat, self.weights = b, cdt, flat, weights
        self.specs = list(specs)
        self.layout = layout(self.specs)
        self.views: dict[str, Value] = {}
        self._master: dict[str, bool] = {}
        self._groups: dict[tuple[str, ...], Value] = {}
        self._in_group: dict[str, tuple[str, ...]] = {}
        self._cast: Value | None = None
        self._scalars: dict[tuple[float, DType], Value] = {}

    # ---- parameters ---------------------------------------------------------------------------
    def param(self, name: str, master: bool = False) -> Value:
        """The parameter ``name`` (in ``cdt``, or fp32 with ``master``), one view per parameter."""
        if name not in self.layout:
            raise ModelError(f"the model reads parameter {name!r}, which it does not declare")
        if name in self._in_group:
            raise ModelError(f"parameter {name!r} is read alone and as part of {', '.join(self._in_group[name])}")
        if name in self.views:
            if self._master[name] != (master or self.cdt == DType.F32):
                raise ModelError(f"parameter {name!r} is read both in fp32 and in {self.cdt.value}")
            return self.views[name]
        off, spec = self.layout[name]
        wide = master or self.cdt == DType.F32
        v = self._view(name, [name], off, spec.numel, spec.shape, wide)
        self.views[name] = v
        self._master[name] = wide
        return v

    def param_group(self, names: Sequence[str], master: bool = False) -> Value:
        """Consecutive parameters of one trailing shape read as one tensor stacked along the first
        axis (q, k and v weights [3D, D]): a single view, so one product computes all three."""
        key = tuple(names)
        if key in self._groups:
            return self._groups[key]
        for n in key:
            if n not in self.layout:
                raise ModelError(f"the model reads parameter {n!r}, which it does not declare")
            if n in self.views or n in self._in_group:
                raise ModelError(f"parameter {n!r} is read twice (alone or in another group)")
        specs = [self.layout[n][1] for n in key]
        offs = [self.layout[n][0] for n in key]
        if any(o + s.numel != nxt for o, s, nxt in zip(offs, specs, offs[1:])) or len({s.shape[1:] for s in specs}) != 1:
            raise ModelError(f"parameters {', '.join(map(repr, key))} are not consecutive of one trailing shape")
        shape = (sum(s.shape[0] for s in specs),) + specs[0].shape[1:]
        v = self._view(".".join(key[0].split(".")[:-2] + ["qkv" if len(key) == 3 else "group", key[0].split(".")[-1]]),
                       key, offs[0], sum(s.numel for s in specs), shape, master or self.cdt == DType.F32)
        self._groups[key] = v
        for n in key:
            self._in_group[n] = key
        return v

    def _view(self, name: str, names: Sequence[str], off: int, numel: int, shape: tuple[int, ...], wide: bool) -> Value:
        if self.weights is not None:
            arr = np.concatenate([np.asarray(self.weights[n], np.float32).reshape(-1) for n in names]).reshape(shape)
            return self.b.const(arr, name=name, dtype=DType.F32 if wide else self.cdt)
        src = self.flat if wide else self._cast_flat()
        assert src is not None
        v = self.b.emit(Op.SLICE, src, axes=(0,), starts=(off,), ends=(off + numel,), steps=(1,))
        return self.b.emit(Op.RESHAPE, v, shape=shape, name=self.b.unique(name) if self.b.has_name(name) else name)

    def _cast_flat(self) -> Value:
        if self._cast is None:
            assert self.flat is not None
            self._cast = self.b.emit(Op.CAST, self.flat, to=self.cdt, name=f"params.{self.cdt.value}")
        return self._cast

    def trainable(self) -> list[Unit]:
        """What the optimizer steps, in the flat vector's order; ModelError naming a declared
        parameter never read, or a group whose parameters differ in weight decay."""
        unused = [s.name for s in self.specs if s.name not in self.views and s.name not in self._in_group]
        if unused:
            raise ModelError(f"the model declares parameter(s) it never reads: {', '.join(map(repr, unused[:5]))}")
        out, done = [], set()
        for s in self.specs:
            key = self._in_group.get(s.name)
            if key is None:
                out.append(Unit(self.views[s.name], (s.name,), s.decay))
            elif key not in done:
                done.add(key)
                decay = {self.layout[n][1].decay for n in key}
                if len(decay) != 1:
                    raise ModelError(f"parameters {', '.join(map(repr, key))} are stepped together but differ in decay")
                out.append(Unit(self._groups[key], key, decay.pop()))
        return out

    # ---- ops ----------------------------------------------------------------------------------
    def op(self, op: Op, *inputs: Value, **attrs: Any) -> Any:
        return self.b.emit(op, *inputs, **attrs)

    def scalar(self, x: float, dtype: DType) -> Value:
        key = (float(x), dtype)
        v = self._scalars.get(key)
        if v is None:
            v = self._scalars[key] = self.b.scalar(x, dtype, name=f"scalar_{dtype.value}_{x!r}")
        return v

    def to_cdt(self, x: Value) -> Value:
        return x if x.dtype == self.cdt else self.op(Op.CAST, x, to=self.cdt)

    def to_f32(self, x: Value) -> Value:
        return x if x.dtype == DType.F32 else self.op(Op.CAST, x, to=DType.F32)
