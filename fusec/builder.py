"""A small graph builder used by tests, by ``models/`` and by the ONNX frontend.

    b = GraphBuilder("mlp")
    x = b.input("x", (4, 16), DType.F32)
    w = b.const(np.ones((16, 8), np.float32), name="w")
    y = b.emit(Op.MATMUL, x, w)
    y = b.emit(Op.GELU, y, approximate="tanh")
    b.output(y)
    g = b.build()          # verified

Every ``emit`` infers the output type from the op's rule, so a builder graph is well typed by
construction; ``build`` runs ``verify`` once more as a final check. Node outputs are named
``t0, t1, ...`` unless a name is given; names are made unique.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value, verify
from fusec.ops import Op, infer, make_attrs


class GraphBuilder:
    def __init__(self, name: str = "graph"):
        self.name = name
        self._inputs: list[Value] = []
        self._outputs: list[Value] = []
        self._nodes: list[Node] = []
        self._consts: list[Value] = []
        self._names: set[str] = set()
        self._counter = 0
        self._states: list[dict[str, str]] = []

    @classmethod
    def extend(cls, graph: Graph) -> GraphBuilder:
        """A builder that continues ``graph``: its inputs, constants, nodes, outputs and states
        come first, and what is emitted next follows them (``fusec.autodiff`` appends a backward
        pass this way). The graph's Value and Node objects are shared, not copied."""
        b = cls(graph.name)
        b._inputs, b._consts, b._nodes = list(graph.inputs), list(graph.constants), list(graph.nodes)
        b._outputs = list(graph.outputs)
        b._names = {v.name for v in graph.values()}
        b._states = [dict(r) for r in graph.meta.get("states") or []]
        return b

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The nodes emitted so far, in order."""
        return tuple(self._nodes)

    def has_name(self, name: str) -> bool:
        return name in self._names

    def unique(self, base: str) -> str:
        """A name not yet used in this graph, derived from ``base``."""
        name = base
        k = 1
        while name in self._names:
            name = f"{base}_{k}"
            k += 1
        self._names.add(name)
        return name

    def _fresh(self) -> str:
        while f"t{self._counter}" in self._names:
            self._counter += 1
        return self.unique(f"t{self._counter}")

    def input(self, name: str, shape: Sequence[int], dtype: DType) -> Value:
        if name in self._names:
            raise ValueError(f"duplicate input name {name!r}")
        v = Value(self.unique(name), shape, dtype)
        self._inputs.append(v)
        return v

    def state(self, name: str, shape: Sequence[int], dtype: DType) -> Value:
        """Declare persistent state ``name`` (a KV cache, a position): read like an input, but
        owned by the plan, kept across runs and entry points; give its new value with ``update``."""
        v = self.input(name, shape, dtype)
        self._states.append({"input": v.name, "output": ""})
        return v

    def update(self, state: Value, new: Value) -> None:
        """The state's value after a run is ``new`` (the same value: unchanged)."""
        rec = next((r for r in self._states if r["input"] == state.name), None)
        if rec is None or rec["output"]:
            raise ValueError(f"{state.name!r} is not a state, or is updated twice")
        if new is not state:  # else: read-only in this graph (output == input, nothing to write back)
            self.output(new)
        rec["output"] = new.name

    def const(self, data: Any, name: str = "c", dtype: DType | None = None) -> Value:
        """A constant; ``data`` is converted to ``dtype`` (default: its own, if fusec supports it)."""
        arr = np.asarray(data)
        dt = dtype if dtype is not None else DType.from_np(arr.dtype)
        arr = np.ascontiguousarray(arr.astype(dt.np, copy=False)).reshape(arr.shape)  # keeps 0-d scalars 0-d
        v = Value(self.unique(name), arr.shape, dt, arr)
        self._consts.append(v)
        return v

    def scalar(self, x: float | int | bool, dtype: DType, name: str = "s") -> Value:
        return self.const(np.array(x, dtype=dtype.np), name=name, dtype=dtype)

    def emit(self, op: Op, *inputs: Value, name: str | None = None, node_name: str = "",
             n_outputs: int | None = None, **attrs: Any) -> Any:
        """Append ``op(inputs; attrs)``; returns its Value (or a tuple for multi-output ops)."""
        attr_rec = attrs.pop("attrs_record", None) or make_attrs(op, **attrs)
        types = infer(op, attr_rec, [(v.shape, v.dtype) for v in inputs])
        outs = []
        for i, (shape, dt) in enumerate(types):
            base = name if name is not None else None
            vname = self.unique(base if i == 0 else f"{base}_{i}") if base else self._fresh()
            outs.append(Value(vname, shape, dt))
        self._nodes.append(Node(op, inputs, outs, attr_rec, node_name))
        if n_outputs is not None and n_outputs != len(outs):
            raise ValueError(f"{op.value} yields {len(outs)} outputs, caller expected {n_outputs}")
        return outs[0] if len(outs) == 1 else tuple(outs)

    def output(self, v: Value, name: str | None = None) -> Value:
        """Mark ``v`` as a graph output. With ``name``, the value is renamed (must be unused)."""
        if name is not None and name != v.name:
            if name in self._names:
                raise ValueError(f"output name {name!r} is already used")
            self._names.discard(v.name)
            self._names.add(name)
            v.name = name
        self._outputs.append(v)
        return v

    def build(self) -> Graph:
        missing = [r["input"] for r in self._states if not r["output"]]
        if missing:
            raise ValueError(f"state(s) {', '.join(map(repr, missing))} declared but never given an update")
        meta = {"states": [dict(r) for r in self._states]} if self._states else {}
        g = Graph(self._inputs, self._outputs, self._nodes, self._consts, self.name, meta)
        verify(g)
        return g
