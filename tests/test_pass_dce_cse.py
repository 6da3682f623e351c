"""dce and cse: structure asserted on tiny graphs, numerics compared with the reference."""

from __future__ import annotations

import numpy as np
from graph_checks import check_same, rand

from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ops import Op
from fusec.passes import cse, dce
from fusec.passes.base import PassOptions

# ---- DCE -------------------------------------------------------------------------------------


def test_dce_removes_dead_chain_and_its_constant_but_keeps_unused_input() -> None:
    rng = np.random.default_rng(20261123)
    b = GraphBuilder()
    x = b.input("x", (3, 4), DType.F32)
    b.input("unused", (2,), DType.F32)
    c = b.const(rand(rng, 3, 4), name="dead_c")
    b.emit(Op.EXP, b.emit(Op.ADD, x, c))  # dead: nobody reads it
    b.output(b.emit(Op.TANH, x), "y")
    g = b.build()
    opts = PassOptions()
    res = dce.run(g, opts)
    assert res.changed
    assert [n.op for n in res.graph.nodes] == [Op.TANH]
    assert res.graph.constants == []
    assert [v.name for v in res.graph.inputs] == ["x", "unused"]
    assert opts.stats == {"dce_nodes_removed": 2, "dce_constants_dropped": 1}
    check_same(g, res.graph, {"x": rand(rng, 3, 4), "unused": rand(rng, 2)})


def test_dce_keeps_everything_live_and_constant_outputs() -> None:
    b = GraphBuilder()
    x = b.input("x", (2,), DType.F32)
    k = b.const(np.array([4.0, 5.0], np.float32), name="k")
    b.output(b.emit(Op.NEG, b.emit(Op.EXP, x)), "y")
    b.output(k)
    g = b.build()
    res = dce.run(g, PassOptions())
    assert not res.changed
    assert [n.op for n in res.graph.nodes] == [Op.EXP, Op.NEG] and res.graph.constants == [k]


# ---- CSE -------------------------------------------------------------------------------------


def test_cse_merges_identical_nodes_and_commuted_adds() -> None:
    rng = np.random.default_rng(20261124)
    b = GraphBuilder()
    x = b.input("x", (2, 3), DType.F32)
    y = b.input("y", (2, 3), DType.F32)
    e1, e2 = b.emit(Op.EXP, x), b.emit(Op.EXP, x)
    a1, a2 = b.emit(Op.ADD, e1, y), b.emit(Op.ADD, y, e2)  # same after e2 -> e1, commuted
    b.output(b.emit(Op.MUL, a1, a2), "z")
    g = b.build()
    opts = PassOptions()
    res = cse.run(g, opts)
    assert [n.op for n in res.graph.nodes] == [Op.EXP, Op.ADD, Op.MUL]
    mul = res.graph.nodes[-1]
    assert mul.inputs[0] is mul.inputs[1]
    assert opts.stats["cse_nodes_merged"] == 2
    check_same(g, res.graph, {"x": rand(rng, 2, 3), "y": rand(rng, 2, 3)})


def test_cse_keeps_nodes_that_differ_in_attrs_or_operand_order_of_non_commutative_ops() -> None:
    b = GraphBuilder()
    x = b.input("x", (2, 3), DType.F32)
    y = b.input("y", (2, 3), DType.F32)
    s1, s2 = b.emit(Op.SUB, x, y), b.emit(Op.SUB, y, x)
    r1 = b.emit(Op.REDUCE_SUM, s1, axes=(0,), keepdims=True)
    r2 = b.emit(Op.REDUCE_SUM, s2, axes=(1,), keepdims=True)
    b.output(b.emit(Op.ADD, r1, r2), "z")
    g = b.build()
    res = cse.run(g, PassOptions())
    assert not res.changed
    assert len(res.graph.nodes) == 5


def test_cse_merges_equal_constants_bitwise_only() -> None:
    rng = np.random.default_rng(20261125)
    data = rand(rng, 4)
    b = GraphBuilder()
    x = b.input("x", (4,), DType.F32)
    c1 = b.const(data, name="c1")
    c2 = b.const(data.copy(), name="c2")
    z1 = b.const(np.zeros(4, np.float32), name="z1")
    z2 = b.const(-np.zeros(4, np.float32), name="z2")  # -0.0: same value, different bits
    h = b.emit(Op.ADD, b.emit(Op.MUL, x, c1), b.emit(Op.MUL, x, c2))
    b.output(b.emit(Op.ADD, b.emit(Op.ADD, h, z1), z2), "y")
    g = b.build()
    res = cse.run(g, PassOptions())
    assert [c.name for c in res.graph.constants] == ["c1", "z1", "z2"]
    # the two multiplies now read the same constant, so they merged as well
    assert [n.op for n in res.graph.nodes] == [Op.MUL, Op.ADD, Op.ADD, Op.ADD]
    check_same(g, res.graph, {"x": rand(rng, 4)})


def test_cse_keeps_graph_output_names() -> None:
    rng = np.random.default_rng(20261126)
    b = GraphBuilder()
    x = b.input("x", (3,), DType.F32)
    inner = b.emit(Op.TANH, x)
    b.output(b.emit(Op.NEG, inner), "a")
    b.output(b.emit(Op.TANH, x), "out_tanh")  # duplicate of `inner`, but a named output
    b.output(b.emit(Op.SIGMOID, x), "s1")
    b.output(b.emit(Op.SIGMOID, x), "s2")  # both named outputs: both kept
    g = b.build()
    res = cse.run(g, PassOptions())
    assert [v.name for v in res.graph.outputs] == ["a", "out_tanh", "s1", "s2"]
    assert [n.op for n in res.graph.nodes] == [Op.TANH, Op.NEG, Op.SIGMOID, Op.SIGMOID]
    assert res.graph.nodes[0].outputs[0].name == "out_tanh"  # first position, output's name
    check_same(g, res.graph, {"x": rand(rng, 3)})
