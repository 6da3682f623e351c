"""import_onnx as a whole: binding symbolic dims, errors for bad shapes and unsupported models,
folding of shape arithmetic, weights left as nodes, odd names, outputs that alias other values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fusec import reference
from fusec.errors import InputError, ModelError
from fusec.frontend.onnx_import import import_onnx
from fusec.ir import verify

rng = np.random.default_rng(20261123)
F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes: list, inputs: list, outputs: list, inits: list = (), opset: int = 18) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _arr(x: np.ndarray, name: str) -> TensorProto:
    return onnx.numpy_helper.from_array(x, name)


def _vi(name: str, elem: int, shape: list | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # the test machine's cores are shared
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)


def _heads_model() -> onnx.ModelProto:
    """x[b, s, 16] -> Reshape to [b, s, 4, 4] through Shape/Gather/Unsqueeze/Concat -> + mask[b, s]."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"]),
        helper.make_node("Gather", ["shp", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["shp", "i1"], ["s"], axis=0),
        helper.make_node("Unsqueeze", ["b", "ax0"], ["b1"]),
        helper.make_node("Unsqueeze", ["s", "ax0"], ["s1"]),
        helper.make_node("Concat", ["b1", "s1", "four", "minus1"], ["newshape"], axis=0),
        helper.make_node("Reshape", ["x", "newshape"], ["x4"]),
        helper.make_node("Cast", ["mask"], ["maskf"], to=F32),
        helper.make_node("Unsqueeze", ["maskf", "ax23"], ["mask4"]),
        helper.make_node("Add", ["x4", "mask4"], ["y"]),
    ]
    inits = [_arr(np.array(0, np.int64), "i0"), _arr(np.array(1, np.int64), "i1"),
             _arr(np.array([0], np.int64), "ax0"), _arr(np.array([4], np.int64), "four"),
             _arr(np.array([-1], np.int64), "minus1"), _arr(np.array([2, 3], np.int64), "ax23")]
    return _model(nodes, [_vi("x", F32, ["batch", "seq", 16]), _vi("mask", I64, ["batch", "seq"])],
                  [_vi("y", F32, ["batch", "seq", 4, 4])], inits)


def test_symbolic_dims_bound_from_shapes_and_shape_arithmetic_folded() -> None:
    m = _heads_model()
    g = import_onnx(m, {"x": (2, 5, 16), "mask": (2, 5)})
    verify(g)
    assert [(v.name, v.shape) for v in g.inputs] == [("x", (2, 5, 16)), ("mask", (2, 5))]
    assert [(v.name, v.shape) for v in g.outputs] == [("y", (2, 5, 4, 4))]
    # Shape/Gather/Unsqueeze/Concat on static shapes leave nothing behind but the tensor work
    assert g.op_histogram() == {"add": 1, "cast": 1, "reshape": 2}
    feeds = {"x": rng.standard_normal((2, 5, 16)).astype(np.float32), "mask": rng.integers(0, 2, (2, 5))}
    np.testing.assert_allclose(reference.run(g, feeds)["y"], _ort(m, feeds)[0], rtol=1e-6)


@pytest.mark.parametrize("shapes, needles", [
    (None, ["'x'", "symbolic dims ['batch', 'seq']"]),
    ({"x": (2, 5, 16)}, ["'mask'", "symbolic dims ['batch', 'seq']"]),
    ({"x": (2, 5, 16), "mask": (2, 5), "y": (1,)}, ["unknown input 'y'"]),
    ({"x": (2, 5), "mask": (2, 5)}, ["'x'", "rank 3"]),
    ({"x": (2, 0, 16), "mask": (2, 5)}, ["'x'", "dim 1 must be positive"]),
    ({"x": (2, -1, 16), "mask": (2, 5)}, ["'x'", "dim 1 must be positive"]),
    ({"x": (2, 5, 8), "mask": (2, 5)}, ["'x'", "dim 2 is 16 in the model", "gives 8"]),
    ({"x": (2, 5, 16), "mask": (2, 6)}, ["'mask'", "'seq'", "'x' binds it to 5"]),
    ({"x": (2, "a", 16), "mask": (2, 5)}, ["'x'", "sequence of ints"]),
])
def test_bad_shapes_are_input_errors_naming_the_input(shapes: dict | None, needles: list[str]) -> None:
    with pytest.raises(InputError) as ei:
        import_onnx(_heads_model(), shapes)
    msg = str(ei.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"


def test_static_input_needs_no_shape_and_accepts_a_matching_one() -> None:
    m = _model([helper.make_node("Neg", ["x"], ["y"])], [_vi("x", F32, [3, 4])], [_vi("y", F32, [3, 4])])
    assert import_onnx(m).inputs[0].shape == (3, 4)
    assert import_onnx(m, {"x": [3, 4]}).inputs[0].shape == (3, 4)


def test_all_unsupported_ops_are_listed_in_one_line() -> None:
    nodes = [helper.make_node("Neg", ["x"], ["a"], name="ok"),
             helper.make_node("StringNormalizer", ["a"], ["b"], name='weird"name\nwith newline'),
             helper.make_node("FusedMatMul", ["b", "b"], ["c"], name="fm", domain="com.microsoft"),
             helper.make_node("StringNormalizer", ["c"], ["y"], name="second")]
    m = _model(nodes, [_vi("x", F32, [4, 4])], [_vi("y", F32, [4, 4])])
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    with pytest.raises(ModelError) as ei:
        import_onnx(m)
    msg = str(ei.value)
    assert "\n" not in msg
    assert "3 unsupported node(s)" in msg
    assert "'StringNormalizer' (domain 'ai.onnx', opset 18)" in msg and "'second'" in msg
    assert repr('weird"name\nwith newline') in msg
    assert "'FusedMatMul' (domain 'com.microsoft', opset 1)" in msg


@pytest.mark.parametrize("opset", [11, 12])
def test_old_opsets_are_refused(opset: int) -> None:
    m = _model([helper.make_node("Neg", ["x"], ["y"])], [_vi("x", F32, [2])], [_vi("y", F32, [2])], opset=opset)
    with pytest.raises(ModelError, match=f"unsupported opset {opset}"):
        import_onnx(m)


def test_unsupported_dtypes_name_the_value() -> None:
    # (float64 and int8 are supported since the reference grew them: complex stands for the rest)
    m = _model([helper.make_node("Neg", ["x"], ["y"])], [_vi("x", TensorProto.COMPLEX64, [2])],
               [_vi("y", TensorProto.COMPLEX64, [2])])
    with pytest.raises(ModelError, match="input 'x' has dtype complex64"):
        import_onnx(m)
    nodes = [helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.COMPLEX64),
             helper.make_node("Add", ["xi", "w8"], ["s"]), helper.make_node("Cast", ["s"], ["y"], to=F32)]
    m = _model(nodes, [_vi("x", F32, [3])], [_vi("y", F32, [3])], [_arr(np.array([1, 2, 3], np.complex64), "w8")])
    with pytest.raises(ModelError, match="complex64"):
        import_onnx(m)


@pytest.mark.parametrize("elem", [TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT32])
def test_half_and_int32_tensors_keep_their_dtype(elem: int) -> None:
    npdt = onnx.helper.tensor_dtype_to_np_dtype(elem)
    w = (rng.integers(1, 9, (2, 3)) * np.where(rng.random((2, 3)) < 0.5, -1, 1)).astype(npdt)
    m = _model([helper.make_node("Mul", ["x", "w"], ["y"])], [_vi("x", elem, [2, 3])], [_vi("y", elem, [2, 3])],
               [_arr(w, "w")])
    g = import_onnx(m)
    assert {v.dtype.np for v in g.values()} == {np.dtype(npdt)}
    x = rng.integers(1, 9, (2, 3)).astype(npdt)
    got = reference.run(g, {"x": x})["y"]
    assert got.dtype == npdt  # small integers: exact in every one of these dtypes
    np.testing.assert_array_equal(got.astype(np.float32), x.astype(np.float32) * w.astype(np.float32))


def test_float64_shape_arithmetic_is_fine_when_folded() -> None:
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=-1),
             helper.make_node("Cast", ["s"], ["sd"], to=TensorProto.DOUBLE),
             helper.make_node("Sqrt", ["sd"], ["r"]), helper.make_node("Cast", ["r"], ["ri"], to=F32),
             helper.make_node("Mul", ["x", "ri"], ["y"])]
    m = _model(nodes, [_vi("x", F32, [4, 9])], [_vi("y", F32, [4, 9])])
    g = import_onnx(m)
    assert g.op_histogram() == {"mul": 1}
    x = rng.standard_normal((4, 9)).astype(np.float32)
    np.testing.assert_allclose(reference.run(g, {"x": x})["y"], _ort(m, {"x": x})[0], rtol=1e-6)


def test_weights_are_not_folded_into_but_small_constants_are() -> None:
    w = rng.standard_normal((80, 64)).astype(np.float32)  # 5120 elements: a weight
    s = rng.standard_normal((4, 8)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"]), helper.make_node("MatMul", ["x", "wt"], ["h"]),
             helper.make_node("Cast", ["w"], ["w16"], to=TensorProto.FLOAT16),
             helper.make_node("Cast", ["w16"], ["w32"], to=F32), helper.make_node("MatMul", ["h", "w32"], ["h2"]),
             helper.make_node("Transpose", ["s"], ["st"]), helper.make_node("Reshape", ["st", "flat"], ["sf"]),
             helper.make_node("Slice", ["sf", "zero", "sixtyfour"], ["sb"]),
             helper.make_node("Concat", ["sb", "sb"], ["sc"], axis=0),
             helper.make_node("Add", ["h2", "sc"], ["y"])]
    inits = [_arr(w, "w"), _arr(s, "s"), _arr(np.array([-1], np.int64), "flat"), _arr(np.array([0], np.int64), "zero"),
             _arr(np.array([64], np.int64), "sixtyfour")]
    m = _model(nodes, [_vi("x", F32, [2, 64])], [_vi("y", F32, [2, 64]), _vi("h", F32, [2, 80])], inits)
    g = import_onnx(m)
    assert g.op_histogram() == {"add": 1, "cast": 2, "matmul": 2, "transpose": 1}
    (tr,) = [n for n in g.nodes if n.op.value == "transpose"]
    assert tr.inputs[0].name == "w"
    x = rng.standard_normal((2, 64)).astype(np.float32)
    got, want = reference.run(g, {"x": x}), _ort(m, {"x": x})
    # Both outputs are sums of products: fp32 accumulation in another order than onnxruntime's differs
    # by ~K * 2^-24 of the terms' magnitude, which cancellation can leave above 1e-5 of a small result.
    for r, w in ((got["y"], want[0]), (got["h"], want[1])):
        np.testing.assert_allclose(r, w, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(w).max())))


def test_odd_names_survive_and_aliased_or_constant_outputs_get_their_own_names() -> None:
    xn, yn = 'in"put\n', "выход 'y'"
    nodes = [helper.make_node("Relu", [xn], ["t0"]), helper.make_node("Identity", [xn], ["copy"]),
             helper.make_node("Identity", ["t0"], [yn]), helper.make_node("Shape", [xn], ["shape"]),
             helper.make_node("Identity", ["t0"], ["again"])]
    m = _model(nodes, [_vi(xn, F32, [2, 3])], [_vi(yn, F32, [2, 3]), _vi("copy", F32, [2, 3]),
                                               _vi("shape", I64, [2]), _vi("again", F32, [2, 3])])
    g = import_onnx(m)
    assert [v.name for v in g.inputs] == [xn]
    assert [v.name for v in g.outputs] == [yn, "copy", "shape", "again"]
    assert len({v.name for v in g.values()}) == len(list(g.values()))
    x = rng.standard_normal((2, 3)).astype(np.float32)
    got = reference.run(g, {xn: x})
    for (name, r), w in zip(got.items(), _ort(m, {xn: x})):
        np.testing.assert_array_equal(r, w, err_msg=name)


def test_layernorm_side_outputs_are_computed_and_runtime_shapes_are_refused() -> None:
    ln = helper.make_node("LayerNormalization", ["x", "g"], ["y", "mean"], name="ln")
    m = _model([ln], [_vi("x", F32, [2, 8])], [_vi("y", F32, [2, 8]), _vi("mean", F32, [2, 1])],
               [_arr(np.ones(8, np.float32), "g")])
    x = rng.standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_allclose(reference.run(import_onnx(m), {"x": x})["mean"], x.mean(axis=1, keepdims=True),
                               rtol=1e-5, atol=1e-6)
    rs = helper.make_node("Reshape", ["x", "shape"], ["y"], name="rs")
    m = _model([rs], [_vi("x", F32, [2, 8]), _vi("shape", I64, [2])], [_vi("y", F32, [4, 4])])
    with pytest.raises(ModelError, match="'rs' \\(Reshape\\): input 1 \\('shape'\\) depends on run-time data"):
        import_onnx(m, {"shape": (2,)})


def test_declared_output_type_is_checked() -> None:
    m = _model([helper.make_node("Neg", ["x"], ["y"])], [_vi("x", F32, ["n", 3])], [_vi("y", F32, ["n", 4])])
    with pytest.raises(ModelError, match="output 'y' is declared with shape \\[2, 4\\].*f32\\[2,3\\]"):
        import_onnx(m, {"x": (2, 3)})
    m = _model([helper.make_node("Neg", ["x"], ["y"])], [_vi("x", F32, ["n", 3])], [_vi("y", F32, ["m", 3])])
    assert import_onnx(m, {"x": (2, 3)}).outputs[0].shape == (2, 3)  # 'm' is bound by no input


def test_dead_nodes_are_dropped() -> None:
    nodes = [helper.make_node("Exp", ["x"], ["unused"]), helper.make_node("Neg", ["x"], ["y"])]
    m = _model(nodes, [_vi("x", F32, [2])], [_vi("y", F32, [2])])
    assert import_onnx(m).op_histogram() == {"neg": 1}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the legacy exporter is what we test
def test_torch_legacy_export_of_shape_code_folds_to_tensor_ops(tmp_path: Path) -> None:
    """A real TorchScript export: view/transpose by x.shape, a causal mask from arange and triu."""
    import torch

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, d = x.shape
            q = x.view(b, s, 4, d // 4).transpose(1, 2)  # [b, 4, s, d/4]
            scores = q @ q.transpose(-1, -2)
            pos = torch.arange(s, device=x.device)
            mask = torch.where(pos[None, :] > pos[:, None], float("-inf"), 0.0)
            return torch.softmax(scores + mask, dim=-1)

    path = tmp_path / "m.onnx"
    x = torch.randn(2, 6, 16)
    torch.onnx.export(M(), (x,), str(path), input_names=["x"], output_names=["p"], dynamo=False, opset_version=17,
                      dynamic_axes={"x": {0: "b", 1: "s"}})
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"Shape", "Range"} <= ops  # the file really computes shapes at run time
    g = import_onnx(path, {"x": (3, 5, 16)})
    assert g.op_histogram() == {"add": 1, "matmul": 1, "reshape": 1, "softmax": 1, "transpose": 2}
    xv = rng.standard_normal((3, 5, 16)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": xv})[0]
    np.testing.assert_allclose(reference.run(g, {"x": xv})["p"], want, rtol=1e-5, atol=1e-6)
