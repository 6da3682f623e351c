"""ONNX semantics at the edges, each once imported wrong or refused with a traceback: backward Slice
bounds, exclusive CumSum past an inf, NLL's mean with ignore_index -1, hyperbolic functions at
the ends of fp32's range, fractional attributes on integer inputs, malformed Einsum and index ops,
LayerNorm scales of another rank. Compared with onnxruntime (or float64 numpy) on the CPU."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from fusec import reference
from fusec.errors import ModelError
from fusec.frontend.onnx_import import import_onnx

RNG = np.random.default_rng(20261124)


def _one_node(op: str, feeds: dict[str, np.ndarray], consts: dict[str, np.ndarray], out_shape: tuple[int | str, ...] | None,
              out_dtype: np.dtype, attrs: dict | None = None, order: list[str] | None = None,
              opset: int = 18) -> onnx.ModelProto:
    node = helper.make_node(op, order or [*feeds, *consts], ["y"], name="n0", **(attrs or {}))
    elem = helper.np_dtype_to_tensor_dtype
    ins = [helper.make_tensor_value_info(k, elem(v.dtype), v.shape) for k, v in feeds.items()]
    out = helper.make_tensor_value_info("y", elem(np.dtype(out_dtype)), out_shape)
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()]
    m = helper.make_model(helper.make_graph([node], "g", ins, [out], inits),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _both(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    got = reference.run(import_onnx(m), feeds)["y"]
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    return got, want


@pytest.mark.parametrize("start,end,step", [(-10, -20, -1), (-6, -9, -1), (-7, -100, -2), (9, -10, -1), (2, -10, -3)])
@pytest.mark.parametrize("folded", [False, True])
def test_backward_slice_clamps_its_start_into_the_axis(start: int, end: int, step: int, folded: bool) -> None:
    x = np.arange(5, dtype=np.float32)
    consts = {"s": np.array([start]), "e": np.array([end]), "a": np.array([0]), "st": np.array([step])}
    feeds = {} if folded else {"x": x}
    if folded:  # data known at import: the slice is folded there
        consts = {"x": x, **consts}
    m = _one_node("Slice", feeds, consts, None, np.float32, order=["x", "s", "e", "a", "st"])
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    m.graph.output[0].type.tensor_type.shape.dim.add().dim_value = len(want)
    got = reference.run(import_onnx(m), feeds)["y"]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("x,reverse", [([1.0, np.inf, 2.0, 3.0], 0), ([1.0, 1e8, -1e8, 5.0], 0),
                                       ([2.0, 3.0, -np.inf, 1.0], 1)])
def test_exclusive_cumsum_shifts_instead_of_subtracting(x: list[float], reverse: int) -> None:
    xa = np.asarray(x, np.float32)
    m = _one_node("CumSum", {"x": xa}, {"axis": np.array(0)}, xa.shape, np.float32,
                  {"exclusive": 1, "reverse": reverse}, opset=14)
    got, want = _both(m, {"x": xa})
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("ignore", [-1, 2])
def test_nll_mean_divides_by_the_targets_not_ignored(ignore: int) -> None:
    x = RNG.standard_normal((6, 4)).astype(np.float32)
    t = np.array([0, ignore, 3, 1, 2, 3], np.int64)
    m = _one_node("NegativeLogLikelihoodLoss", {"x": x, "t": t}, {}, (), np.float32,
                  {"reduction": "mean", "ignore_index": ignore}, opset=13)
    got, want = _both(m, {"x": x, "t": t})
    np.testing.assert_allclose(got, want, rtol=1e-6)
    kept = t != ignore
    np.testing.assert_allclose(got, -x[np.arange(6), np.where(kept, t, 0)][kept].mean(), rtol=1e-6)


_HYP = {"Sinh": np.sinh, "Cosh": np.cosh, "Asinh": np.arcsinh, "Acosh": np.arccosh, "Atanh": np.arctanh}


@pytest.mark.parametrize("op", sorted(_HYP))
def test_hyperbolic_functions_hold_fp32_precision_over_its_range(op: str) -> None:
    mags = np.concatenate([np.geomspace(1e-30, 88.5, 300), [0.0, 0.49, 0.5, 0.51, 9999.0, 1e4, 1e20, 3e38]])
    x = {"Acosh": 1.0 + mags, "Atanh": np.concatenate([mags[mags < 1], -mags[mags < 1]])}.get(
        op, np.concatenate([mags, -mags])).astype(np.float32)
    x = x[np.isfinite(x)]
    m = _one_node(op, {"x": x}, {}, x.shape, np.float32)
    got = reference.run(import_onnx(m), {"x": x})["y"].astype(np.float64)
    with np.errstate(over="ignore"):
        want = _HYP[op](x.astype(np.float64)).astype(np.float32).astype(np.float64)
    fin = np.isfinite(want)
    np.testing.assert_array_equal(got[~fin], want[~fin])  # sinh/cosh past fp32's range: the same inf
    rel = np.abs(got[fin] - want[fin]) / np.maximum(np.abs(want[fin]), 1e-38)
    # sinh/cosh: exp's argument |x| - ln 2 is rounded to fp32 (relative error ~ 2^-24 |x|)
    assert rel.max() < (2e-6 if op in ("Sinh", "Cosh") else 5e-7), (op, x[fin][rel.argmax()], rel.max())


def test_integer_inputs_refuse_fractional_attributes_and_keep_integral_ones() -> None:
    x = np.array([-5, -3, -2, -1, 0, 1, 2, 3, 5], np.int32)
    m = _one_node("Shrink", {"x": x}, {}, x.shape, np.int32, {"lambd": 1.5, "bias": 0.5})
    with pytest.raises(ModelError, match=r"node 'n0' \(Shrink\): value 0.5 cannot be held exactly .* int32"):
        import_onnx(m)
    m = _one_node("Shrink", {"x": x}, {}, x.shape, np.int32, {"lambd": 1.5, "bias": 1.0})
    got, want = _both(m, {"x": x})
    np.testing.assert_array_equal(got, want)
    a = np.arange(4, dtype=np.int64).reshape(2, 2)
    m = _one_node("Gemm", {"a": a, "b": a}, {}, (2, 2), np.int64, {"alpha": 0.5})
    with pytest.raises(ModelError, match=r"\(Gemm\): value 0.5 cannot be held exactly"):
        import_onnx(m)


@pytest.mark.parametrize("eq,msg", [("ij,jk->il", "output letter.s. l appear in no operand"),
                                    ("ij->k", "k appear in no operand"), ("ij,jk->ii", "repeats a letter")])
def test_einsum_with_a_bad_output_is_refused_in_one_line(eq: str, msg: str) -> None:
    a = np.ones((2, 2), np.float32)
    feeds = {"a": a, "b": a} if eq.count(",") else {"a": a}
    m = _one_node("Einsum", feeds, {}, ("o0", "o1"), np.float32, {"equation": eq}, opset=13)
    with pytest.raises(ModelError, match=f"node 'n0'.*{msg}"):
        import_onnx(m)


@pytest.mark.parametrize("op,shapes,dtypes,attrs,msg", [
    ("GatherElements", [(2, 3), (4, 3)], [np.float32, np.int64], {"axis": 1}, "indices dim 0 is 4, beyond"),
    ("GatherElements", [(2, 3), (2, 3)], [np.float32, np.float32], {"axis": 1}, "indices must be integers"),
    ("GatherND", [(2, 3, 4), (3, 1)], [np.float32, np.int64], {"batch_dims": 1}, "batch dims of data"),
    ("GatherND", [(2, 3), (3, 1)], [np.float32, np.float32], {}, "indices must be integers"),
    ("ScatterND", [(4, 3), (2, 1), (2, 5)], [np.float32, np.int64, np.float32], {}, "updates must be f32"),
    ("ScatterND", [(4, 3), (1, 3), (1,)], [np.float32, np.int64, np.float32], {}, "index tuples of length 3"),
])
def test_index_ops_with_malformed_operands_are_refused_at_import(op: str, shapes: list, dtypes: list, attrs: dict,
                                                                 msg: str) -> None:
    feeds = {f"i{k}": np.zeros(s, d) for k, (s, d) in enumerate(zip(shapes, dtypes))}
    m = _one_node(op, feeds, {}, ("o0", "o1"), np.float32, attrs, opset=13)
    with pytest.raises(ModelError, match=f"node 'n0'.*{msg}"):
        import_onnx(m)


@pytest.mark.parametrize("sshape", [(1, 4), (1, 1, 4), (3, 1), (4,)])
def test_layernorm_takes_scales_that_broadcast_to_the_input(sshape: tuple[int, ...]) -> None:
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    s = RNG.standard_normal(sshape).astype(np.float32)
    m = _one_node("LayerNormalization", {"x": x}, {"s": s}, x.shape, np.float32, {"axis": -1}, opset=17)
    got, want = _both(m, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
