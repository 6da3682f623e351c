"""The new elementwise ops on the GPU: each ONNX node compiled by fusec and run matches the numpy
reference (exactly for integer, bit and rounding ops), as does a fused body holding -inf."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_ops_ext import halves, ints, masked_scores_model, model

import fusec
from fusec import reference
from fusec.frontend.onnx_import import import_onnx

pytestmark = pytest.mark.gpu


def _run(m: Any, inputs: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    import cupy

    graph = import_onnx(m)
    want = reference.run(graph, inputs)
    got = fusec.compile(graph, dtype="fp32").run(inputs)
    names = [o.name for o in m.graph.output]
    return [cupy.asnumpy(got[n]) for n in names], [want[n] for n in names]


def _same(m: Any, inputs: dict[str, np.ndarray], tol: float = 0.0) -> None:
    got, want = _run(m, inputs)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        if tol:
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol)
        else:
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("op", ["Floor", "Ceil", "Round", "Sign"])
@pytest.mark.parametrize("dt", [np.float32, np.float16])
def test_rounding_and_sign_match_reference(op: str, dt: Any) -> None:
    x = halves(dt, (64, 33))
    _same(model(op, {"x": x}), {"x": x})


@pytest.mark.parametrize("dt", [np.int32, np.int64])
def test_integer_sign_matches_reference(dt: Any) -> None:
    x = ints(dt, (16, 40))
    _same(model("Sign", {"x": x}), {"x": x})


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dt", [np.int32, np.int64, np.float32])
def test_mod_matches_reference(dt: Any, fmod: int) -> None:
    a = ints(dt, (16, 40), lo=-1000, hi=1000) if np.dtype(dt).kind == "i" else halves(dt, (16, 40)) * 7
    b = ints(dt, (40,), lo=-9, hi=9) if np.dtype(dt).kind == "i" else halves(dt, (40,)) + 0.25
    b[0] = 0  # an integer remainder by zero is 0; a float one NaN
    _same(model("Mod", {"a": a, "b": b}, fmod=fmod), {"a": a, "b": b})


@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
@pytest.mark.parametrize("dt", [np.int32, np.int64])
def test_bitwise_matches_reference(op: str, dt: Any) -> None:
    a, b = ints(dt, (16, 40), lo=-5000, hi=5000), ints(dt, (40,), lo=-5000, hi=5000)
    _same(model(op, {"a": a, "b": b}), {"a": a, "b": b})


@pytest.mark.parametrize("dt", [np.int32, np.int64])
def test_bitwise_not_matches_reference(dt: Any) -> None:
    x = ints(dt, (16, 40), lo=-5000, hi=5000)
    _same(model("BitwiseNot", {"x": x}), {"x": x})


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
@pytest.mark.parametrize("dt", [np.int32, np.int64])
def test_bit_shift_matches_reference(dt: Any, direction: str) -> None:
    bits = np.dtype(dt).itemsize * 8
    x = ints(dt, (16, 40), lo=-(1 << 20), hi=1 << 20)
    s = ints(dt, (40,), lo=-2, hi=bits + 2)  # out-of-range amounts included
    _same(model("BitShift", {"x": x, "s": s}, direction=direction), {"x": x, "s": s})


def test_xor_matches_reference() -> None:
    rng = np.random.default_rng(3)
    a, b = rng.random((16, 40)) > 0.5, rng.random((40,)) > 0.5
    _same(model("Xor", {"a": a, "b": b}), {"a": a, "b": b})


def test_fused_body_with_minus_inf_matches_reference() -> None:
    m = masked_scores_model()
    rng = np.random.default_rng(5)
    inputs = {"keep": np.tril(np.ones((6, 6), bool))[None].repeat(2, 0),
              "s": rng.standard_normal((2, 6, 6)).astype(np.float32), "bias": rng.standard_normal(6).astype(np.float32)}
    got, want = _run(m, inputs)
    assert np.isneginf(got[0]).sum() == np.isneginf(want[0]).sum() > 0
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


@pytest.mark.parametrize("pads,fill", [((1, 2, 0, 1), None), ((2, -1, -1, 3), 2.5), ((-1, 0, 0, -2), None)])
@pytest.mark.parametrize("dt", [np.float32, np.float16, np.int64])
def test_constant_pad_matches_reference(pads: tuple[int, ...], fill: float | None, dt: Any) -> None:
    x = ints(dt, (5, 7)) if np.dtype(dt).kind == "i" else halves(dt, (5, 7))
    consts = {"pads": np.array(pads, np.int64)} | ({"v": np.array(fill, dt)} if fill is not None else {})
    _same(model("Pad", {"x": x}, consts), {"x": x})


def test_constant_pad_with_a_run_time_fill_matches_reference() -> None:
    x, v = halves(np.float32, (2, 3, 4)), np.array(-3.0, np.float32)
    m = model("Pad", {"x": x, "v": v}, {"pads": np.array([0, 1, 2, 1, 0, -1], np.int64)}, order=["x", "pads", "v"])
    _same(m, {"x": x, "v": v})


# ---- arg max/min, top-k, product reduction, reflect / edge / wrap pads ------------------------------

def _few(dt: Any, shape: tuple[int, ...], nan: bool = True) -> np.ndarray:
    """Few distinct values (ties), infinities and (floats, ``nan``) NaNs."""
    if np.dtype(dt).kind == "i":
        return np.random.default_rng(3).choice(np.array([-(2**63), -1, 0, 5, 2**63 - 1]), size=shape).astype(dt)
    vals = [-np.inf, -1.5, 0.0, 2.0, np.inf] + ([np.nan] if nan else [])
    return np.random.default_rng(3).choice(np.array(vals), size=shape).astype(dt)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("shape,axis", [((7, 33), 1), ((5, 3, 9), 1), ((300, 2), 0), ((2, 1000), -1)])
@pytest.mark.parametrize("last", [0, 1])
@pytest.mark.parametrize("dt", [np.float32, np.float16, np.int64])
def test_arg_reduce_matches_reference(op: str, shape: tuple[int, ...], axis: int, last: int, dt: Any) -> None:
    x = _few(dt, shape)
    _same(model(op, {"x": x}, axis=axis, keepdims=axis % 2, select_last_index=last), {"x": x})


@pytest.mark.parametrize("shape,axis,k", [((7, 33), 1, 5), ((5, 40, 3), 1, 32), ((300, 2), 0, 1), ((2, 50000), 1, 8),
                                          ((3, 5), 1, 5)])
@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("dt", [np.float32, np.float16, np.int64])
def test_topk_values_and_indices_match_reference(shape: tuple[int, ...], axis: int, k: int, largest: int,
                                                 dt: Any) -> None:
    x = _few(dt, shape)
    _same(model("TopK", {"x": x}, {"k": np.array([k], np.int64)}, n_out=2, axis=axis, largest=largest), {"x": x})


def test_topk_of_distinct_values_matches_reference() -> None:
    x = np.random.default_rng(4).permutation(4096).astype(np.float32).reshape(4, 1024)
    _same(model("TopK", {"x": x}, {"k": np.array([32], np.int64)}, n_out=2, axis=1), {"x": x})


@pytest.mark.parametrize("shape,axes", [((6, 33), [1]), ((5, 7, 3), [0, 2]), ((4, 300), [1]), ((9,), [0])])
@pytest.mark.parametrize("dt,tol", [(np.float32, 1e-5), (np.float16, 2e-3), (np.int64, 0.0)])
def test_reduce_prod_matches_reference(shape: tuple[int, ...], axes: list[int], dt: Any, tol: float) -> None:
    rng = np.random.default_rng(6)
    if np.dtype(dt).kind == "i":
        x = rng.choice(np.array([-3, -1, 1, 2, 7]), size=shape).astype(dt)  # wraps like numpy's int64 product
    else:
        x = rng.uniform(0.97, 1.03, size=shape).astype(dt) * rng.choice(np.array([-1, 1]), size=shape).astype(dt)
    _same(model("ReduceProd", {"x": x}, {"axes": np.array(axes, np.int64)}, keepdims=0), {"x": x}, tol)


@pytest.mark.parametrize("mode", ["reflect", "edge", "wrap"])
@pytest.mark.parametrize("pads", [(1, 2, 0, 3), (0, 6, 4, 0), (-1, 2, 1, -2), (3, 0, 2, 0)])  # last: whole rows
@pytest.mark.parametrize("dt", [np.float32, np.float16, np.int64])
def test_pad_modes_match_reference(mode: str, pads: tuple[int, ...], dt: Any) -> None:
    x = ints(dt, (5, 7)) if np.dtype(dt).kind == "i" else halves(dt, (5, 7))
    _same(model("Pad", {"x": x}, {"pads": np.array(pads, np.int64)}, mode=mode), {"x": x})


def test_pad_modes_of_a_rank_4_tensor_match_reference() -> None:
    x = halves(np.float32, (2, 3, 5, 6))
    for mode in ("reflect", "edge", "wrap"):
        _same(model("Pad", {"x": x}, {"pads": np.array([0, 0, 2, 3, 0, 0, 4, 1], np.int64)}, mode=mode), {"x": x})


def test_wrap_pad_over_several_periods_matches_reference() -> None:
    x = halves(np.float32, (3, 4))
    _same(model("Pad", {"x": x}, {"pads": np.array([7, 0, 2, 9], np.int64)}, mode="wrap"), {"x": x})
