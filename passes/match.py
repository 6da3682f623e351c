"""Shared machinery of the pattern passes: graph queries (``Ctx``), algebraic flatteners that make a
matcher indifferent to operand order and to how an exporter grouped a product or a sum, and a
``Rewriter`` that swaps a matched subgraph for new nodes.

The rewrite contract (one mechanism for every recognition pass): a match has a *root* node whose
output Values keep their identity -- the replacement nodes produce exactly those Value objects, so
every reader (and a named graph output) sees the new producer without renaming anything. Matched
interior nodes are dropped once nothing reads them any more; a matcher must check that interior
values have no readers outside the match (``Ctx.only_used_by``) or they simply stay alive.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import networkx as nx
import numpy as np

from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value
from fusec.ops import Op, infer
from fusec.passes import subgraph
from fusec.passes.base import PassOptions, PassResult

# Layer numbers in HF/ONNX names: "layers.3", "/h.3/", "layer.3", "blocks.3".
_LAYER_RE = re.compile(r"(?:^|[^a-z])(layers?|h|blocks?)[._/](\d+)")


def layer_of_name(name: str) -> str | None:
    m = _LAYER_RE.search(name)
    return f"{m.group(1)}.{m.group(2)}" if m else None


class Ctx:
    """Read-only queries over one graph (producers, users, constants), cached."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._prod = graph.producers()
        self._users = graph.users()
        self._outs = set(graph.outputs)
        self._layer: dict[Node, str | None] = {}

    def prod(self, v: Value, op: Op | None = None) -> Node | None:
        n = self._prod.get(v)
        return n if n is not None and (op is None or n.op == op) else None

    def users(self, v: Value) -> list[Node]:
        return self._users.get(v, [])

    def is_output(self, v: Value) -> bool:
        return v in self._outs

    def single_use(self, v: Value) -> bool:
        return len(self.users(v)) == 1 and v not in self._outs

    def only_used_by(self, v: Value, nodes: Iterable[Node]) -> bool:
        allowed = set(nodes)
        return v not in self._outs and all(u in allowed for u in self.users(v))

    @staticmethod
    def scalar(v: Value) -> float | None:
        """The value of a constant whose elements are all equal (a splat), else None."""
        if v.data is None or v.data.size == 0 or v.dtype == DType.BOOL:
            return None
        flat = v.data.reshape(-1)
        first = flat[0]
        if flat.size > 1 and not np.all(flat == first):
            return None
        return float(first)

    def layer(self, node: Node) -> str | None:
        """The transformer layer a node belongs to, from its own name or the nearest named weight
        upstream (built-in models leave node names empty but name every weight)."""
        if node in self._layer:
            return self._layer[node]
        found = None
        seen: set[Node] = set()
        frontier = [node]
        if self._model_level(node):
            self._layer[node] = None
            return None
        for _ in range(8):  # a few hops: the projection weights are close to every pattern
            nxt: list[Node] = []
            for n in frontier:
                for text in (n.name, *(v.name for v in n.outputs)):
                    found = found or layer_of_name(text)
                for v in n.inputs:
                    if v.data is not None and not found:
                        found = layer_of_name(v.name)
                    p = self._prod.get(v)
                    if p is not None and p not in seen:
                        seen.add(p)
                        if not self._model_level(p):  # what reads the model's head or tail is not a layer's
                            nxt.append(p)
            if found or not nxt:
                break
            frontier = nxt
        self._layer[node] = found
        return found

    @staticmethod
    def _model_level(node: Node) -> bool:
        """A node reading its own named, layer-less parameter ("ln_f.weight", "model.norm.weight", the LM head's or
        the embedding's table) belongs to the model, not to the layer upstream of it."""
        own = [v.name for v in node.inputs if v.data is not None and v.numel > 1 and "." in v.name]
        return bool(own) and not any(layer_of_name(t) for t in (node.name, *own, *(v.name for v in node.outputs)))

    def where(self, node: Node) -> str:
        """``layers.3: <node name or output name> (op)``: names the node for decline messages."""
        label = f"{subgraph.label(node)} ({node.op.value})"
        lay = self.layer(node)
        return f"{lay}: {label}" if lay else label


# ---- algebraic flatteners ----------------------------------------------------------------------


def factors(ctx: Ctx, v: Value, nodes: list[Node], root: bool = True, inv: list[Value] | None = None,
            through_cast: bool = False) -> tuple[float, list[Value]]:
    """View ``v`` as ``coef * f1 * f2 * ... / (g1 * g2 ...)`` through MUL, NEG, DIV and RECIPROCAL.

    Divisors that are not constants go to ``inv`` (a DIV or RECIPROCAL by a tensor is declined as
    a leaf when ``inv`` is None). ``through_cast`` also enters float-to-float CASTs. Interior nodes
    (all but ``v``'s producer) are entered only if their value has one reader, so the factors are
    exactly what the consumed nodes (appended to ``nodes``) computed.
    """
    c = ctx.scalar(v)
    if c is not None:
        return c, []
    n = ctx.prod(v)
    if n is None or not (root or ctx.single_use(v)):
        return 1.0, [v]

    def sub(x: Value) -> tuple[float, list[Value]]:
        return factors(ctx, x, nodes, False, inv, through_cast)

    if n.op == Op.MUL:
        nodes.append(n)
        (ca, fa), (cb, fb) = sub(n.inputs[0]), sub(n.inputs[1])
        return ca * cb, fa + fb
    if n.op == Op.NEG:
        nodes.append(n)
        ca, fa = sub(n.inputs[0])
        return -ca, fa
    if n.op == Op.DIV and n.inputs[0].dtype.is_float:
        d = ctx.scalar(n.inputs[1])
        if d not in (None, 0.0):
            nodes.append(n)
            ca, fa = sub(n.inputs[0])
            return ca / float(d), fa  # type: ignore[arg-type]
        if inv is not None and d is None:
            nodes.append(n)
            inv.append(n.inputs[1])
            return sub(n.inputs[0])
    if n.op == Op.RECIPROCAL and inv is not None:
        nodes.append(n)
        inv.append(n.inputs[0])
        return 1.0, []
    if through_cast and n.op == Op.CAST and n.inputs[0].dtype.is_float and n.attrs.to.is_float:
        nodes.append(n)
        return sub(n.inputs[0])
    return 1.0, [v]


def terms(ctx: Ctx, v: Value, nodes: list[Node], root: bool = True) -> tuple[float, list[Value]]:
    """View ``v`` as ``const + t1 + t2 + ...`` through ADD and SUB-of-constant nodes."""
    c = ctx.scalar(v)
    if c is not None:
        return c, []
    n = ctx.prod(v)
    if n is None or not (root or ctx.single_use(v)):
        return 0.0, [v]
    if n.op == Op.ADD:
        nodes.append(n)
        ca, ta = terms(ctx, n.inputs[0], nodes, False)
        cb, tb = terms(ctx, n.inputs[1], nodes, False)
        return ca + cb, ta + tb
    if n.op == Op.SUB and ctx.scalar(n.inputs[1]) is not None:
        nodes.append(n)
        ca, ta = terms(ctx, n.inputs[0], nodes, False)
        return ca - float(ctx.scalar(n.inputs[1])), ta  # type: ignore[arg-type]
    return 0.0, [v]


def close(a: float, b: float, rel: float = 1e-3) -> bool:
    """Constants as exporters write them (fp32-rounded, sqrt(2) vs 1/sqrt(2)...) match loosely."""
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


# ---- rewriting -----------------------------------------------------------------------------------


class Rewriter:
    """Collects replacements for one pass and builds the new Graph once at the end."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._names = {v.name for v in graph.values()}
        self._repl: dict[Node, list[Node]] = {}
        self._claimed: set[Node] = set()
        self._consts: list[Value] = []
        self._redirect: dict[Value, Value] = {}

    def claimed(self, nodes: Iterable[Node]) -> bool:
        return any(n in self._claimed for n in nodes)

    def fresh_name(self, base: str) -> str:
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        self._names.add(name)
        return name

    def const(self, data: np.ndarray, base: str) -> Value:
        arr = np.ascontiguousarray(data)
        v = Value(self.fresh_name(base), arr.shape, DType.from_np(arr.dtype), arr)
        self._consts.append(v)
        return v

    def node(self, op: Op, inputs: Sequence[Value], attrs: Any, base: str = "", out: Value | None = None,
             name: str = "") -> Node:
        """A new node; its output is ``out`` (a Value being re-produced) or a fresh typed Value."""
        (shape, dt), = infer(op, attrs, [(v.shape, v.dtype) for v in inputs])
        if out is None:
            out = Value(self.fresh_name(base or op.value), shape, dt)
        elif out.shape != tuple(shape) or out.dtype != dt:
            raise ValueError(f"replacement {op.value} yields {dt.value}{list(shape)}, {out.name!r} is {out.type_str}")
        return Node(op, inputs, [out], attrs, name)

    def replace(self, root: Node, new_nodes: list[Node], matched: Iterable[Node]) -> None:
        """Put ``new_nodes`` where ``root`` was (they re-produce root's outputs); claim ``matched``."""
        self._repl[root] = new_nodes
        self._claimed.update(matched)
        self._claimed.add(root)

    def redirect(self, old: Value, new: Value) -> None:
        """Every reader of ``old`` reads ``new`` instead (same type; ``old`` must not be a graph output)."""
        assert old.shape == new.shape and old.dtype == new.dtype and old not in self.graph.outputs
        self._redirect[old] = new

    @property
    def changed(self) -> bool:
        return bool(self._repl) or bool(self._redirect)

    def finish(self) -> Graph:
        nodes: list[Node] = []
        # A replacement may re-produce values of matched nodes other than its root (merge_gemms'
        # SLICEs re-produce every branch's output): those old producers go, whoever reads them.
        new_nodes = {m for ms in self._repl.values() for m in ms}
        reproduced = {v for m in new_nodes for v in m.outputs}
        for n in self.graph.nodes:
            if n not in self._repl and any(v in reproduced for v in n.outputs):
                continue
            for m in self._repl.get(n, [n]):
                if any(v in self._redirect for v in m.inputs):  # a new Node: never mutate the old graph's
                    m = Node(m.op, [self._redirect.get(v, v) for v in m.inputs], m.outputs, m.attrs, m.name)
                nodes.append(m)
        nodes = drop_dead(nodes, self.graph.outputs, candidates=self._claimed)
        g = self.graph.copy()
        g.nodes = toposort(nodes, g)
        g.constants = prune_constants(g.constants + self._consts, g.nodes, g.outputs)
        return g


def drop_dead(nodes: list[Node], outputs: Sequence[Value], candidates: set[Node] | None = None) -> list[Node]:
    """Remove nodes (only among ``candidates`` when given) whose outputs nobody reads."""
    live_outs = set(outputs)
    keep = [True] * len(nodes)
    readers: dict[Value, int] = {}
    for n in nodes:
        for v in n.inputs:
            readers[v] = readers.get(v, 0) + 1
    for i in range(len(nodes) - 1, -1, -1):
        n = nodes[i]
        if candidates is not None and n not in candidates:
            continue
        if any(readers.get(v, 0) or v in live_outs for v in n.outputs):
            continue
        keep[i] = False
        for v in n.inputs:
            readers[v] -= 1
    return [n for n, k in zip(nodes, keep) if k]


def prune_constants(consts: list[Value], nodes: Sequence[Node], outputs: Sequence[Value]) -> list[Value]:
    used = {v for n in nodes for v in n.inputs} | set(outputs)
    return [c for c in consts if c in used]


def toposort(nodes: list[Node], graph: Graph) -> list[Node]:
    """Stable topological order: keeps the given order wherever it is already valid (networkx's
    lexicographical sort, keyed by position: the earliest ready node goes first)."""
    defined = set(graph.inputs) | set(graph.constants)
    pos = {n: i for i, n in enumerate(nodes)}
    prod = {v: n for n in nodes for v in n.outputs}
    if all(all(v in defined or pos.get(prod.get(v), len(nodes)) < i for v in n.inputs)  # type: ignore[arg-type]
           for i, n in enumerate(nodes)):
        return nodes
    dag = nx.DiGraph()
    dag.add_nodes_from(nodes)
    dag.add_edges_from((prod[v], n) for n in nodes for v in n.inputs if v in prod)
    try:
        return list(nx.lexicographical_topological_sort(dag, key=pos.__getitem__))
    except nx.NetworkXUnfeasible:
        raise ValueError("rewrite created a cycle") from None  # a legality check failed to reject a match


def count_ops(graph: Graph, op: Op) -> int:
    return sum(1 for n in graph.nodes if n.op == op)


def set_pattern_count(graph: Graph, key: str, n: int) -> None:
    """graph.meta["patterns"][key] = n (a fresh dict: never mutate a record an old graph shares)."""
    pats = dict(graph.meta.get("patterns", {}))
    pats[key] = n
    graph.meta["patterns"] = pats


def recognize(graph: Graph, options: PassOptions, roots: tuple[Op, ...],
              match: Callable[[Ctx, Rewriter, Node, PassOptions], Any], counts: dict[str, Op | Callable[[Graph], int]],
              stat: str, outermost_first: bool = False) -> PassResult:
    """The driver every recognition pass shares: try ``match`` on each unclaimed node whose op is in
    ``roots`` (last node first with ``outermost_first``, so an outer product claims an inner one
    before the inner could match on its own), finish the rewrite, record ``graph.meta["patterns"]``
    (``counts``: key -> the op to count, or a function of the new graph) and bump ``stat``."""
    ctx, rw = Ctx(graph), Rewriter(graph)
    order = reversed(graph.nodes) if outermost_first else graph.nodes
    found = sum(1 for n in order if n.op in roots and not rw.claimed([n]) and match(ctx, rw, n, options))
    g = rw.finish() if rw.changed else graph.copy()
    for key, what in counts.items():
        set_pattern_count(g, key, count_ops(g, what) if isinstance(what, Op) else what(g))
    options.bump(stat, found)
    return PassResult(g, found > 0)
