"""What a graph's weights are stored as, and how many bytes one run (a decode step) reads.

``weight_formats(graph)`` (``fusec inspect``, the plan's report): one record per weight a product
or an embedding gather reads — its format (a packed format of ``fusec.quant``, or the dtype it is
stored in), shape, bytes and bits per weight — a summary per format, and ``step_bytes``: the weight
bytes one run reads at the least, every constant once except embedding tables, of which only the
rows gathered are read (a decode step at batch B reads B rows).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from fusec.ir import Graph, Node, Value
from fusec.ops import Op


def _nodes(graph: Graph, outer: dict[Value, Value] | None = None) -> Iterator[Node]:
    """Every node, fused bodies' too, with inputs that are body inputs replaced by the outer values."""
    for n in graph.nodes:
        if n.op == Op.FUSED:
            body = n.attrs.body
            inner = {b: (outer or {}).get(o, o) for b, o in zip(body.inputs, n.inputs)}
            yield from _nodes(body, inner)
        elif outer and any(v in outer for v in n.inputs):
            yield Node(n.op, [outer.get(v, v) for v in n.inputs], n.outputs, n.attrs, n.name)
        else:
            yield n


def _base(names: list[str]) -> str:
    prefix = os.path.commonprefix(names)
    return prefix.rstrip(".") or names[0]


def weight_formats(graph: Graph) -> dict[str, Any]:
    tensors: list[dict[str, Any]] = []
    seen: set[Value] = set()
    gathered: dict[Value, int] = {}  # table -> bytes of the rows one run reads
    for n in _nodes(graph):
        if n.op == Op.QMATMUL:
            ops = n.inputs[1:]
            if not all(v.is_const for v in ops) or ops[0] in seen:
                continue
            seen.update(ops)
            b = sum(v.nbytes for v in ops)
            a = n.attrs
            tensors.append({"name": _base([v.name for v in ops]), "format": a.format, "group": a.group,
                            "shape": [a.n, a.k], "bytes": b, "bits_per_weight": round(8 * b / (a.n * a.k), 3)})
        elif n.op == Op.MATMUL and n.inputs[1].is_const and len(n.inputs[1].shape) == 2 and n.inputs[1] not in seen:
            w = n.inputs[1]
            seen.add(w)
            tensors.append({"name": w.name, "format": w.dtype.value, "shape": list(w.shape), "bytes": w.nbytes,
                            "bits_per_weight": 8 * w.dtype.itemsize})
        elif n.op == Op.QGATHER and all(v.is_const for v in n.inputs[1:]):
            ops, a = n.inputs[1:], n.attrs
            b = sum(v.nbytes for v in ops)
            for v in ops:  # each packed operand: the rows gathered
                gathered[v] = gathered.get(v, 0) + n.inputs[0].numel * (v.nbytes // a.n)
            if ops[0] not in seen:
                seen.update(ops)
                tensors.append({"name": _base([v.name for v in ops]), "format": a.format, "group": a.group,
                                "shape": [a.n, a.k], "bytes": b, "bits_per_weight": round(8 * b / (a.n * a.k), 3),
                                "embedding": True})
        elif n.op == Op.GATHER and n.attrs.axis == 0 and n.inputs[0].is_const and len(n.inputs[0].shape) == 2:
            t, ids = n.inputs
            row = t.nbytes // max(1, t.shape[0])
            gathered[t] = gathered.get(t, 0) + ids.numel * row
            if t not in seen:
                seen.add(t)
                tensors.append({"name": t.name, "format": t.dtype.value, "shape": list(t.shape), "bytes": t.nbytes,
                                "bits_per_weight": 8 * t.dtype.itemsize, "embedding": True})
    read = {v for n in _nodes(graph) for v in n.inputs if v.is_const}
    step = sum(min(v.nbytes, gathered[v]) if v in gathered and not _also_product(graph, v) else v.nbytes for v in read)
    summary: dict[str, dict[str, int]] = {}
    for t in tensors:
        s = summary.setdefault(t["format"], {"tensors": 0, "weights": 0, "bytes": 0})
        s["tensors"] += 1
        s["weights"] += t["shape"][0] * t["shape"][1]
        s["bytes"] += t["bytes"]
    return {"tensors": tensors, "by_format": summary, "step_bytes": step}


def _also_product(graph: Graph, table: Value) -> bool:
    """A tied table a product reads whole (the LM head) besides the gather."""
    return any(n.op in (Op.MATMUL, Op.QMATMUL) and table in n.inputs[1:] for n in _nodes(graph))
