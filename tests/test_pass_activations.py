"""recognize_activations (GELU erf/tanh, SiLU, SwiGLU count) and recognize_softmax."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph, Value, verify
from fusec.ops import Op
from fusec.passes import recognize_activations, recognize_softmax
from fusec.passes.base import PassOptions

RNG = np.random.default_rng(20261123)
F = DType.F32


def _run(mod, g: Graph) -> tuple[Graph, PassOptions]:  # type: ignore[no-untyped-def]
    opts = PassOptions()
    out = mod.run(g, opts).graph
    verify(out)
    return out, opts


def _same(g0: Graph, g1: Graph, tol: float = 1e-5) -> None:
    inputs = {v.name: (RNG.standard_normal(v.shape) * 2).astype(v.dtype.np) for v in g0.inputs}
    r0, r1 = reference.run(g0, inputs), reference.run(g1, inputs)
    for k in r0:
        np.testing.assert_allclose(r1[k], r0[k], rtol=tol, atol=tol)


def _graph(body) -> Graph:  # type: ignore[no-untyped-def]
    b = GraphBuilder("act")
    x = b.input("x", (3, 16), F)
    b.output(body(b, x), "y")
    return b.build()


def _gelu_erf(b: GraphBuilder, x: Value, half: float = 0.5) -> Value:
    e = b.emit(Op.ERF, b.emit(Op.DIV, x, b.scalar(math.sqrt(2.0), F)))
    return b.emit(Op.MUL, b.emit(Op.MUL, x, b.emit(Op.ADD, e, b.scalar(1.0, F))), b.scalar(half, F))


def _gelu_erf_mul_form(b: GraphBuilder, x: Value) -> Value:
    e = b.emit(Op.ERF, b.emit(Op.MUL, b.scalar(1 / math.sqrt(2.0), F), x))
    return b.emit(Op.MUL, b.emit(Op.MUL, b.scalar(0.5, F), b.emit(Op.ADD, b.scalar(1.0, F), e)), x)


def _gelu_tanh(b: GraphBuilder, x: Value, cube: str = "pow") -> Value:
    if cube == "pow":
        c = b.emit(Op.POW, x, b.scalar(3.0, F))
    else:
        c = b.emit(Op.MUL, b.emit(Op.MUL, x, x), x)
    inner = b.emit(Op.MUL, b.emit(Op.ADD, x, b.emit(Op.MUL, c, b.scalar(0.044715, F))),
                   b.scalar(math.sqrt(2 / math.pi), F))
    t = b.emit(Op.ADD, b.emit(Op.TANH, inner), b.scalar(1.0, F))
    return b.emit(Op.MUL, b.emit(Op.MUL, x, b.scalar(0.5, F)), t)


def _gelu_tanh_factored(b: GraphBuilder, x: Value) -> Value:
    """sqrt(2/pi) * x * (1 + 0.044715 x^2): the other common grouping."""
    poly = b.emit(Op.ADD, b.scalar(1.0, F), b.emit(Op.MUL, b.scalar(0.044715, F), b.emit(Op.MUL, x, x)))
    inner = b.emit(Op.MUL, b.emit(Op.MUL, b.scalar(math.sqrt(2 / math.pi), F), x), poly)
    return b.emit(Op.MUL, b.emit(Op.MUL, b.scalar(0.5, F), x), b.emit(Op.ADD, b.scalar(1.0, F), b.emit(Op.TANH, inner)))


@pytest.mark.parametrize("form,approx", [(_gelu_erf, "none"), (_gelu_erf_mul_form, "none"),
                                         (_gelu_tanh, "tanh"), (lambda b, x: _gelu_tanh(b, x, "mul"), "tanh"),
                                         (_gelu_tanh_factored, "tanh")])
def test_gelu_forms(form, approx: str) -> None:  # type: ignore[no-untyped-def]
    g = _graph(form)
    out, _ = _run(recognize_activations, g)
    assert [n.op for n in out.nodes] == [Op.GELU]
    assert out.nodes[0].attrs.approximate == approx
    assert out.meta["patterns"]["gelu"] == 1
    _same(g, out)


def test_gelu_with_wrong_constant_is_declined() -> None:
    g = _graph(lambda b, x: _gelu_erf(b, x, half=0.6))
    out, opts = _run(recognize_activations, g)
    assert Op.GELU not in [n.op for n in out.nodes]
    assert any(p == "gelu" and "0.6" in r for p, _, r in opts.declines)
    _same(g, out)


def test_gelu_whose_inner_value_is_read_elsewhere_is_left_alone() -> None:
    b = GraphBuilder()
    x = b.input("x", (3, 16), F)
    e = b.emit(Op.ERF, b.emit(Op.DIV, x, b.scalar(math.sqrt(2.0), F)))
    y = b.emit(Op.MUL, b.emit(Op.MUL, x, b.emit(Op.ADD, e, b.scalar(1.0, F))), b.scalar(0.5, F))
    b.output(y, "y")
    b.output(e, "erf")
    g = b.build()
    out, _ = _run(recognize_activations, g)
    assert Op.GELU not in [n.op for n in out.nodes]
    _same(g, out)


def test_silu_and_swiglu() -> None:
    b = GraphBuilder("mlp")
    gate = b.input("gate", (4, 32), F)
    up = b.input("up", (4, 32), F)
    s = b.emit(Op.MUL, b.emit(Op.SIGMOID, gate), gate)
    b.output(b.emit(Op.MUL, s, up), "y")
    g = b.build()
    out, _ = _run(recognize_activations, g)
    assert [n.op for n in out.nodes] == [Op.SILU, Op.MUL]
    assert out.meta["patterns"]["silu"] == 1 and out.meta["patterns"]["swiglu"] == 1
    _same(g, out)


def test_gate_times_sigmoid_of_another_tensor_is_not_silu() -> None:
    b = GraphBuilder()
    x = b.input("x", (4, 8), F)
    z = b.input("z", (4, 8), F)
    b.output(b.emit(Op.MUL, x, b.emit(Op.SIGMOID, z)), "y")
    g = b.build()
    out, _ = _run(recognize_activations, g)
    assert [n.op for n in out.nodes] == [Op.SIGMOID, Op.MUL]
    assert out.meta["patterns"]["silu"] == 0 and out.meta["patterns"]["swiglu"] == 0


def _softmax(b: GraphBuilder, x: Value, with_max: bool = True, sum_axis: int = 1, recip: bool = False) -> Value:
    z = x
    if with_max:
        z = b.emit(Op.SUB, x, b.emit(Op.REDUCE_MAX, x, axes=(1,), keepdims=True))
    e = b.emit(Op.EXP, z)
    s = b.emit(Op.REDUCE_SUM, e, axes=(sum_axis,), keepdims=True)
    return b.emit(Op.MUL, e, b.emit(Op.RECIPROCAL, s)) if recip else b.emit(Op.DIV, e, s)


@pytest.mark.parametrize("with_max", [True, False])
@pytest.mark.parametrize("recip", [True, False])
def test_decomposed_softmax(with_max: bool, recip: bool) -> None:
    g = _graph(lambda b, x: _softmax(b, x, with_max, recip=recip))
    out, opts = _run(recognize_softmax, g)
    assert [n.op for n in out.nodes] == [Op.SOFTMAX] and out.nodes[0].attrs.axis == 1
    assert out.meta["patterns"]["softmax"] == 1 and opts.stats["softmax_recognized"] == 1
    _same(g, out)


def test_softmax_summing_two_axes_is_declined() -> None:
    b = GraphBuilder()
    x = b.input("x", (3, 4, 5), F)
    e = b.emit(Op.EXP, x)
    b.output(b.emit(Op.DIV, e, b.emit(Op.REDUCE_SUM, e, axes=(1, 2), keepdims=True)), "y")
    g = b.build()
    out, opts = _run(recognize_softmax, g)
    assert Op.SOFTMAX not in [n.op for n in out.nodes]
    assert any(p == "softmax" and "axes [1, 2]" in r for p, _, r in opts.declines)
    _same(g, out)
