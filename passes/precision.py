"""Storage precision: store every fp32 tensor of the graph as ``options.storage_dtype``.

Runs after pattern recognition, so the high-level ops (norms, softmax, attention, RoPE) compute
in fp32 inside their kernels and only their inputs and outputs are stored in half precision.
The graph is rebuilt with new Value objects (the caller's graph is left untouched); each node's
output types are re-inferred from its op's rule, and ``cast`` nodes that targeted fp32 now target
the storage dtype (``simplify`` then drops the ones that became no-ops).

Constants are converted with saturation to the finite range of the storage dtype: HF models add
``finfo(float32).min`` as a mask value, which fp16 would turn into -inf, and a fully masked row
would then produce NaN (-inf - -inf) that spreads through the next layer.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from fusec.bulk import cast_clipped
from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value
from fusec.ops import CastAttrs, infer
from fusec.passes.base import PassOptions, PassResult

NAME = "precision"


def _convert_const(c: Value, dt: DType) -> Value:
    assert c.data is not None
    limit = float(ml_dtypes.finfo(dt.np).max)  # the target's own max: fp32's max rounds up to inf in bf16
    # reshape: np.ascontiguousarray turns a 0-d array into shape (1,)
    data = cast_clipped(np.asarray(c.data), dt.np, limit)  # = np.clip(...).astype(...), blockwise (fusec.bulk)
    return Value(c.name, c.shape, dt, data)


def run(graph: Graph, options: PassOptions) -> PassResult:
    target = DType(options.storage_dtype)
    if target == DType.F32:
        return PassResult(graph.copy(), False)
    if not target.is_float:
        raise ValueError(f"storage dtype must be a float type, got {target.value}")

    def retype(dt: DType) -> DType:
        return target if dt == DType.F32 else dt

    mapping: dict[Value, Value] = {}
    for v in graph.inputs:
        mapping[v] = Value(v.name, v.shape, retype(v.dtype))
    consts = []
    for c in graph.constants:
        nc = _convert_const(c, target) if c.dtype == DType.F32 else c
        mapping[c] = nc
        consts.append(nc)
    nodes = []
    for n in graph.nodes:
        attrs = n.attrs
        if isinstance(attrs, CastAttrs) and attrs.to == DType.F32:
            attrs = dataclasses.replace(attrs, to=target)
        ins = [mapping[v] for v in n.inputs]
        types = infer(n.op, attrs, [(v.shape, v.dtype) for v in ins])
        outs = [Value(o.name, shape, dt) for o, (shape, dt) in zip(n.outputs, types)]
        mapping.update(zip(n.outputs, outs))
        nodes.append(Node(n.op, ins, outs, attrs, n.name))
    meta = dict(graph.meta)
    meta["storage_dtype"] = target.value
    g = Graph([mapping[v] for v in graph.inputs], [mapping[v] for v in graph.outputs], nodes, consts, graph.name, meta)
    return PassResult(g, True)
