"""recognize_norms: decomposed RMSNorm / LayerNorm -> one RMSNORM / LAYERNORM (structure + numerics)."""

from __future__ import annotations

import numpy as np
import pytest

from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph, verify
from fusec.ops import Op
from fusec.passes import recognize_norms
from fusec.passes.base import PassOptions

RNG = np.random.default_rng(20261123)


def _run(g: Graph) -> tuple[Graph, PassOptions]:
    opts = PassOptions()
    out = recognize_norms.run(g, opts).graph
    verify(out)
    return out, opts


def _same(g0: Graph, g1: Graph, tol: float = 1e-5) -> None:
    inputs = {v.name: RNG.standard_normal(v.shape).astype(v.dtype.np) for v in g0.inputs}
    r0, r1 = reference.run(g0, inputs), reference.run(g1, inputs)
    for k in r0:
        np.testing.assert_allclose(r1[k].astype(np.float32), r0[k].astype(np.float32), rtol=tol, atol=tol)


def _rms(rsqrt: str = "div", cast: bool = True, weight: bool = True, axis: int = 2, scale: float = 1.0,
         dtype: DType = DType.F32) -> Graph:
    """HF LlamaRMSNorm as torch exports it; ``rsqrt`` picks the spelling of 1/sqrt."""
    b = GraphBuilder("rms")
    x = b.input("x", (2, 3, 8), dtype)
    h = b.emit(Op.CAST, x, to=DType.F32) if cast else x
    var = b.emit(Op.REDUCE_MEAN, b.emit(Op.POW, h, b.scalar(2.0, DType.F32)), axes=(axis,), keepdims=True)
    d = b.emit(Op.SQRT, b.emit(Op.ADD, var, b.scalar(1e-6, DType.F32)))
    if rsqrt == "div":
        y = b.emit(Op.MUL, h, b.emit(Op.DIV, b.scalar(1.0, DType.F32), d))
    elif rsqrt == "reciprocal":
        y = b.emit(Op.MUL, h, b.emit(Op.RECIPROCAL, d))
    else:
        y = b.emit(Op.DIV, h, d)
    if scale != 1.0:
        y = b.emit(Op.MUL, y, b.scalar(scale, DType.F32))
    if cast:
        y = b.emit(Op.CAST, y, to=dtype)
    if weight:
        y = b.emit(Op.MUL, b.const(RNG.standard_normal(8).astype(dtype.np) + 1, name="layers.0.norm.weight"), y)
    b.output(y, "y")
    return b.build()


@pytest.mark.parametrize("rsqrt", ["div", "reciprocal", "divide"])
@pytest.mark.parametrize("cast", [True, False])
def test_rmsnorm_forms_become_one_op(rsqrt: str, cast: bool) -> None:
    g = _rms(rsqrt, cast)
    out, opts = _run(g)
    assert [n.op for n in out.nodes] == [Op.RMSNORM]
    assert out.nodes[0].attrs.eps == pytest.approx(1e-6)
    assert out.meta["patterns"]["rmsnorm"] == 1 and out.meta["patterns"]["layernorm"] == 0
    assert opts.stats["norms_recognized"] == 1
    _same(g, out)


def test_rmsnorm_without_weight_gets_unit_weight_and_fp16_input_keeps_its_dtype() -> None:
    g = _rms(weight=False, cast=False)
    out, _ = _run(g)
    assert [n.op for n in out.nodes] == [Op.RMSNORM]
    assert np.all(out.nodes[0].inputs[1].data == 1)
    _same(g, out)
    g16 = _rms(dtype=DType.F16)
    out16, _ = _run(g16)
    assert [n.op for n in out16.nodes] == [Op.RMSNORM] and out16.outputs[0].dtype == DType.F16
    _same(g16, out16, tol=2e-3)


def test_rmsnorm_declines_near_misses_with_reasons() -> None:
    g = _rms(scale=2.0)
    out, opts = _run(g)
    assert any("extra constant factor 2" in r for _, _, r in opts.declines)
    # the inner x * rsqrt(...) is still a (weightless) RMSNorm; the factor and weight stay outside
    norm = next(n for n in out.nodes if n.op == Op.RMSNORM)
    assert np.all(norm.inputs[1].data == 1) and sum(n.op == Op.MUL for n in out.nodes) == 2
    _same(g, out)
    # a reduction over another axis is not a norm over the features: no match, graph unchanged
    g2 = _rms(axis=1)
    out2, _ = _run(g2)
    assert [n.op for n in out2.nodes] == [n.op for n in g2.nodes]
    _same(g2, out2)


def test_rmsnorm_with_read_intermediate_is_left_alone() -> None:
    g = _rms()
    sqrt = next(n for n in g.nodes if n.op == Op.SQRT)
    g.outputs.append(sqrt.outputs[0])  # someone else reads sqrt(var + eps)
    verify(g)
    out, _ = _run(g)
    assert Op.RMSNORM not in [n.op for n in out.nodes]
    _same(g, out)


def _layernorm(div: bool = True, bias: bool = True, shared_mean: bool = False) -> Graph:
    """LayerNorm below opset 17: ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add."""
    b = GraphBuilder("ln")
    x = b.input("x", (2, 5, 16), DType.F32)
    mu = b.emit(Op.REDUCE_MEAN, x, axes=(2,), keepdims=True)
    d = b.emit(Op.SUB, x, mu)
    var = b.emit(Op.REDUCE_MEAN, b.emit(Op.POW, d, b.scalar(2.0, DType.F32)), axes=(2,), keepdims=True)
    s = b.emit(Op.SQRT, b.emit(Op.ADD, var, b.scalar(1e-5, DType.F32)))
    y = b.emit(Op.DIV, d, s) if div else b.emit(Op.MUL, b.emit(Op.RECIPROCAL, s), d)
    y = b.emit(Op.MUL, y, b.const(RNG.standard_normal(16).astype(np.float32), name="ln.weight"))
    if bias:
        y = b.emit(Op.ADD, b.const(RNG.standard_normal(16).astype(np.float32), name="ln.bias"), y)
    b.output(y, "y")
    if shared_mean:
        b.output(mu, "mean")
    return b.build()


@pytest.mark.parametrize("div", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_decomposed_layernorm_becomes_one_op(div: bool, bias: bool) -> None:
    g = _layernorm(div, bias)
    out, _ = _run(g)
    assert [n.op for n in out.nodes] == [Op.LAYERNORM]
    assert len(out.nodes[0].inputs) == (3 if bias else 2)
    assert out.nodes[0].attrs.axis == 2 and out.nodes[0].attrs.eps == pytest.approx(1e-5)
    assert out.meta["patterns"]["layernorm"] == 1
    _same(g, out)


def test_layernorm_whose_mean_is_read_elsewhere_is_declined() -> None:
    g = _layernorm(shared_mean=True)
    out, opts = _run(g)
    assert Op.LAYERNORM not in [n.op for n in out.nodes]
    assert any(p == "layernorm" and "outside the norm" in r for p, _, r in opts.declines)
    _same(g, out)


def test_existing_layernorm_ops_are_counted() -> None:
    b = GraphBuilder()
    x = b.input("x", (3, 8), DType.F32)
    y = b.emit(Op.LAYERNORM, x, b.const(RNG.standard_normal(8).astype(np.float32)), axis=1, eps=1e-5)
    b.output(y, "y")
    out, _ = _run(b.build())
    assert out.meta["patterns"] == {"layernorm": 1, "rmsnorm": 0}
