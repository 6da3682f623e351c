"""MLP graphs (Linear -> activation -> Linear [+ residual]) for the fused-MLP tests, CPU and GPU."""

from __future__ import annotations

from typing import Any

import numpy as np

from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph, Value
from fusec.ops import Op
from fusec.passes.subgraph import Cut, extract

ACTS = ("gelu_tanh", "gelu", "relu", "silu", "quick_gelu")


def _act(b: GraphBuilder, t: Value, act: str, dt: DType) -> Value:
    if act == "gelu_tanh":
        return b.emit(Op.GELU, t, approximate="tanh")
    if act == "gelu":
        return b.emit(Op.GELU, t, approximate="none")
    if act == "relu":
        return b.emit(Op.RELU, t)
    if act == "silu":
        return b.emit(Op.SILU, t)
    # x * sigmoid(1.702 x): a chain of elementwise ops with a scalar, not one recognized activation
    return b.emit(Op.MUL, t, b.emit(Op.SIGMOID, b.emit(Op.MUL, t, b.scalar(1.702, dt))))


def mlp_graph(dt: DType, lead: tuple[int, ...], k: int, f: int, n: int, *, act: str = "gelu_tanh",
              w1_nk: bool = False, w2_nk: bool = False, bias: bool = True, residual: bool = True,
              seed: int = 0) -> Graph:
    """y = [r +] (act(x @ W1 [+ b1]) @ W2 [+ b2]); W stored [N, K] and read with trans_b where ``*_nk``."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder("mlp")
    x = b.input("x", (*lead, k), dt)

    def linear(h: Value, rows: int, cols: int, nk: bool, name: str) -> Value:
        w = (rng.standard_normal((cols, rows) if nk else (rows, cols)) / np.sqrt(rows)).astype(np.float32)
        y = b.emit(Op.MATMUL, h, b.const(w, name=f"{name}.w", dtype=dt), trans_b=nk)
        if bias:
            y = b.emit(Op.ADD, y, b.const(rng.uniform(-0.5, 0.5, cols).astype(np.float32), name=f"{name}.b", dtype=dt))
        return y

    y = linear(x, k, f, w1_nk, "fc")
    y = linear(_act(b, y, act, dt), f, n, w2_nk, "proj")
    if residual:
        y = b.emit(Op.ADD, b.input("r", (*lead, n), dt), y)
    b.output(y, "y")
    return b.build()


def body_of(g: Graph) -> Cut:
    """The whole graph cut out as the fusion pass cuts a group (weights are body inputs the outer
    graph feeds constants; scalars stay inside)."""
    return extract(g.nodes, list(g.outputs), "mlp")


def feeds(g: Graph, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v.name: rng.uniform(-1, 1, v.shape).astype(np.float32).astype(v.dtype.np) for v in g.inputs}


def kernel_args(cut: Cut, plan: Any, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The host array of each kernel parameter before ``out``, in ``MlpSpec``'s order."""
    outer = dict(zip(cut.body.inputs, cut.reads))

    def arr(v: Value) -> np.ndarray:
        o = outer.get(v, v)
        return np.ascontiguousarray(o.data) if o.data is not None else inputs[o.name]

    args = [arr(plan.m1.inputs[0]), arr(plan.m1.inputs[1]), arr(plan.m2.inputs[1])]
    args += [arr(o.value) for o in plan.hidden_operands + plan.out_operands if o.kind != "acc"]
    return args
