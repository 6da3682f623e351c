"""constant_fold: all-constant nodes become constants computed by the reference; layout ops on
large weights and size-growing folds are declined with a reason."""

from __future__ import annotations

import numpy as np
from graph_checks import check_same, rand

from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ops import Op
from fusec.passes import constant_fold
from fusec.passes.base import PassOptions


def test_chain_of_constant_ops_folds_into_one_constant_and_drops_sources() -> None:
    rng = np.random.default_rng(20261123)
    b = GraphBuilder()
    x = b.input("x", (4, 8), DType.F32)
    c1 = b.const(rand(rng, 8), name="c1")
    c2 = b.const(rand(rng, 8), name="c2")
    s = b.emit(Op.EXP, b.emit(Op.ADD, c1, c2))  # two foldable nodes in a chain
    b.output(b.emit(Op.MUL, x, s), "y")
    g = b.build()
    opts = PassOptions()
    res = constant_fold.run(g, opts)
    assert res.changed
    assert [n.op for n in res.graph.nodes] == [Op.MUL]
    (c,) = res.graph.constants  # c1 and c2 are unused afterwards: dropped
    np.testing.assert_array_equal(c.data, np.exp(c1.data + c2.data))
    assert opts.stats["constants_folded"] == 2
    check_same(g, res.graph, {"x": rand(rng, 4, 8)})
    assert len(g.nodes) == 3 and len(g.constants) == 2  # the input graph is untouched


def test_folded_graph_output_keeps_its_name() -> None:
    b = GraphBuilder()
    x = b.input("x", (3,), DType.F32)
    c = b.const(np.array([1.5, -2.0, 3.0], np.float32), name="c")
    b.output(b.emit(Op.NEG, x), "y")
    b.output(b.emit(Op.ABS, c), "k")
    g = b.build()
    res = constant_fold.run(g, PassOptions())
    assert [v.name for v in res.graph.outputs] == ["y", "k"]
    assert res.graph.outputs[1].is_const
    check_same(g, res.graph, {"x": np.array([1.0, 2.0, -3.0], np.float32)})


def test_nothing_to_fold_when_an_input_is_not_constant() -> None:
    b = GraphBuilder()
    x = b.input("x", (2, 2), DType.F32)
    c = b.const(np.full((2, 2), 2.0, np.float32))
    b.output(b.emit(Op.ADD, x, c), "y")
    g = b.build()
    res = constant_fold.run(g, PassOptions())
    assert not res.changed
    assert [n.op for n in res.graph.nodes] == [Op.ADD]


def test_transpose_and_matmul_of_large_weights_are_left_to_layout_passes() -> None:
    rng = np.random.default_rng(20261124)
    n = 80  # 6400 elements > max_layout_elements (4096)
    b = GraphBuilder()
    x = b.input("x", (2, n), DType.F32)
    w = b.const(rand(rng, n, n), name="w")
    u = b.const(rand(rng, n, n), name="u")
    wt = b.emit(Op.TRANSPOSE, w, perm=(1, 0))
    wu = b.emit(Op.MATMUL, w, u)
    b.output(b.emit(Op.MATMUL, b.emit(Op.MATMUL, x, wt), wu), "y")
    g = b.build()
    opts = PassOptions()
    res = constant_fold.run(g, opts)
    assert not res.changed
    assert [node.op for node in res.graph.nodes] == [Op.TRANSPOSE, Op.MATMUL, Op.MATMUL, Op.MATMUL]
    assert [d[0] for d in opts.declines] == ["constant_fold", "constant_fold"]
    assert "layout passes" in opts.declines[0][2]


def test_large_weight_transpose_that_is_a_view_still_folds() -> None:
    rng = np.random.default_rng(20261125)
    b = GraphBuilder()
    x = b.input("x", (2, 100), DType.F32)
    w = b.const(rand(rng, 1, 100, 100), name="w")
    wt = b.emit(Op.TRANSPOSE, w, perm=(1, 0, 2))  # moves only the size-1 axis: zero-copy
    b.output(b.emit(Op.MATMUL, x, b.emit(Op.RESHAPE, wt, shape=(100, 100))), "y")
    g = b.build()
    opts = PassOptions()
    res = constant_fold.run(g, opts)
    assert [n.op for n in res.graph.nodes] == [Op.MATMUL] and opts.declines == []
    check_same(g, res.graph, {"x": rand(rng, 2, 100)})


def test_small_transpose_folds_and_policy_is_adjustable() -> None:
    rng = np.random.default_rng(20261126)
    b = GraphBuilder()
    x = b.input("x", (2, 4), DType.F32)
    w = b.const(rand(rng, 3, 4), name="w")
    b.output(b.emit(Op.MATMUL, x, b.emit(Op.TRANSPOSE, w, perm=(1, 0))), "y")
    g = b.build()
    folded, n = constant_fold.fold(g, PassOptions())
    assert n == 1
    assert [node.op for node in folded.nodes] == [Op.MATMUL]
    check_same(g, folded, {"x": rand(rng, 2, 4)})
    strict = constant_fold.FoldPolicy(max_layout_elements=4)
    kept, n2 = constant_fold.fold(g, PassOptions(), strict)
    assert n2 == 0 and [node.op for node in kept.nodes] == [Op.TRANSPOSE, Op.MATMUL]


def test_expand_that_would_grow_a_large_constant_is_declined() -> None:
    b = GraphBuilder()
    x = b.input("x", (512, 256), DType.F32)
    one = b.scalar(3.0, DType.F32)
    big = b.emit(Op.EXPAND, one, shape=(512, 256))  # 131072 elements from 1
    b.output(b.emit(Op.MUL, x, big), "y")
    g = b.build()
    opts = PassOptions()
    res = constant_fold.run(g, opts)
    assert [n.op for n in res.graph.nodes] == [Op.EXPAND, Op.MUL]
    assert "131072-element" in opts.declines[0][2]
    assert constant_fold.fold_decline_reason(g.nodes[0]) is not None


def test_integer_shape_arithmetic_folds_exactly() -> None:
    b = GraphBuilder()
    x = b.input("x", (4,), DType.I64)
    a = b.const(np.array([7, -7, 9, -9], np.int64), name="a")
    d = b.const(np.array([2, 2, -4, -4], np.int64), name="d")
    b.output(b.emit(Op.ADD, x, b.emit(Op.DIV, a, d)), "y")
    g = b.build()
    res = constant_fold.run(g, PassOptions())
    assert [n.op for n in res.graph.nodes] == [Op.ADD]
    assert res.graph.constants[0].data.tolist() == [3, -3, -2, 2]  # truncation toward zero
    check_same(g, res.graph, {"x": np.array([1, 2, 3, 4], np.int64)})


def test_a_layer_weight_folded_alone_keeps_the_layer_in_its_name() -> None:
    b = GraphBuilder()
    x = b.input("x", (2, 4), DType.F32)
    w = b.const(np.arange(12, dtype=np.float32).reshape(3, 4), name="layers.3.self_attn.o_proj.weight")
    wt = b.emit(Op.TRANSPOSE, w, perm=(1, 0))  # a builder's unnamed transpose of one layer's weight
    b.output(b.emit(Op.MATMUL, x, wt), "y")
    g = b.build()
    res = constant_fold.run(g, PassOptions())
    (c,) = res.graph.constants
    assert c.name == "layers.3.self_attn.o_proj.weight.transpose"
    np.testing.assert_array_equal(c.data, w.data.T)
    check_same(g, res.graph, {"x": np.ones((2, 4), np.float32)})
