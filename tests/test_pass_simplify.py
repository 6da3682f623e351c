"""simplify: no-op removal and layout-chain collapse, with negative cases and output-name rules."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from graph_checks import check_same, rand

from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph, Value
from fusec.ops import Op
from fusec.passes import simplify
from fusec.passes.base import PassOptions

Emit = Callable[[GraphBuilder, Value], Value]

NO_OPS: dict[str, Emit] = {
    "mul1": lambda b, x: b.emit(Op.MUL, x, b.const(np.ones((1, 4), np.float32))),
    "1mul": lambda b, x: b.emit(Op.MUL, b.scalar(1.0, DType.F32), x),
    "add0": lambda b, x: b.emit(Op.ADD, x, b.scalar(0.0, DType.F32)),
    "0add": lambda b, x: b.emit(Op.ADD, b.const(np.zeros(4, np.float32)), x),
    "sub0": lambda b, x: b.emit(Op.SUB, x, b.scalar(0.0, DType.F32)),
    "div1": lambda b, x: b.emit(Op.DIV, x, b.scalar(1.0, DType.F32)),
    "cast_same": lambda b, x: b.emit(Op.CAST, x, to=DType.F32),
    "reshape_same": lambda b, x: b.emit(Op.RESHAPE, x, shape=(3, 4)),
    "transpose_id": lambda b, x: b.emit(Op.TRANSPOSE, x, perm=(0, 1)),
    "expand_same": lambda b, x: b.emit(Op.EXPAND, x, shape=(3, 4)),
    "slice_all": lambda b, x: b.emit(Op.SLICE, x, axes=(0, 1), starts=(0, 0), ends=(3, 4), steps=(1, 1)),
    "tile_1": lambda b, x: b.emit(Op.TILE, x, repeats=(1, 1)),
}

NOT_NO_OPS: dict[str, Emit] = {
    "mul_almost1": lambda b, x: b.emit(Op.MUL, x, b.const(np.array([1, 1, 1, 1.5], np.float32))),
    "mul1_broadcasts": lambda b, x: b.emit(Op.MUL, x, b.const(np.ones((2, 3, 4), np.float32))),
    "0sub": lambda b, x: b.emit(Op.SUB, b.scalar(0.0, DType.F32), x),
    "1div": lambda b, x: b.emit(Op.DIV, b.scalar(1.0, DType.F32), x),
    "cast_f16": lambda b, x: b.emit(Op.CAST, x, to=DType.F16),
    "reshape_other": lambda b, x: b.emit(Op.RESHAPE, x, shape=(4, 3)),
    "transpose_swap": lambda b, x: b.emit(Op.TRANSPOSE, x, perm=(1, 0)),
    "slice_part": lambda b, x: b.emit(Op.SLICE, x, axes=(1,), starts=(1,), ends=(4,), steps=(1,)),
    "slice_reversed": lambda b, x: b.emit(Op.SLICE, x, axes=(0,), starts=(2,), ends=(-1,), steps=(-1,)),
}


def _wrapped(emit: Emit) -> Graph:
    b = GraphBuilder()
    x = b.input("x", (3, 4), DType.F32)
    y = emit(b, b.emit(Op.EXP, x))
    b.output(b.emit(Op.NEG, y), "y")
    return b.build()


@pytest.mark.parametrize("case", sorted(NO_OPS))
def test_no_op_is_removed(case: str) -> None:
    g = _wrapped(NO_OPS[case])
    res = simplify.run(g, PassOptions())
    assert res.changed
    assert [n.op for n in res.graph.nodes] == [Op.EXP, Op.NEG]
    assert res.graph.constants == []
    check_same(g, res.graph, {"x": rand(np.random.default_rng(20261123), 3, 4)})


@pytest.mark.parametrize("case", sorted(NOT_NO_OPS))
def test_look_alike_is_kept(case: str) -> None:
    g = _wrapped(NOT_NO_OPS[case])
    res = simplify.run(g, PassOptions())
    assert not res.changed
    assert [n.op for n in res.graph.nodes] == [n.op for n in g.nodes]


def test_double_reshape_becomes_one_and_round_trip_vanishes() -> None:
    rng = np.random.default_rng(20261124)
    b = GraphBuilder()
    x = b.input("x", (2, 3, 4), DType.F32)
    r = b.emit(Op.RESHAPE, b.emit(Op.RESHAPE, x, shape=(6, 4)), shape=(4, 6))
    back = b.emit(Op.RESHAPE, b.emit(Op.RESHAPE, x, shape=(24,)), shape=(2, 3, 4))
    b.output(b.emit(Op.TANH, r), "a")
    b.output(b.emit(Op.TANH, back), "b")
    g = b.build()
    res = simplify.run(g, PassOptions())
    ops = [(n.op, n.inputs[0].name) for n in res.graph.nodes]
    assert ops == [(Op.RESHAPE, "x"), (Op.TANH, res.graph.nodes[0].outputs[0].name), (Op.TANH, "x")]
    assert res.graph.nodes[0].attrs.shape == (4, 6)
    check_same(g, res.graph, {"x": rand(rng, 2, 3, 4)})


def test_consecutive_transposes_compose() -> None:
    rng = np.random.default_rng(20261125)
    b = GraphBuilder()
    x = b.input("x", (2, 3, 4, 5), DType.F32)
    t = b.emit(Op.TRANSPOSE, b.emit(Op.TRANSPOSE, x, perm=(0, 2, 1, 3)), perm=(3, 0, 2, 1))
    inv = b.emit(Op.TRANSPOSE, b.emit(Op.TRANSPOSE, x, perm=(0, 2, 3, 1)), perm=(0, 3, 1, 2))
    b.output(b.emit(Op.EXP, t), "a")
    b.output(b.emit(Op.EXP, inv), "b")
    g = b.build()
    res = simplify.run(g, PassOptions())
    (tr,) = [n for n in res.graph.nodes if n.op == Op.TRANSPOSE]
    assert tr.inputs[0].name == "x" and tr.attrs.perm == (3, 0, 1, 2)
    assert len(res.graph.nodes) == 3  # the inverse pair vanished entirely
    check_same(g, res.graph, {"x": rand(rng, 2, 3, 4, 5)})


def test_no_op_on_named_output_renames_its_source() -> None:
    rng = np.random.default_rng(20261126)
    b = GraphBuilder()
    x = b.input("x", (3, 4), DType.F32)
    e = b.emit(Op.EXP, x)
    b.output(b.emit(Op.SIN, e), "other")  # another reader of e
    b.output(b.emit(Op.MUL, e, b.scalar(1.0, DType.F32)), "y")
    g = b.build()
    res = simplify.run(g, PassOptions())
    assert [n.op for n in res.graph.nodes] == [Op.EXP, Op.SIN]
    assert res.graph.nodes[0].outputs[0].name == "y"
    assert res.graph.nodes[1].inputs[0].name == "y"
    assert [v.name for v in res.graph.outputs] == ["other", "y"]
    check_same(g, res.graph, {"x": rand(rng, 3, 4)})


def test_no_op_from_input_to_named_output_is_declined_with_reason() -> None:
    b = GraphBuilder()
    x = b.input("x", (3, 4), DType.F32)
    b.output(b.emit(Op.RESHAPE, x, shape=(3, 4)), "y")
    g = b.build()
    opts = PassOptions()
    res = simplify.run(g, opts)
    assert not res.changed and len(res.graph.nodes) == 1
    assert opts.declines and opts.declines[0][0] == "simplify" and "graph output" in opts.declines[0][2]
