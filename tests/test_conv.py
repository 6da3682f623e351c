"""Conv, ConvTranspose and pooling in the ONNX frontend (fusec/frontend/onnx_ops_conv.py): lowered
onto existing IR ops (patch GEMM, im2col gather + GEMM, window reductions), checked against onnx's
own reference evaluator (an independent implementation), refused in one line naming the node and
attribute where unsupported, and compiled for sm_90 on the CPU."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from graph_checks import run_plan
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import fusec
from fusec import reference
from fusec.errors import FusecError
from fusec.frontend.onnx_import import import_onnx
from fusec.ops import Op


def _model(op: str, x_shape, w_shape=None, bias: bool = False, n_out: int = 1, **attrs) -> tuple[onnx.ModelProto, dict]:  # noqa: ANN001
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(np.float32)
    inits, ins = [], ["x"]
    if w_shape is not None:
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal(w_shape).astype(np.float32), "w"))
        ins.append("w")
    if bias:
        m = w_shape[0] if op == "Conv" else w_shape[1] * attrs.get("group", 1)
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal(m).astype(np.float32), "b"))
        ins.append("b")
    outs = ["y", "idx"][:n_out]
    node = helper.make_node(op, ins, outs, name="the_node", **attrs)
    types = (TensorProto.FLOAT, TensorProto.INT64)

    def build(shapes) -> onnx.ModelProto:  # noqa: ANN001
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                                  [helper.make_tensor_value_info(o, t, s) for o, t, s in zip(outs, types, shapes)],
                                  inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])

    try:  # the declared output shapes are what onnx's evaluator computes (invalid attributes: none)
        shapes = [list(r.shape) for r in ReferenceEvaluator(build([None] * n_out)).run(None, {"x": x})]
    except Exception:  # an invalid model, or one onnx's evaluator fails on: symbolic dims
        shapes = [[f"d{i}" for i in range(len(x_shape))]] * n_out
    return build(shapes), {"x": x}


def _check(model: onnx.ModelProto, feeds: dict) -> object:
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    g = import_onnx(model)
    got = reference.run(g, feeds)[g.outputs[0].name]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    return g


def _ops(g) -> list[Op]:  # noqa: ANN001
    return [n.op for n in g.nodes]


CONVS = [  # (x shape, w shape, attrs)
    ((2, 3, 16, 16), (8, 3, 4, 4), dict(strides=[4, 4])),  # patch embedding (ViT/CLIP)
    ((2, 3, 18, 17), (8, 3, 4, 4), dict(strides=[4, 4])),  # patches that leave a tail
    ((2, 4, 5, 5), (6, 4, 1, 1), dict()),  # 1x1
    ((2, 5, 12), (6, 5, 3), dict(pads=[1, 1])),  # Whisper conv1
    ((2, 6, 12), (6, 6, 3), dict(pads=[1, 1], strides=[2])),  # Whisper conv2
    ((1, 3, 9, 8), (4, 3, 3, 2), dict(pads=[1, 0, 2, 1], strides=[2, 1], dilations=[1, 2])),
    ((1, 2, 7, 7), (4, 2, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2])),
    ((1, 2, 7, 6), (4, 2, 3, 3), dict(auto_pad="SAME_LOWER", strides=[2, 2])),
    ((1, 2, 7, 7), (4, 2, 3, 3), dict(auto_pad="VALID")),
    ((2, 4, 9), (6, 2, 3), dict(group=2, pads=[1, 1])),  # grouped
    ((1, 4, 6, 6), (4, 1, 3, 3), dict(group=4, pads=[1, 1, 1, 1])),  # depthwise
    ((1, 2, 4, 5, 5), (3, 2, 2, 3, 3), dict(pads=[0, 1, 1, 0, 1, 1])),  # 3-D
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("xs,ws,attrs", CONVS)
def test_conv_matches_onnx_reference(xs, ws, attrs, bias: bool) -> None:
    g = _check(*_model("Conv", xs, ws, bias=bias, **attrs))
    ops = _ops(g)
    assert ops.count(Op.MATMUL) == 1
    patch = attrs.get("strides", [1] * (len(xs) - 2)) == list(ws[2:]) and not attrs.get("pads")
    assert (Op.GATHER not in ops) == patch  # kernel == stride: reshape/transpose + GEMM, no im2col
    if patch and set(ws[2:]) == {1}:  # 1x1: the GEMM reads x as it is
        assert Op.TRANSPOSE not in ops


CONV_TRANSPOSES = [
    ((1, 2, 4, 4), (2, 3, 3, 3), dict(strides=[2, 2])),
    ((1, 2, 5), (2, 3, 3), dict(strides=[3], pads=[1, 2], output_padding=[1])),
    ((1, 2, 3, 4), (2, 2, 3, 2), dict(strides=[2, 1], dilations=[2, 1], pads=[1, 0, 0, 1])),
    ((1, 4, 3, 3), (4, 2, 3, 3), dict(group=2, strides=[2, 2])),
    ((1, 2, 3, 3), (2, 2, 3, 3), dict(strides=[2, 2], output_shape=[7, 8])),
    ((1, 2, 3, 3), (2, 2, 3, 3), dict(strides=[2, 2], auto_pad="SAME_UPPER")),
]


@pytest.mark.parametrize("xs,ws,attrs", CONV_TRANSPOSES)
def test_conv_transpose_matches_onnx_reference(xs, ws, attrs) -> None:
    if attrs.get("group", 1) > 1:  # onnx's evaluator fails on grouped ConvTranspose: torch is the oracle
        torch = pytest.importorskip("torch")
        model, feeds = _model("ConvTranspose", xs, ws, bias=True, **attrs)
        w, b = (torch.from_numpy(onnx.numpy_helper.to_array(t).copy()) for t in model.graph.initializer)
        want = torch.nn.functional.conv_transpose2d(torch.from_numpy(feeds["x"]), w, b, stride=attrs["strides"],
                                                    groups=attrs["group"]).numpy()
        g = import_onnx(model, shapes=None)
        np.testing.assert_allclose(reference.run(g, feeds)[g.outputs[0].name], want, rtol=1e-4, atol=1e-4)
        return
    _check(*_model("ConvTranspose", xs, ws, bias=True, **attrs))


POOLS = [
    ("MaxPool", (2, 3, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("MaxPool", (1, 2, 8), dict(kernel_shape=[2], strides=[2])),
    ("MaxPool", (1, 2, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    ("MaxPool", (1, 1, 6, 6), dict(kernel_shape=[2, 2], dilations=[2, 2], auto_pad="SAME_UPPER")),
    ("AveragePool", (2, 3, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ("AveragePool", (2, 3, 7, 7), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1)),
    ("AveragePool", (1, 2, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
    ("LpPool", (1, 2, 6, 6), dict(kernel_shape=[2, 2], strides=[2, 2], p=3)),
    ("GlobalAveragePool", (2, 3, 4, 5), dict()),
    ("GlobalMaxPool", (2, 3, 4, 5), dict()),
    ("GlobalAveragePool", (2, 3, 7), dict()),
]


@pytest.mark.parametrize("op,xs,attrs", POOLS)
def test_pooling_matches_onnx_reference(op: str, xs, attrs) -> None:
    _check(*_model(op, xs, **attrs))


REFUSED = [
    (("Conv", (1, 4, 5, 5), (4, 3, 3, 3)), dict(group=2), "group"),
    (("Conv", (1, 3, 5, 5), (4, 3, 3, 3)), dict(auto_pad="SAME"), "auto_pad"),
    (("Conv", (1, 3, 5, 5), (4, 3, 3, 3)), dict(strides=[0, 1]), "strides"),
    (("Conv", (1, 3, 5, 5), (4, 3, 3, 3)), dict(pads=[1, 1]), "pads"),
    (("Conv", (1, 3, 5, 5), (4, 3, 3, 3)), dict(kernel_shape=[2, 2]), "kernel_shape"),
    (("Conv", (1, 3, 2, 2), (4, 3, 3, 3)), dict(), "window"),
    (("MaxPool", (1, 3, 5, 5)), dict(kernel_shape=[2, 2], storage_order=2), "storage_order"),
    (("LpPool", (1, 3, 5, 5)), dict(kernel_shape=[2, 2], p=0), "p=0"),
]


@pytest.mark.parametrize("spec,attrs,word", REFUSED)
def test_unsupported_convs_are_refused_naming_node_and_attribute(spec, attrs, word: str) -> None:
    model, _ = _model(*spec, **attrs)
    with pytest.raises(FusecError, match=rf"'the_node' \({spec[0]}\).*{word}"):
        import_onnx(model)


@pytest.mark.parametrize("order", [0, 1])
def test_maxpool_indices_match_onnx_reference(order: int) -> None:
    model, feeds = _model("MaxPool", (2, 3, 7, 6), n_out=2, kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1],
                          storage_order=order)
    want = ReferenceEvaluator(model).run(None, feeds)
    g = import_onnx(model)
    got = reference.run(g, feeds)
    np.testing.assert_array_equal(got[g.outputs[0].name], want[0])
    np.testing.assert_array_equal(got[g.outputs[1].name], want[1])


@pytest.mark.parametrize("which", [0, 3, 9])
def test_conv_compiles_for_sm90(which: int) -> None:
    xs, ws, attrs = CONVS[which]
    model, feeds = _model("Conv", xs, ws, bias=True, **attrs)
    plan = fusec.compile(model, dtype="fp16", arch="sm_90")
    kinds = [L["type"] for L in plan.manifest["launches"]]
    # grouped: one strided-batched call over the groups per image (fusec.lower.batching)
    assert kinds.count("gemm") == (xs[0] if attrs.get("group", 1) > 1 else 1)
    assert plan.info()["inputs"][0]["name"] == "x"


@pytest.mark.gpu
@pytest.mark.parametrize("xs,ws,attrs", CONVS)
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("fp16", 3e-3)])
def test_conv_on_the_gpu(xs, ws, attrs, dtype: str, tol: float) -> None:
    import cupy

    model, feeds = _model("Conv", xs, ws, bias=True, **attrs)
    want = ReferenceEvaluator(model).run(None, feeds)[0].astype(np.float64)
    got = cupy.asnumpy(run_plan(fusec.compile(model, dtype=dtype), feeds)["y"]).astype(np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("op,xs,attrs", POOLS)
def test_pooling_on_the_gpu(op: str, xs, attrs) -> None:
    import cupy

    model, feeds = _model(op, xs, **attrs)
    want = ReferenceEvaluator(model).run(None, feeds)[0].astype(np.float64)
    got = cupy.asnumpy(fusec.compile(model, dtype="fp32").run(feeds)["y"]).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k,past,bias,act,dtype", [(4, False, False, "none", np.float32), (4, True, True, "silu", np.float32),
                                                    (1, False, True, "swish", np.float32), (3, True, True, "silu", np.float16)])
def test_causal_conv_with_state_matches_onnx_reference(k: int, past: bool, bias: bool, act: str, dtype) -> None:  # noqa: ANN001
    rng = np.random.default_rng(5)
    b, c, length = 2, 3, 6
    feeds = {"x": rng.standard_normal((b, c, length)).astype(dtype)}
    ttype = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    ins, inits = ["x", "w"], [onnx.numpy_helper.from_array(rng.standard_normal((c, 1, k)).astype(dtype), "w")]
    ins.append("b" if bias else "")
    if bias:
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal(c).astype(dtype), "b"))
    if past:
        ins.append("s")
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal((b, c, k - 1)).astype(dtype), "s"))
    node = helper.make_node("CausalConvWithState", ins, ["y", "state"], name="the_node", activation=act)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", ttype, (b, c, length))],
                              [helper.make_tensor_value_info("y", ttype, (b, c, length)),
                               helper.make_tensor_value_info("state", ttype, (b, c, k - 1))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 27)])
    want = ReferenceEvaluator(model).run(None, feeds)
    g = import_onnx(model)
    got = reference.run(g, feeds)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(got[g.outputs[0].name], want[0], rtol=tol, atol=tol)
    np.testing.assert_array_equal(got[g.outputs[1].name], want[1])


def test_maxpool_indices_feed_maxunpool_like_onnx_reference() -> None:
    x = np.random.default_rng(6).standard_normal((2, 3, 6, 6)).astype(np.float32)
    nodes = [helper.make_node("MaxPool", ["x"], ["y", "i"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("MaxUnpool", ["y", "i"], ["z"], name="unpool", kernel_shape=[2, 2], strides=[2, 2])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, x.shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    got = reference.run(import_onnx(model), {"x": x})["z"]
    np.testing.assert_array_equal(got, want)
    assert (got != 0).sum() == x.size // 4  # one maximum kept per window
