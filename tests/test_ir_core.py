"""IR core: builder typing, verify's invariants, printer determinism, reference semantics."""

from __future__ import annotations

import numpy as np
import pytest

from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.errors import InputError
from fusec.ir import Graph, IRError, Node, Value, print_graph, verify
from fusec.ops import NoAttrs, Op, ShapeAttrs


def _mlp() -> Graph:
    rng = np.random.default_rng(0)
    b = GraphBuilder("mlp")
    x = b.input("x", (4, 16), DType.F32)
    w = b.const(rng.standard_normal((16, 8)).astype(np.float32), name="w")
    h = b.emit(Op.MATMUL, x, w)
    h = b.emit(Op.GELU, h, approximate="tanh")
    b.output(b.emit(Op.SOFTMAX, h, axis=1), "y")
    return b.build()


def test_builder_infers_types_and_reference_matches_numpy() -> None:
    g = _mlp()
    assert [n.op for n in g.nodes] == [Op.MATMUL, Op.GELU, Op.SOFTMAX]
    assert g.outputs[0].shape == (4, 8) and g.outputs[0].dtype == DType.F32
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    h = x @ g.constants[0].data
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    e = np.exp(h - h.max(1, keepdims=True))
    want = e / e.sum(1, keepdims=True)
    got = reference.run(g, {"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_printer_is_deterministic_and_quotes_odd_names() -> None:
    b = GraphBuilder()
    x = b.input('in"put\n', (2,), DType.F32)
    b.output(b.emit(Op.NEG, x), "ou t")
    g = b.build()
    text = print_graph(g)
    assert text == print_graph(g)
    assert "%'in\"put\\n'" in text and "%'ou t'" in text


def test_verify_rejects_use_before_definition() -> None:
    a = Value("a", (2,), DType.F32)
    t = Value("t", (2,), DType.F32)
    u = Value("u", (2,), DType.F32)
    n1 = Node(Op.NEG, [t], [u], NoAttrs())
    n2 = Node(Op.NEG, [a], [t], NoAttrs())
    with pytest.raises(IRError, match="'t' before it is defined"):
        verify(Graph([a], [u], [n1, n2]))


def test_verify_rejects_wrong_declared_type_and_double_definition() -> None:
    a = Value("a", (2, 3), DType.F32)
    bad = Value("r", (3, 3), DType.F32)
    with pytest.raises(IRError, match="rule gives"):
        verify(Graph([a], [bad], [Node(Op.RESHAPE, [a], [bad], ShapeAttrs((3, 2)))]))
    out = Value("o", (2, 3), DType.F32)
    with pytest.raises(IRError, match="defined twice"):
        verify(Graph([a], [out], [Node(Op.NEG, [a], [out], NoAttrs()), Node(Op.NEG, [a], [out], NoAttrs())]))


def test_builder_rejects_inconsistent_ops() -> None:
    b = GraphBuilder()
    x = b.input("x", (2, 3), DType.F32)
    y = b.input("y", (4, 5), DType.F32)
    with pytest.raises(ValueError, match="inner dimensions"):
        b.emit(Op.MATMUL, x, y)
    i = b.input("i", (2, 3), DType.I64)
    with pytest.raises(ValueError, match="share one dtype"):
        b.emit(Op.ADD, x, i)


def test_reference_checks_inputs_by_name_shape_and_dtype() -> None:
    g = _mlp()
    with pytest.raises(InputError, match="missing input"):
        reference.run(g, {})
    with pytest.raises(InputError, match="expected shape \\[4, 16\\]"):
        reference.run(g, {"x": np.zeros((4, 15), np.float32)})
    with pytest.raises(InputError, match="expected dtype f32"):
        reference.run(g, {"x": np.zeros((4, 16), np.int32)})
    with pytest.raises(InputError, match="unexpected input"):
        reference.run(g, {"x": np.zeros((4, 16), np.float32), "z": np.zeros(1)})


def test_reference_half_precision_ops_round_from_fp32() -> None:
    b = GraphBuilder()
    x = b.input("x", (3, 64), DType.BF16)
    b.output(b.emit(Op.SOFTMAX, x, axis=1), "y")
    g = b.build()
    xv = np.random.default_rng(2).standard_normal((3, 64)).astype(DType.BF16.np)
    got = reference.run(g, {"x": xv})["y"]
    assert got.dtype == DType.BF16.np
    xf = xv.astype(np.float32)
    e = np.exp(xf - xf.max(1, keepdims=True))
    want = (e / e.sum(1, keepdims=True)).astype(DType.BF16.np)
    assert np.array_equal(got.astype(np.float32), want.astype(np.float32))


def test_integer_division_truncates_toward_zero_like_onnx() -> None:
    b = GraphBuilder()
    x = b.input("x", (4,), DType.I64)
    d = b.const(np.array([2, -2, 2, -2]), name="d")
    b.output(b.emit(Op.DIV, x, d), "q")
    got = reference.run(b.build(), {"x": np.array([7, 7, -7, -7])})["q"]
    assert got.tolist() == [3, -3, -3, 3]
