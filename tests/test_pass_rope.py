"""recognize_rope: rotate-half RoPE (full and partial rotary) -> one ROPE op."""

from __future__ import annotations

import numpy as np

from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph, Value, verify
from fusec.ops import Op
from fusec.passes import recognize_rope
from fusec.passes.base import PassOptions

RNG = np.random.default_rng(20261123)
F = DType.F32
B, H, S, D = 2, 3, 5, 8


def _run(g: Graph) -> tuple[Graph, PassOptions]:
    opts = PassOptions()
    out = recognize_rope.run(g, opts).graph
    verify(out)
    return out, opts


def _same(g0: Graph, g1: Graph) -> None:
    inputs = {v.name: RNG.standard_normal(v.shape).astype(v.dtype.np) for v in g0.inputs}
    r0, r1 = reference.run(g0, inputs), reference.run(g1, inputs)
    for k in r0:
        np.testing.assert_allclose(r1[k], r0[k], rtol=1e-6, atol=1e-6)


def _slice(b: GraphBuilder, x: Value, start: int, end: int) -> Value:
    return b.emit(Op.SLICE, x, axes=(3,), starts=(start,), ends=(end,), steps=(1,))


def _rotate(b: GraphBuilder, x: Value, cos: Value, sin: Value, neg: str = "neg", swap: bool = False) -> Value:
    d = x.shape[-1]
    x1, x2 = _slice(b, x, 0, d // 2), _slice(b, x, d // 2, d)
    if swap:  # the wrong half negated: not a rotation
        x1, x2 = x2, x1
    n2 = b.emit(Op.NEG, x2) if neg == "neg" else b.emit(Op.MUL, x2, b.scalar(-1.0, F))
    rh = b.emit(Op.CONCAT, n2, x1, axis=3)
    return b.emit(Op.ADD, b.emit(Op.MUL, x, cos), b.emit(Op.MUL, rh, sin))


def _tables(b: GraphBuilder, rd: int) -> tuple[Value, Value]:
    ang = RNG.uniform(0, 6, (1, 1, S, rd)).astype(np.float32)
    return b.const(np.cos(ang), name="cos"), b.const(np.sin(ang), name="sin")


def test_full_rotary_any_negation() -> None:
    for neg in ("neg", "mul"):
        b = GraphBuilder("rope")
        q = b.input("q", (B, H, S, D), F)
        cos, sin = _tables(b, D)
        b.output(_rotate(b, q, cos, sin, neg), "y")
        g = b.build()
        out, opts = _run(g)
        assert [n.op for n in out.nodes] == [Op.ROPE]
        assert out.nodes[0].attrs.rotary_dim == D and out.meta["patterns"]["rope"] == 1
        _same(g, out)


def test_cos_sin_computed_at_runtime_from_positions() -> None:
    b = GraphBuilder("rope_dyn")
    q = b.input("q", (B, H, S, D), F)
    pos = b.input("pos", (B, 1, S, D), F)  # e.g. gathered by position ids
    b.output(_rotate(b, q, b.emit(Op.COS, pos), b.emit(Op.SIN, pos)), "y")
    g = b.build()
    out, _ = _run(g)
    assert [n.op for n in out.nodes] == [Op.COS, Op.SIN, Op.ROPE]
    _same(g, out)


def test_partial_rotary_becomes_one_rope_with_rotary_dim() -> None:
    b = GraphBuilder("neox")
    q = b.input("q", (B, H, S, D), F)
    rd = D // 2
    cos, sin = _tables(b, rd)
    rot = _rotate(b, _slice(b, q, 0, rd), cos, sin)
    b.output(b.emit(Op.CONCAT, rot, _slice(b, q, rd, D), axis=3), "y")
    g = b.build()
    out, _ = _run(g)
    assert [n.op for n in out.nodes] == [Op.ROPE]
    assert out.nodes[0].attrs.rotary_dim == rd and out.nodes[0].inputs[0] is q
    _same(g, out)


def test_wrong_half_negated_is_not_rope() -> None:
    b = GraphBuilder()
    q = b.input("q", (B, H, S, D), F)
    cos, sin = _tables(b, D)
    b.output(_rotate(b, q, cos, sin, swap=True), "y")
    g = b.build()
    out, _ = _run(g)
    assert Op.ROPE not in [n.op for n in out.nodes] and out.meta["patterns"]["rope"] == 0
    _same(g, out)


def test_rotation_of_another_tensor_is_declined() -> None:
    b = GraphBuilder()
    q = b.input("q", (B, H, S, D), F)
    k = b.input("k", (B, H, S, D), F)
    cos, sin = _tables(b, D)
    d = D // 2
    rh = b.emit(Op.CONCAT, b.emit(Op.NEG, _slice(b, k, d, D)), _slice(b, k, 0, d), axis=3)
    b.output(b.emit(Op.ADD, b.emit(Op.MUL, q, cos), b.emit(Op.MUL, rh, sin)), "y")
    g = b.build()
    out, opts = _run(g)
    assert Op.ROPE not in [n.op for n in out.nodes]
    assert any(p == "rope" and "different tensor" in r for p, _, r in opts.declines)
