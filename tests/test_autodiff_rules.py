"""Every gradient rule (fusec.vjp_rules.VJP) against central finite differences of the numpy
reference, in float64, at small odd shapes. The loss is sum(y * w) for a fixed random w, so each
check tests the whole vector-Jacobian product, not one direction of it."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
import pytest

from fusec import reference
from fusec.autodiff import grad_graph
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.errors import ModelError
from fusec.ir import Value, verify
from fusec.ops import Op

F64 = DType.F64


def gradcheck(build: Callable[[GraphBuilder, dict[str, Value]], Value], inputs: Mapping[str, np.ndarray],
              wrt: list[str] | None = None, seed: int = 0, eps: float = 1e-6, rtol: float = 1e-6,
              atol: float = 1e-8) -> None:
    """d sum(build(inputs) * w) / d inputs[wrt]: the backward graph's against central differences."""
    rng = np.random.default_rng(seed)
    b = GraphBuilder("check")
    vals = {k: b.input(k, np.shape(v), DType.from_np(np.asarray(v).dtype)) for k, v in inputs.items()}
    y = build(b, vals)
    w = b.const(rng.standard_normal(y.shape), name="w", dtype=y.dtype)
    prod = b.emit(Op.MUL, y, w)
    loss = b.emit(Op.REDUCE_SUM, prod, axes=tuple(range(len(y.shape))), keepdims=False) if y.shape else prod
    b.output(loss, "loss")
    fwd = b.build()
    wrt = wrt if wrt is not None else [k for k, v in inputs.items() if np.asarray(v).dtype == np.float64]
    gg, names = grad_graph(fwd, "loss", wrt)
    verify(gg)
    got = reference.run(gg, inputs)
    for name in wrt:
        x = np.array(inputs[name], dtype=np.float64)
        fd = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            feed = dict(inputs)
            for sign in (1, -1):
                xp = x.copy()
                xp[i] += sign * eps
                feed[name] = xp
                fd[i] += sign * float(reference.run(fwd, feed)["loss"])
        fd /= 2 * eps
        np.testing.assert_allclose(got[names[name]], fd, rtol=rtol, atol=atol, err_msg=f"gradient of {name!r}")


def r(*shape: int, seed: int = 1, lo: float = -2.0, hi: float = 2.0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).uniform(lo, hi, shape)


def away_from_zero(*shape: int, seed: int = 2) -> np.ndarray:
    x = r(*shape, seed=seed)
    return np.where(np.abs(x) < 0.2, x + np.sign(x + 1e-9) * 0.3, x)


UNARY_CASES = [
    (Op.NEG, {}, r(3, 5)), (Op.ABS, {}, away_from_zero(3, 5)), (Op.EXP, {}, r(3, 5)),
    (Op.LOG, {}, r(3, 5, lo=0.3, hi=3)), (Op.SQRT, {}, r(3, 5, lo=0.3, hi=3)),
    (Op.RECIPROCAL, {}, away_from_zero(3, 5)), (Op.ERF, {}, r(3, 5)), (Op.TANH, {}, r(3, 5)),
    (Op.SIGMOID, {}, r(3, 5)), (Op.RELU, {}, away_from_zero(3, 5)), (Op.COS, {}, r(3, 5)), (Op.SIN, {}, r(3, 5)),
    (Op.GELU, {"approximate": "none"}, r(3, 5)), (Op.GELU, {"approximate": "tanh"}, r(3, 5)), (Op.SILU, {}, r(3, 5)),
]


@pytest.mark.parametrize("op, attrs, x", UNARY_CASES, ids=[f"{c[0].value}{'-' + str(c[1]) if c[1] else ''}" for c in UNARY_CASES])
def test_unary(op: Op, attrs: dict, x: np.ndarray) -> None:
    gradcheck(lambda b, v: b.emit(op, v["x"], **attrs), {"x": x})


BINARY_CASES = [
    (Op.ADD, (3, 4), (4,)), (Op.ADD, (3, 1, 5), (2, 1)), (Op.SUB, (3, 1), (1, 4)), (Op.MUL, (2, 3, 4), (3, 1)),
    (Op.DIV, (3, 4), (3, 4)), (Op.MAX, (3, 4), (4,)), (Op.MIN, (2, 3), (2, 3)),
    (Op.ADD, (8, 9, 3), (3,)), (Op.MUL, (70, 2), (1, 2)),  # >= 64 rows: the bias-style sum is a product with ones
]


@pytest.mark.parametrize("op, sa, sb", BINARY_CASES, ids=[f"{c[0].value}-{c[1]}-{c[2]}" for c in BINARY_CASES])
def test_binary_broadcast(op: Op, sa: tuple, sb: tuple) -> None:
    a, b_ = r(*sa, seed=3), away_from_zero(*sb, seed=4)
    gradcheck(lambda b, v: b.emit(op, v["a"], v["b"]), {"a": a, "b": b_})


def test_pow_variable_and_constant_exponent() -> None:
    base = r(3, 4, lo=0.5, hi=2.0)
    gradcheck(lambda b, v: b.emit(Op.POW, v["a"], v["e"]), {"a": base, "e": r(4, lo=-1.5, hi=2.5)})
    gradcheck(lambda b, v: b.emit(Op.POW, v["a"], b.scalar(3.0, F64)), {"a": base})


def test_max_tie_splits_the_gradient() -> None:
    x = np.array([[1.0, 2.0, 3.0]])
    b = GraphBuilder("tie")
    a = b.input("a", (1, 3), F64)
    c = b.const(np.array([[1.0, 0.0, 5.0]]), "c")
    y = b.emit(Op.REDUCE_SUM, b.emit(Op.MAX, a, c), axes=(0, 1), keepdims=False)
    b.output(y, "loss")
    gg, names = grad_graph(b.build(), "loss", ["a"])
    np.testing.assert_array_equal(reference.run(gg, {"a": x})[names["a"]], [[0.5, 1.0, 0.0]])


def test_where() -> None:
    cond = np.array([[True, False, True, False]] * 3)
    gradcheck(lambda b, v: b.emit(Op.WHERE, v["c"], v["x"], v["y"]),
              {"c": cond, "x": r(3, 4), "y": r(4, seed=5)})


@pytest.mark.parametrize("op", [Op.REDUCE_SUM, Op.REDUCE_MEAN, Op.REDUCE_MAX, Op.REDUCE_MIN])
@pytest.mark.parametrize("axes, keep", [((0, 2), False), ((1,), True), ((0, 1, 2), False)])
def test_reductions(op: Op, axes: tuple, keep: bool) -> None:
    gradcheck(lambda b, v: b.emit(op, v["x"], axes=axes, keepdims=keep), {"x": r(3, 4, 5)})


@pytest.mark.parametrize("exclusive, reverse", [(False, False), (True, False), (False, True), (True, True)])
def test_cumsum(exclusive: bool, reverse: bool) -> None:
    gradcheck(lambda b, v: b.emit(Op.CUMSUM, v["x"], axis=1, exclusive=exclusive, reverse=reverse), {"x": r(3, 5)})


@pytest.mark.parametrize("axis", [0, 2])
def test_softmax(axis: int) -> None:
    gradcheck(lambda b, v: b.emit(Op.SOFTMAX, v["x"], axis=axis), {"x": r(3, 2, 5)})


LAYOUT_CASES: list[tuple[str, Callable[[GraphBuilder, Value], Value]]] = [
    ("reshape", lambda b, x: b.emit(Op.RESHAPE, x, shape=(5, 6))),
    ("transpose", lambda b, x: b.emit(Op.TRANSPOSE, x, perm=(2, 0, 1))),
    ("expand", lambda b, x: b.emit(Op.EXPAND, b.emit(Op.SLICE, x, axes=(1,), starts=(1,), ends=(2,), steps=(1,)),
                                   shape=(4, 2, 3, 5))),
    ("slice", lambda b, x: b.emit(Op.SLICE, x, axes=(0, 2), starts=(1, 0), ends=(2, 4), steps=(1, 1))),
    ("concat", lambda b, x: b.emit(Op.CONCAT, x, b.emit(Op.NEG, x), axis=1)),
    ("tile", lambda b, x: b.emit(Op.TILE, x, repeats=(2, 1, 3))),
    ("pad", lambda b, x: b.emit(Op.PAD, x, pads=(1, 0, -1, 0, 2, 1))),
    ("trilu", lambda b, x: b.emit(Op.TRILU, x, upper=False, k=1)),
]


@pytest.mark.parametrize("name, fn", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_layout(name: str, fn: Callable[[GraphBuilder, Value], Value]) -> None:
    gradcheck(lambda b, v: fn(b, v["x"]), {"x": r(2, 3, 5)})


def test_gather_embedding_with_repeated_and_negative_ids() -> None:
    ids = np.array([[0, 3, 3, -1], [2, 0, 4, 3]], np.int64)
    gradcheck(lambda b, v: b.emit(Op.GATHER, v["table"], v["ids"], axis=0), {"table": r(5, 3), "ids": ids})
    gradcheck(lambda b, v: b.emit(Op.GATHER, v["x"], v["i"], axis=1),
              {"x": r(2, 4, 3), "i": np.array([3, 1, 3], np.int64)})


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("batch_a, batch_b", [((), ()), ((3,), (3,)), ((2, 3), ()), ((2, 1), (1, 3)), ((), (2,))])
def test_matmul_every_transpose_flag(ta: bool, tb: bool, batch_a: tuple, batch_b: tuple) -> None:
    m, k, n = 3, 4, 5
    a = r(*batch_a, *((k, m) if ta else (m, k)), seed=6)
    b_ = r(*batch_b, *((n, k) if tb else (k, n)), seed=7)
    gradcheck(lambda b, v: b.emit(Op.MATMUL, v["a"], v["b"], trans_a=ta, trans_b=tb), {"a": a, "b": b_})


def test_matmul_vectors() -> None:
    gradcheck(lambda b, v: b.emit(Op.MATMUL, v["a"], v["b"]), {"a": r(4), "b": r(2, 4, 3)})
    gradcheck(lambda b, v: b.emit(Op.MATMUL, v["a"], v["b"]), {"a": r(2, 3, 4), "b": r(4)})


@pytest.mark.parametrize("axis, bias, shape", [(2, True, (2, 3, 5)), (1, True, (2, 3, 5)), (2, False, (2, 3, 5)),
                                              (2, True, (9, 8, 3))])
def test_layernorm(axis: int, bias: bool, shape: tuple) -> None:
    feed = {"x": r(*shape), "s": r(*shape[axis:], seed=8)}
    if bias:
        feed["c"] = r(*shape[axis:], seed=9)
    gradcheck(lambda b, v: b.emit(Op.LAYERNORM, v["x"], v["s"], *([v["c"]] if bias else []), axis=axis, eps=1e-5), feed)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rmsnorm(offset: float) -> None:
    gradcheck(lambda b, v: b.emit(Op.RMSNORM, v["x"], v["w"], eps=1e-6, weight_offset=offset),
              {"x": r(3, 6), "w": r(6, seed=10)})


def _mask(shape: tuple, seed: int) -> np.ndarray:
    m = np.random.default_rng(seed).random(shape) > 0.3
    m[..., 0] = True  # every row attends somewhere
    return m


ATTN_CASES = [
    ("plain", {}, None, 2), ("bool-mask", {}, "bool", 2), ("additive-mask", {}, "float", 2),
    ("causal", {"causal": True}, None, 2), ("gqa", {}, "bool", 1), ("softcap", {"softcap": 3.0}, "float", 2),
]


@pytest.mark.parametrize("name, attrs, mask, kv_heads", ATTN_CASES, ids=[c[0] for c in ATTN_CASES])
def test_attention(name: str, attrs: dict, mask: str | None, kv_heads: int) -> None:
    bsz, heads, s, t, d = 2, 2, 3, 4, 3
    feed = {"q": r(bsz, heads, s, d, seed=11), "k": r(bsz, kv_heads, t, d, seed=12), "v": r(bsz, kv_heads, t, d, seed=13)}
    if mask == "bool":
        feed["m"] = _mask((bsz, 1, s, t), 14)
    elif mask == "float":
        feed["m"] = np.where(_mask((bsz, 1, 1, t), 15), 0.0, -1e4) + r(bsz, 1, 1, t, seed=16) * 0.1
    wrt = ["q", "k", "v"] + (["m"] if mask == "float" else [])
    gradcheck(lambda b, v: b.emit(Op.ATTENTION, v["q"], v["k"], v["v"], *([v["m"]] if mask else []), scale=0.7, **attrs),
              feed, wrt=wrt)


def test_attention_fully_masked_row_is_zero_with_nan_to_zero() -> None:
    m = _mask((1, 1, 3, 4), 17)
    m[0, 0, 1, :] = False
    gradcheck(lambda b, v: b.emit(Op.ATTENTION, v["q"], v["k"], v["v"], v["m"], scale=0.5, nan_to_zero=True),
              {"q": r(1, 2, 3, 2), "k": r(1, 2, 4, 2, seed=3), "v": r(1, 2, 4, 2, seed=4), "m": m}, wrt=["q", "k", "v"])


def test_eager_attention_decomposed_with_mask_and_residual() -> None:
    """The HF eager form (matmul, scale, additive mask, softmax, matmul) plus a residual."""
    def block(b: GraphBuilder, v: dict[str, Value]) -> Value:
        s = b.emit(Op.MATMUL, v["q"], v["k"], trans_b=True)
        s = b.emit(Op.ADD, b.emit(Op.MUL, s, b.scalar(0.5, F64)), v["m"])
        o = b.emit(Op.MATMUL, b.emit(Op.SOFTMAX, s, axis=3), v["v"])
        return b.emit(Op.ADD, o, v["q"])
    mask = np.where(_mask((2, 1, 1, 3), 18), 0.0, -1e9)
    gradcheck(block, {"q": r(2, 2, 3, 4), "k": r(2, 2, 3, 4, seed=5), "v": r(2, 2, 3, 4, seed=6), "m": mask},
              wrt=["q", "k", "v"])


def test_cross_entropy_with_ignore_index() -> None:
    labels = np.array([[2, -100, 0], [4, 1, -100]], np.int64)
    gradcheck(lambda b, v: b.emit(Op.CROSS_ENTROPY, v["x"], v["y"]), {"x": r(2, 3, 5) * 3, "y": labels})


def test_cross_entropy_reference_matches_log_softmax() -> None:
    x = r(4, 6) * 4
    y = np.array([5, 0, -100, 3])
    b = GraphBuilder("ce")
    out = b.emit(Op.CROSS_ENTROPY, b.input("x", x.shape, F64), b.input("y", y.shape, DType.I64))
    b.output(out, "loss")
    got = reference.run(b.build(), {"x": x, "y": y})["loss"]
    logp = x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    want = np.array([-logp[0, 5], -logp[1, 0], 0.0, -logp[3, 3]])
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_scatter_add_reference() -> None:
    b = GraphBuilder("sa")
    u = b.input("u", (2, 3, 2), F64)
    i = b.input("i", (3,), DType.I64)
    b.output(b.emit(Op.SCATTER_ADD, u, i, axis=1, size=4), "out")
    upd = r(2, 3, 2)
    got = reference.run(b.build(), {"u": upd, "i": np.array([1, 3, 1])})["out"]
    want = np.zeros((2, 4, 2))
    for j, t in enumerate([1, 3, 1]):
        want[:, t] += upd[:, j]
    np.testing.assert_allclose(got, want)


def test_an_op_without_a_rule_is_named() -> None:
    b = GraphBuilder("norule")
    x = b.input("x", (2, 3, 4, 4), F64)
    cos = b.const(np.ones((1, 1, 4, 4)), "cos")
    y = b.emit(Op.ROPE, x, cos, cos, rotary_dim=4)
    b.output(b.emit(Op.REDUCE_SUM, y, axes=(0, 1, 2, 3), keepdims=False), "loss")
    with pytest.raises(ModelError, match=r"op rope has no gradient rule.*node rope"):
        grad_graph(b.build(), "loss", ["x"])


def test_loss_must_be_one_value_and_depend_on_the_parameter() -> None:
    b = GraphBuilder("bad")
    x = b.input("x", (2, 3), F64)
    z = b.input("z", (2,), F64)
    b.output(b.emit(Op.EXP, x), "y")
    b.output(b.emit(Op.REDUCE_SUM, z, axes=(0,), keepdims=False), "loss")
    g = b.build()
    with pytest.raises(ModelError, match="must be one floating-point value"):
        grad_graph(g, "y", ["x"])
    with pytest.raises(ModelError, match="does not depend on 'x'"):
        grad_graph(g, "loss", ["x"])


def test_integer_paths_carry_no_gradient() -> None:
    """argmax -> gather: the loss depends on x only through integers, so x gets no gradient."""
    b = GraphBuilder("ints")
    x = b.input("x", (3, 4), F64)
    t = b.input("t", (4, 2), F64)
    idx = b.emit(Op.ARGMAX, x, axis=1, keepdims=False)
    b.output(b.emit(Op.REDUCE_SUM, b.emit(Op.GATHER, t, idx, axis=0), axes=(0, 1), keepdims=False), "loss")
    g = b.build()
    gg, names = grad_graph(g, "loss", ["t"])
    got = reference.run(gg, {"x": r(3, 4), "t": r(4, 2)})[names["t"]]
    assert got.sum() == pytest.approx(6.0) and math.isfinite(got.sum())
    with pytest.raises(ModelError, match="does not depend on 'x'"):
        grad_graph(g, "loss", ["x"])


def test_slices_that_tile_an_axis_join_into_one_concat() -> None:
    """A fused projection split into three (q, k, v): its gradient is one CONCAT, not three PADs
    and two ADDs; a slice of part of an axis is padded back."""
    def split(b: GraphBuilder, v: dict[str, Value]) -> Value:
        parts = [b.emit(Op.SLICE, v["x"], axes=(1,), starts=(i,), ends=(i + 2,), steps=(1,)) for i in (0, 2, 4)]
        y = b.emit(Op.MUL, b.emit(Op.EXP, parts[0]), parts[1])
        return b.emit(Op.ADD, y, b.emit(Op.TANH, parts[2]))
    gradcheck(split, {"x": r(3, 6, 2)})
    gradcheck(lambda b, v: b.emit(Op.SLICE, v["x"], axes=(1,), starts=(1,), ends=(4,), steps=(1,)), {"x": r(3, 6)})
    b = GraphBuilder("split")
    x = b.input("x", (3, 6), F64)
    y = split(b, {"x": x})
    b.output(b.emit(Op.REDUCE_SUM, y, axes=(0, 1), keepdims=False), "loss")
    gg, _ = grad_graph(b.build(), "loss", ["x"])
    ops = [n.op for n in gg.nodes]
    assert Op.CONCAT in ops and Op.PAD not in ops


@pytest.mark.parametrize("op", [Op.GELU, Op.SILU])
def test_half_precision_activation_gradients_compute_in_fp32(op: Op) -> None:
    """bf16 in and out, fp32 inside: the gradient is the fp32 gradient rounded once."""
    import ml_dtypes

    x = r(4, 33).astype(ml_dtypes.bfloat16)
    grads = {}
    for dt in (DType.BF16, DType.F32):
        b = GraphBuilder("act")
        v = b.input("x", x.shape, dt)
        b.output(b.emit(Op.REDUCE_SUM, b.emit(op, v), axes=(0, 1), keepdims=False), "loss")
        gg, names = grad_graph(b.build(), "loss", ["x"])
        grads[dt] = reference.run(gg, {"x": x.astype(dt.np)})[names["x"]]
    np.testing.assert_array_equal(grads[DType.BF16], grads[DType.F32].astype(ml_dtypes.bfloat16))
