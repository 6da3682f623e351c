"""Fold-or-emit: the importer's one way to create IR work.

Every ONNX value is bound to a ``Sym``: either a ``Const`` (a numpy array known at import time) or
an IR ``Value`` (computed at run time). ``Emitter.op`` evaluates an IR op eagerly with the numpy
reference when all its inputs are known constants, so shape arithmetic (Shape -> Gather -> Concat
-> Reshape, Range, causal masks) never reaches the IR. The exception is weights: a ``Const`` that
came from a large tensor in the file (> ``WEIGHT_MIN_ELEMS`` elements) is never folded into, so
``Transpose(W)`` / ``Cast(W)`` stay visible as nodes for later passes (weight-transpose caching
counts them). Constants become IR constants only when a run-time op consumes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fusec import reference
from fusec.dtypes import DType
from fusec.errors import InputError, ModelError
from fusec.ir import Node, Value
from fusec.ops import Op, infer, make_attrs
from fusec.shapes import check_size

WEIGHT_MIN_ELEMS = 4096  # a file tensor with more elements than this is a weight, never folded


class Const:
    """An import-time constant. ``weight``: from a large tensor in the file (never folded into)."""

    __slots__ = ("array", "weight", "name")

    def __init__(self, array: Any, weight: bool = False, name: str | None = None):
        self.array = np.asarray(array)
        self.weight = weight
        self.name = name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.array.shape)

    def __repr__(self) -> str:
        return f"Const({self.name!r}: {self.array.dtype}{list(self.array.shape)})"


Sym = Const | Value


def np_dtype(s: Sym) -> np.dtype:
    return s.array.dtype if isinstance(s, Const) else s.dtype.np


class Emitter:
    """Builds the IR node list; names every new value uniquely and never reuses a file name."""

    def __init__(self, label: str, reserved: set[str]):
        self.label = label
        self.reserved = reserved  # every value name in the file: helper values must avoid them
        self.used: set[str] = set()
        self.nodes: list[Node] = []
        self.constants: list[Value] = []
        # keyed by id(); the Const is kept alive alongside so its id cannot be reused
        self._materialized: dict[int, tuple[Const, Value]] = {}
        # values that are a DequantizeLinear of a constant weight (fusec.frontend.onnx_qweights): a
        # MatMul reading one keeps the weight packed
        self.qdq: dict[Value, Any] = {}

    def fresh(self, base: str) -> str:
        """A new name derived from ``base`` that no file value and no emitted value uses."""
        name, k = base, 1
        while name in self.used or name in self.reserved:
            name = f"{base}_{k}"
            k += 1
        self.used.add(name)
        return name

    def claim(self, name: str) -> str:
        """Use a file value name as-is (it is unique in the file); fall back to fresh() if taken."""
        if name and name not in self.used:
            self.used.add(name)
            return name
        return self.fresh(name or "v")

    def value(self, s: Sym, what: str = "") -> Value:
        """The IR value of ``s``: a constant becomes an IR constant on first run-time use."""
        if isinstance(s, Value):
            return s
        key = id(s)
        if key not in self._materialized:
            try:
                dt = DType.from_np(s.array.dtype)
            except ValueError:
                raise ModelError(f"{self.label}: value {(s.name or what)!r} has dtype {s.array.dtype}, "
                                 f"which fusec does not support on a run-time tensor") from None
            arr = np.ascontiguousarray(s.array).reshape(s.array.shape)  # ascontiguousarray makes 0-d 1-d
            v = Value(self.claim(s.name) if s.name else self.fresh(what or "const"), arr.shape, dt, arr)
            self.constants.append(v)
            self._materialized[key] = (s, v)
        return self._materialized[key][1]

    def check_size(self, shape: Sequence[int], what: str, itemsize: int = 1) -> None:
        """A ModelError naming the model and ``what`` when a tensor would pass the size limits
        (``fusec.shapes.max_elements``/``max_bytes``), checked before anything is allocated."""
        try:
            check_size(shape, what, itemsize)
        except InputError as e:
            raise ModelError(f"{self.label}: {e}") from None

    def _check_folded_size(self, op: Op, rec: Any, arrays: list[np.ndarray], node_name: str) -> None:
        try:
            types = infer(op, rec, [(tuple(a.shape), DType.from_np(a.dtype)) for a in arrays])
        except Exception:  # a dtype the IR lacks (shape arithmetic in float64, say): the handler checked
            return
        for shape, dt in types:
            self.check_size(shape, f"node {node_name!r}: the result of {op.value}", dt.itemsize)

    def op(self, op: Op, inputs: Sequence[Sym], name: str | None = None, node_name: str = "",
           **attrs: Any) -> Sym:
        """``op(inputs)``: folded to a Const when every input is a non-weight constant, else a node.

        ``name`` is the file name of the result (used verbatim when free), else a helper name.
        """
        rec = make_attrs(op, **attrs)
        if all(isinstance(s, Const) and not s.weight for s in inputs):
            arrays = [s.array for s in inputs]  # type: ignore[union-attr]
            self._check_folded_size(op, rec, arrays, node_name)
            try:
                with np.errstate(all="ignore"):
                    res = reference.IMPL[op](rec, *arrays)
            except Exception as e:
                raise ModelError(f"{self.label}: node {node_name!r}: cannot evaluate {op.value} on constants "
                                 f"{[list(a.shape) for a in arrays]}: {' '.join(str(e).split())[:200]}") from None
            return Const(np.array(res), name=None)
        ins = [self.value(s, f"{name or node_name or op.value}_in") for s in inputs]
        try:
            types = infer(op, rec, [(v.shape, v.dtype) for v in ins])
        except (ValueError, TypeError) as e:
            raise ModelError(f"{self.label}: node {node_name!r}: {op.value} on "
                             f"{', '.join(v.type_str for v in ins)}: {e}") from None
        outs = []
        for shape, dt in types:
            self.check_size(shape, f"node {node_name!r}: the result of {op.value}", dt.itemsize)
        for i, (shape, dt) in enumerate(types):
            vname = self.claim(name) if (name and i == 0) else self.fresh(f"{name or node_name or op.value}.{op.value}")
            outs.append(Value(vname, shape, dt))
        self.nodes.append(Node(op, ins, outs, rec, node_name))
        return outs[0]
