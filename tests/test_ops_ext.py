"""The rounding, sign, remainder, bit, arg max/min, top-k, pad and min/prod-reduction ops and the
reference-only dtypes (fp64, int8/16, uint8..64): each ONNX node imported and run by the numpy
reference matches onnxruntime; empty tensors and empty reductions follow the ONNX spec."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusec import reference
from fusec.frontend.onnx_import import import_onnx

ort = pytest.importorskip("onnxruntime")

rng = np.random.default_rng(7)


def model(op: str, inputs: dict[str, np.ndarray], consts: dict[str, np.ndarray] | None = None,
          n_out: int = 1, opset: int = 21, order: list[str] | None = None, **attrs: Any) -> onnx.ModelProto:
    """One ``op`` node over run-time ``inputs`` and initializer ``consts`` (in that order, or in
    ``order``); output types come from ONNX shape inference."""
    consts = consts or {}
    names = order or list(inputs) + list(consts)
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, names, outs, **attrs)
    vis = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
           for n, a in inputs.items()]
    inits = [numpy_helper.from_array(a, n) for n, a in consts.items()]
    graph = helper.make_graph([node], "g", vis, [helper.make_empty_tensor_value_info(o) for o in outs], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    del m.graph.output[:]
    m.graph.output.extend(inferred.graph.output)
    return m


def run_both(m: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(fusec reference outputs, onnxruntime outputs), in graph output order."""
    got = reference.run(import_onnx(m), inputs)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, inputs)
    return [got[o.name] for o in m.graph.output], want


def masked_scores_model() -> onnx.ModelProto:
    """where(keep, s * 0.125, -inf) + bias over keep bool[2,6,6], s f32[2,6,6], bias f32[6]: fusion
    makes it one elementwise body whose constants include the scalar -inf (a causal mask)."""
    nodes = [helper.make_node("Mul", ["s", "scale"], ["q"]), helper.make_node("Where", ["keep", "q", "ninf"], ["m"]),
             helper.make_node("Add", ["m", "bias"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("keep", TensorProto.BOOL, [2, 6, 6]),
                                       helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 6, 6]),
                                       helper.make_tensor_value_info("bias", TensorProto.FLOAT, [6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6, 6])],
                          [numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf"),
                           numpy_helper.from_array(np.array(0.125, np.float32), "scale")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def check(m: onnx.ModelProto, inputs: dict[str, np.ndarray], tol: float = 0.0) -> None:
    got, want = run_both(m, inputs)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        if tol:
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol)
        else:
            np.testing.assert_array_equal(g, w)


def halves(dt: Any, shape: tuple[int, ...] = (4, 6)) -> np.ndarray:
    """Values with exact .5 ties, negatives and zeros (rounding edge cases)."""
    x = rng.integers(-12, 12, size=shape).astype(np.float64) / 2
    x.reshape(-1)[:4] = [0.5, -0.5, 2.5, -2.5]
    return x.astype(dt)


def ints(dt: Any, shape: tuple[int, ...] = (3, 5), lo: int = -50, hi: int = 50) -> np.ndarray:
    info = np.iinfo(dt)
    return rng.integers(max(lo, info.min), min(hi, info.max), size=shape, endpoint=True).astype(dt)


# ---- elementwise -----------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["Floor", "Ceil", "Round"])
@pytest.mark.parametrize("dt", [np.float32, np.float16, np.float64])
def test_rounding_matches_onnxruntime(op: str, dt: Any) -> None:
    x = halves(dt)
    check(model(op, {"x": x}), {"x": x})


@pytest.mark.parametrize("dt", [np.float32, np.float64, np.int32, np.int64, np.int8, np.int16])
def test_sign_matches_onnxruntime(dt: Any) -> None:
    x = halves(dt) if np.dtype(dt).kind == "f" else ints(dt)
    x.reshape(-1)[0] = 0
    check(model("Sign", {"x": x}), {"x": x})


def test_round_is_half_to_even() -> None:
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 3.49, -3.51], np.float32)
    got, _ = run_both(model("Round", {"x": x}), {"x": x})
    assert got[0].tolist() == [0.0, 2.0, 2.0, -0.0, -2.0, 3.0, -4.0]


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dt", [np.int32, np.int64, np.int8, np.int16, np.uint8, np.uint32])
def test_integer_mod_matches_onnxruntime(dt: Any, fmod: int) -> None:
    a = ints(dt, (4, 5))
    b = ints(dt, (5,), lo=-7, hi=7)
    b[b == 0] = 3
    check(model("Mod", {"a": a, "b": b}, fmod=fmod), {"a": a, "b": b})


@pytest.mark.parametrize("dt", [np.float32, np.float16, np.float64])
def test_float_fmod_matches_onnxruntime(dt: Any) -> None:
    a = (rng.standard_normal((4, 5)) * 10).astype(dt)
    b = (rng.standard_normal((5,)) * 3).astype(dt)
    check(model("Mod", {"a": a, "b": b}, fmod=1), {"a": a, "b": b}, tol=1e-3 if dt == np.float16 else 1e-6)


def test_mod_sign_rules_follow_the_spec() -> None:
    # fmod=0: the divisor's sign (Python %); fmod=1: the dividend's (C fmod)
    a = np.array([-4, 7, 5, 4, -7, 8], np.int64)
    b = np.array([2, -3, 8, -2, 3, 5], np.int64)
    got0, _ = run_both(model("Mod", {"a": a, "b": b}), {"a": a, "b": b})
    got1, _ = run_both(model("Mod", {"a": a, "b": b}, fmod=1), {"a": a, "b": b})
    assert got0[0].tolist() == [int(x) % int(y) for x, y in zip(a, b)]
    assert got1[0].tolist() == [int(np.fmod(float(x), float(y))) for x, y in zip(a, b)]


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
@pytest.mark.parametrize("dt", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_bit_shift_matches_onnxruntime(dt: Any, direction: str) -> None:
    x = ints(dt, (3, 4), lo=0, hi=200)
    s = ints(dt, (4,), lo=0, hi=7)
    check(model("BitShift", {"x": x, "s": s}, direction=direction), {"x": x, "s": s})


def test_bit_shift_out_of_range_and_signed_follow_the_spec() -> None:
    # (onnxruntime has no signed BitShift.) Signed right shifts are arithmetic; amounts < 0 or
    # >= the width give the sign fill only: -1 right-shifting a negative value, else 0
    x = np.array([-128, -1, 64, 3, -5, 1], np.int8)
    s = np.array([1, 9, -1, 8, 2, 7], np.int8)
    outs = {}
    for d in ("LEFT", "RIGHT"):
        m = model("BitShift", {"x": x, "s": s}, direction=d)
        outs[d] = reference.run(import_onnx(m), {"x": x, "s": s})["y0"].tolist()
    assert outs["RIGHT"] == [-64, -1, 0, 0, -2, 0]
    assert outs["LEFT"] == [0, 0, 0, 0, -20, -128]  # -5 << 2 = -20; 1 << 7 lands on the sign bit


@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
@pytest.mark.parametrize("dt", [np.int32, np.int64, np.int8, np.int16, np.uint8, np.uint64])
def test_bitwise_binary_matches_onnxruntime(op: str, dt: Any) -> None:
    a, b = ints(dt, (2, 3, 4), lo=-100, hi=100), ints(dt, (3, 4), lo=-100, hi=100)
    check(model(op, {"a": a, "b": b}), {"a": a, "b": b})


@pytest.mark.parametrize("dt", [np.int32, np.uint8, np.int16, np.uint16])
def test_bitwise_not_matches_onnxruntime(dt: Any) -> None:
    x = ints(dt, (3, 4), lo=-100, hi=100)
    check(model("BitwiseNot", {"x": x}), {"x": x})


def test_xor_matches_onnxruntime() -> None:
    a, b = rng.random((3, 4)) > 0.5, rng.random((4,)) > 0.5
    check(model("Xor", {"a": a, "b": b}), {"a": a, "b": b})


# ---- reductions, arg max/min, top-k ------------------------------------------------------------

@pytest.mark.parametrize("op", ["ReduceMin", "ReduceProd", "ReduceMax"])
@pytest.mark.parametrize("axes,keep", [([1], 1), ([0, 2], 0), ([-1], 1), (None, 0)])
def test_min_prod_reductions_match_onnxruntime(op: str, axes: list[int] | None, keep: int) -> None:
    x = (rng.standard_normal((3, 4, 5)) * 0.5 + 1).astype(np.float32)
    consts = {"axes": np.array(axes, np.int64)} if axes is not None else {}
    check(model(op, {"x": x}, consts, keepdims=keep), {"x": x}, tol=1e-5)


@pytest.mark.parametrize("dt", [np.int32, np.uint8, np.float64])
def test_reduce_min_on_other_dtypes(dt: Any) -> None:
    x = ints(dt, (3, 4), lo=0, hi=90) if np.dtype(dt).kind != "f" else rng.standard_normal((3, 4))
    check(model("ReduceMin", {"x": x}, {"axes": np.array([0], np.int64)}), {"x": x})


@pytest.mark.parametrize("op,identity", [("ReduceMin", np.inf), ("ReduceMax", -np.inf), ("ReduceProd", 1.0),
                                         ("ReduceSum", 0.0)])
def test_reductions_over_an_empty_axis_give_the_identity(op: str, identity: float) -> None:
    # ONNX: a reduction over an empty set gives the operation's identity (+-inf for min/max)
    x = np.zeros((3, 0, 2), np.float32)
    got, _ = run_both(model(op, {"x": x}, {"axes": np.array([1], np.int64)}, keepdims=1), {"x": x})
    assert got[0].shape == (3, 1, 2) and np.all(got[0] == np.float32(identity))


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMin"])
def test_empty_axes_input_reduces_all_or_nothing(op: str) -> None:
    x = rng.standard_normal((2, 3)).astype(np.float32)
    empty = {"axes": np.zeros((0,), np.int64)}
    check(model(op, {"x": x}, empty, keepdims=1), {"x": x}, tol=1e-6)
    check(model(op, {"x": x}, empty, keepdims=1, noop_with_empty_axes=1), {"x": x}, tol=1e-6)


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis,keep,last", [(0, 1, 0), (1, 0, 0), (-1, 1, 1), (1, 0, 1)])
def test_arg_max_min_match_onnxruntime(op: str, axis: int, keep: int, last: int) -> None:
    x = rng.integers(0, 3, size=(4, 5, 3)).astype(np.float32)  # many ties
    check(model(op, {"x": x}, axis=axis, keepdims=keep, select_last_index=last), {"x": x})


@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("axis,k", [(-1, 3), (0, 2), (1, 5)])
def test_topk_matches_onnxruntime(largest: int, axis: int, k: int) -> None:
    x = rng.standard_normal((4, 5, 6)).astype(np.float32)
    check(model("TopK", {"x": x}, {"k": np.array([k], np.int64)}, n_out=2, axis=axis, largest=largest), {"x": x})


def test_topk_ties_keep_index_order() -> None:
    x = np.array([[3, 1, 3, 2, 1, 3]], np.int64)
    m = model("TopK", {"x": x}, {"k": np.array([4], np.int64)}, n_out=2, largest=1)
    (values, idx), _ = run_both(m, {"x": x})
    assert values.tolist() == [[3, 3, 3, 2]] and idx.tolist() == [[0, 2, 5, 3]]
    (values, idx), _ = run_both(model("TopK", {"x": x}, {"k": np.array([3], np.int64)}, n_out=2, largest=0), {"x": x})
    assert values.tolist() == [[1, 1, 2]] and idx.tolist() == [[1, 4, 3]]


# ---- pad -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("pads", [[1, 2, 2, 1], [0, 1, 0, 3], [2, -1, 0, 2]])
def test_pad_matches_onnxruntime(mode: str, pads: list[int]) -> None:
    x = rng.standard_normal((3, 4)).astype(np.float32)
    consts = {"pads": np.array(pads, np.int64)}
    if mode == "constant":
        consts["value"] = np.array(1.5, np.float32)
    check(model("Pad", {"x": x}, consts, mode=mode), {"x": x})


def test_pad_with_axes_and_run_time_fill_matches_onnxruntime() -> None:
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    v = np.array(-2.0, np.float32)
    m = model("Pad", {"x": x, "v": v}, {"pads": np.array([1, 0, 2, -1], np.int64), "axes": np.array([-1, 1], np.int64)},
              order=["x", "pads", "v", "axes"])
    check(m, {"x": x, "v": v})


def test_pad_int_default_fill_matches_onnxruntime() -> None:
    x = ints(np.int32, (2, 3))
    check(model("Pad", {"x": x}, {"pads": np.array([1, 1, 0, 2], np.int64)}), {"x": x})


# ---- dtypes and empty tensors ----------------------------------------------------------------

@pytest.mark.parametrize("src,dst", [(np.float32, np.float64), (np.float64, np.float32), (np.float32, np.int8),
                                     (np.float32, np.uint8), (np.int16, np.float32), (np.uint8, np.int64),
                                     (np.int64, np.int16), (np.float16, np.float64)])
def test_cast_between_new_dtypes_matches_onnxruntime(src: Any, dst: Any) -> None:
    x = (rng.standard_normal((3, 4)) * 20).astype(src) if np.dtype(src).kind == "f" else ints(src, (3, 4), lo=0)
    if np.dtype(dst).kind == "u":
        x = np.abs(x)
    to = helper.np_dtype_to_tensor_dtype(np.dtype(dst))
    check(model("Cast", {"x": x}, to=to), {"x": x})


def test_castlike_with_an_empty_like_input() -> None:
    x = rng.standard_normal((3, 4)).astype(np.float32)
    like = np.zeros((0,), np.float16)
    check(model("CastLike", {"x": x, "like": like}), {"x": x, "like": like})


@pytest.mark.parametrize("op", ["Add", "Mod", "BitwiseAnd"])
def test_zero_length_tensors_through_elementwise_ops(op: str) -> None:
    a, b = np.zeros((0, 3), np.int32), np.ones((3,), np.int32)
    check(model(op, {"a": a, "b": b}), {"a": a, "b": b})


def test_float64_elementwise_chain_stays_float64() -> None:
    x = rng.standard_normal((2, 3))
    nodes = [helper.make_node("Floor", ["x"], ["f"]), helper.make_node("Mul", ["f", "x"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    m.ir_version = 10
    got, want = run_both(m, {"x": x})
    assert got[0].dtype == np.float64 and np.array_equal(got[0], want[0])


def test_shapes_may_restate_a_zero_dim_the_model_fixes_but_not_give_one() -> None:
    from fusec.errors import InputError
    from fusec.loader import load_graph

    x, like = rng.standard_normal((3, 4)).astype(np.float32), np.zeros((0,), np.float16)
    m = model("CastLike", {"x": x, "like": like})
    g = load_graph(m, {"x": (3, 4), "like": (0,)})  # what a caller passing every input's shape does
    assert reference.run(g, {"x": x, "like": like})["y0"].dtype == np.float16
    dyn = model("Relu", {"x": x})
    dyn.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "n"
    with pytest.raises(InputError, match="dim 0 must be positive"):
        load_graph(dyn, {"x": (0, 4)})
