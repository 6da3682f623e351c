"""fusec's graph IR: slotted ``Value``/``Node``/``Graph`` records with nodes in topological order.

Contracts:
- every ``Value`` has a static shape (tuple of ints) and a ``DType``; names are unique per graph;
- a constant is a ``Value`` whose ``data`` is a numpy array of exactly its shape and dtype; it is
  listed in ``Graph.constants`` and produced by no node;
- ``Graph.nodes`` is a topological order: each node's inputs are graph inputs, constants, or
  outputs of earlier nodes. Liveness planning and the runtime rely on this linear order.

Names may come from a model file; they are for people (printer, errors) and are never used as
identifiers in generated code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from fusec.dtypes import DType
from fusec.ops import OP_INFO, Op, Shape, format_attrs, infer


class IRError(ValueError):  # a compiler bug or a malformed hand-built graph, not user input
    """The graph breaks an IR invariant; the message names the node or value at fault."""


class Value:
    __slots__ = ("name", "shape", "dtype", "data")

    def __init__(self, name: str, shape: Sequence[int], dtype: DType, data: np.ndarray | None = None):
        self.name = name
        self.shape: Shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.data = data

    @property
    def is_const(self) -> bool:
        return self.data is not None

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def type_str(self) -> str:
        return f"{self.dtype.value}[{','.join(str(d) for d in self.shape)}]"

    def __repr__(self) -> str:
        return f"Value({self.name!r}: {self.type_str})"


class Node:
    __slots__ = ("op", "inputs", "outputs", "attrs", "name", "kernel")

    def __init__(self, op: Op, inputs: Sequence[Value], outputs: Sequence[Value], attrs: Any, name: str = "",
                 kernel: Any = None):
        self.op = op
        self.inputs: tuple[Value, ...] = tuple(inputs)
        self.outputs: tuple[Value, ...] = tuple(outputs)
        self.attrs = attrs
        self.name = name  # provenance (e.g. the ONNX node name), for messages only
        # how the node runs (passes/select_kernels.py Selection), set by kernel selection, read by the lowering
        self.kernel = kernel

    @property
    def output(self) -> Value:
        """The single output of a one-output node."""
        if len(self.outputs) != 1:
            raise IRError(f"node {self.describe()} has {len(self.outputs)} outputs, not one")
        return self.outputs[0]

    def describe(self) -> str:
        who = f" ({self.name!r})" if self.name else ""
        return f"{self.op.value}{who} -> {', '.join(repr(v.name) for v in self.outputs)}"

    def __repr__(self) -> str:
        return f"Node({self.describe()})"


class Graph:
    __slots__ = ("inputs", "outputs", "nodes", "constants", "name", "meta")

    def __init__(self, inputs: Sequence[Value], outputs: Sequence[Value], nodes: Sequence[Node],
                 constants: Sequence[Value] = (), name: str = "graph", meta: dict[str, Any] | None = None):
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.nodes = list(nodes)
        self.constants = list(constants)
        self.name = name
        # Records passes leave on the graph for reports and later stages (JSON-able values only):
        # fusion candidates and decisions, pattern counts, transposes cached, gemms merged.
        self.meta: dict[str, Any] = dict(meta or {})

    # ---- queries --------------------------------------------------------------------------
    def producers(self) -> dict[Value, Node]:
        return {o: n for n in self.nodes for o in n.outputs}

    def users(self) -> dict[Value, list[Node]]:
        out: dict[Value, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                out.setdefault(v, []).append(n)
        return out

    def values(self) -> Iterable[Value]:
        yield from self.inputs
        yield from self.constants
        for n in self.nodes:
            yield from n.outputs

    def op_histogram(self) -> dict[str, int]:
        hist: dict[str, int] = {}
        for n in self.nodes:
            hist[n.op.value] = hist.get(n.op.value, 0) + 1
        return dict(sorted(hist.items()))

    @property
    def weight_bytes(self) -> int:
        return sum(c.nbytes for c in self.constants)

    @property
    def num_parameters(self) -> int:
        return sum(c.numel for c in self.constants if c.dtype.is_float)

    # ---- state --------------------------------------------------------------------------
    def state_pairs(self) -> list[tuple[Value, Value]]:
        """(state input, its value after the run) for every declared state, in declaration order.

        State (``meta["states"]``: [{"input": name, "output": name}]) is persistent device memory
        the plan owns, kept across runs and shared by a plan's entry points: a KV cache, a
        position. It is read like a graph input and written back from the named graph output
        (output == input: read-only here). The caller neither passes nor receives it."""
        recs = self.meta.get("states") or []
        ins = {v.name: v for v in self.inputs}
        outs = {v.name: v for v in self.outputs}
        pairs = []
        for r in recs:
            src = ins.get(r["input"])
            dst = src if r["output"] == r["input"] else outs.get(r["output"])
            if src is None or dst is None:
                raise IRError(f"state {r['input']!r}: its input or its update {r['output']!r} is not in the graph")
            pairs.append((src, dst))
        return pairs

    def user_inputs(self) -> list[Value]:
        """The inputs a caller passes (the graph inputs that are not state)."""
        state = {r["input"] for r in self.meta.get("states") or []}
        return [v for v in self.inputs if v.name not in state]

    def user_outputs(self) -> list[Value]:
        """The outputs a caller receives (the graph outputs that are not state updates)."""
        state = {r["output"] for r in self.meta.get("states") or []}
        return [v for v in self.outputs if v.name not in state]

    def copy(self) -> Graph:
        """A shallow structural copy: new lists, same Value/Node objects (passes rebuild lists)."""
        return Graph(self.inputs, self.outputs, self.nodes, self.constants, self.name, self.meta)

    def __str__(self) -> str:
        return print_graph(self)


def verify(graph: Graph, *, _body: bool = False) -> None:
    """Check every IR invariant; raise IRError naming the first value or node at fault.

    Every value is defined once, before use; constants carry data of their declared type;
    each node's output types are what its op's rule infers; outputs are defined; a fused node's
    body passes ``verify`` too (recursively) and matches the node's inputs and outputs.
    """
    defined: set[Value] = set()
    names: dict[str, Value] = {}

    def define(v: Value, where: str) -> None:
        if v in defined:
            raise IRError(f"value {v.name!r} is defined twice ({where})")
        other = names.get(v.name)
        if other is not None and other is not v:
            raise IRError(f"two different values share the name {v.name!r} ({where})")
        if not isinstance(v.dtype, DType) or any(d < 0 for d in v.shape):
            raise IRError(f"value {v.name!r} has an invalid type {v.shape} {v.dtype}")
        defined.add(v)
        names[v.name] = v

    for v in graph.inputs:
        if v.is_const:
            raise IRError(f"graph input {v.name!r} carries constant data")
        define(v, "graph input")
    for c in graph.constants:
        if c.data is None:
            raise IRError(f"constant {c.name!r} has no data")
        if tuple(c.data.shape) != c.shape or c.data.dtype != c.dtype.np:
            raise IRError(f"constant {c.name!r} declares {c.type_str} but holds {c.data.dtype}{list(c.data.shape)}")
        define(c, "constant")
    for i, n in enumerate(graph.nodes):
        if n.op not in OP_INFO:
            raise IRError(f"node #{i} {n.describe()}: unknown op {n.op}")
        for v in n.inputs:
            if v not in defined:
                raise IRError(f"node #{i} {n.describe()} uses {v.name!r} before it is defined")
        try:
            types = infer(n.op, n.attrs, [(v.shape, v.dtype) for v in n.inputs])
        except (ValueError, TypeError) as e:
            raise IRError(f"node #{i} {n.describe()}: {e}") from None
        if len(types) != len(n.outputs):
            raise IRError(f"node #{i} {n.describe()}: op yields {len(types)} outputs, node has {len(n.outputs)}")
        for v, (shape, dt) in zip(n.outputs, types):
            if v.shape != tuple(shape) or v.dtype != dt:
                raise IRError(f"node #{i} {n.describe()}: output {v.name!r} is {v.type_str}, "
                              f"rule gives {dt.value}[{','.join(map(str, shape))}]")
            if v.is_const:
                raise IRError(f"node #{i} {n.describe()}: output {v.name!r} carries constant data")
            define(v, f"output of node #{i}")
        if n.op == Op.FUSED:
            _verify_body(n, f"node #{i} {n.describe()}")
    for v in graph.outputs:
        if v not in defined:
            raise IRError(f"graph output {v.name!r} is never defined")
    _verify_state(graph, _body)


def writes_in_place(node: Node) -> list[tuple[int, int]]:
    """(input index, output index) pairs where ``node`` writes the output into the input's storage:
    a ``cache_write``'s cache, an ``adamw``'s four states, and a fused node whose body writes one of its inputs so (the memory
    plan places such outputs in their input's storage; ``verify`` checks nothing reads the old value)."""
    from fusec.ops import Op

    if node.op == Op.CACHE_WRITE:
        return [(0, 0)]
    if node.op == Op.ADAMW:  # params, m, v and the step counter, updated where they are
        return [(0, 0), (1, 1), (2, 2), (3, 3)]
    body = getattr(node.attrs, "body", None)
    if node.op != Op.FUSED or not isinstance(body, Graph):
        return []
    root: dict[Value, int] = {v: i for i, v in enumerate(body.inputs)}
    for n in body.nodes:
        for j, k in writes_in_place(n):
            if n.inputs[j] in root:
                root[n.outputs[k]] = root[n.inputs[j]]
    return [(root[v], k) for k, v in enumerate(body.outputs) if v in root and v not in body.inputs]


def _verify_body(node: Node, where: str) -> None:
    """A fused node's body is a graph obeying every invariant itself (verified recursively), with
    inputs and outputs matching the node's positionally (their types: ``infer`` and the output
    check above); constants inside it are body constants, never body inputs carrying data."""
    body = getattr(node.attrs, "body", None)
    if not isinstance(body, Graph):
        raise IRError(f"{where}: fused body is not a Graph")
    if len(body.inputs) != len(node.inputs) or len(body.outputs) != len(node.outputs):
        raise IRError(f"{where}: fused body has {len(body.inputs)} inputs and {len(body.outputs)} outputs, "
                      f"the node {len(node.inputs)} and {len(node.outputs)}")
    try:
        verify(body, _body=True)
    except IRError as e:
        raise IRError(f"{where}: fused body {body.name!r}: {e}") from None


def _verify_state(graph: Graph, body: bool = False) -> None:
    """State updates are well formed, and in-place writes read nothing stale.

    A ``cache_write`` (or a fused node containing one, ``writes_in_place``) writes into its cache
    input's storage, so that input must be a state or an earlier such write of one (its storage is
    the state's), each consumed once, and no node after the write may read the overwritten value.
    In a fused body (or any graph that declares no state: a region cut out of a larger graph) the
    inputs stand for the outer values, which the enclosing graph checks."""
    pairs = graph.state_pairs()
    body = body or not pairs
    for src, dst in pairs:
        if (src.shape, src.dtype) != (dst.shape, dst.dtype):
            raise IRError(f"state {src.name!r} is {src.type_str} but its update {dst.name!r} is {dst.type_str}")
    roots = {src for src, _ in pairs} | (set(graph.inputs) if body else set())
    written_at: dict[Value, int] = {}  # value -> index of the node that overwrote it in place
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            if v in written_at and written_at[v] != i:
                raise IRError(f"node #{i} {n.describe()} reads {v.name!r} after node #{written_at[v]} "
                              f"overwrote it in place (cache_write)")
        for j, k in writes_in_place(n):
            cache = n.inputs[j]
            if cache not in roots:
                raise IRError(f"node #{i} {n.describe()}: {n.op.value} writes in place, so it needs a state "
                              f"(or an in-place write of one) as input {j}, got {cache.name!r}")
            if cache in written_at:
                raise IRError(f"node #{i} {n.describe()}: {cache.name!r} is written in place twice")
            written_at[cache] = i
            roots.add(n.outputs[k])
    # a state read after its cache_write is caught above; its update must be the last write
    for src, dst in pairs:
        if dst in written_at:
            raise IRError(f"state {src.name!r}: its update {dst.name!r} is overwritten by a later cache_write")


def _fmt_name(name: str) -> str:
    """Names from model files may hold anything; print plain ones bare and quote the rest."""
    if name and all(c.isascii() and (c.isalnum() or c in "._/:-") for c in name):
        return "%" + name
    return "%" + repr(name)


def print_graph(graph: Graph) -> str:
    """Deterministic text form, used for pass dumps and golden tests."""
    lines = [f"graph {graph.name}(" + ", ".join(f"{_fmt_name(v.name)}: {v.type_str}" for v in graph.inputs) + ") {"]
    for c in graph.constants:
        lines.append(f"  const {_fmt_name(c.name)}: {c.type_str}")
    for n in graph.nodes:
        outs = ", ".join(f"{_fmt_name(v.name)}: {v.type_str}" for v in n.outputs)
        ins = ", ".join(_fmt_name(v.name) for v in n.inputs)
        lines.append(f"  {outs} = {n.op.value}{format_attrs(n.attrs)}({ins})")
    lines.append("  return " + ", ".join(_fmt_name(v.name) for v in graph.outputs))
    for r in graph.meta.get("states") or []:
        lines.append(f"  state {_fmt_name(r['input'])} <- {_fmt_name(r['output'])}")
    lines.append("}")
    return "\n".join(lines) + "\n"
