"""Quantized ONNX weights kept packed (fusec/frontend/onnx_qweights.py): com.microsoft MatMulNBits
and DequantizeLinear -> MatMul on a constant weight, against onnxruntime (CPU) on models made by
onnxruntime's own matmul_nbits_quantizer (4/8 bits, symmetric and with zero points, QOperator and
QDQ) and by hand (int8/uint8 per channel, per tensor, blocked); bad input is one line."""

from __future__ import annotations

import logging

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusec import reference  # noqa: E402
from fusec.errors import ModelError  # noqa: E402
from fusec.frontend.onnx_import import import_onnx  # noqa: E402
from fusec.ops import Op  # noqa: E402
from fusec.passes.base import PassOptions  # noqa: E402
from fusec.passes.pipeline import optimize  # noqa: E402

K, N, M = 256, 40, 3


def _matmul_model(k: int = K, n: int = N, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, n])],
                          [numpy_helper.from_array(w, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def _ort_quantized(bits: int, block: int, symmetric: bool, qdq: bool) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.ERROR)
    q = MatMulNBitsQuantizer(_matmul_model(), bits=bits, block_size=block, is_symmetric=symmetric,
                             quant_format=QuantFormat.QDQ if qdq else QuantFormat.QOperator)
    q.process()
    return q.model.model


def _ort(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """onnxruntime's answer without graph optimizations: with them, its CPU provider rewrites a QDQ
    int8 MatMul into one that quantizes the activations too (less exact than the model says)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _compare(model: onnx.ModelProto, rtol: float = 1e-5) -> object:
    x = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)
    want = _ort(model, x)
    g = import_onnx(model)
    assert [n.op for n in g.nodes] == [Op.QMATMUL]  # packed: no dequantized copy of the weight
    got = reference.run(g, {"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())
    opt, _ = optimize(g)  # constant folding leaves it packed
    assert Op.QMATMUL in [n.op for n in opt.nodes]
    half, _ = optimize(g, PassOptions(storage_dtype="bf16"), verify_each=True)  # the packed dtypes stay the file's
    q = next(n for n in half.nodes if n.op == Op.QMATMUL)
    assert [v.dtype for v in q.inputs[1:]] == [v.dtype for v in g.nodes[0].inputs[1:]] and q.inputs[0].dtype.value == "bf16"
    return g


@pytest.mark.parametrize("bits,block,symmetric", [(4, 32, True), (4, 32, False), (4, 128, False), (8, 32, True),
                                                  (8, 64, False)])
def test_matmul_nbits_matches_onnxruntime(bits, block, symmetric):
    m = _ort_quantized(bits, block, symmetric, qdq=False)
    assert m.graph.node[0].op_type == "MatMulNBits"
    g = _compare(m)
    fmt = g.nodes[0].attrs.format
    assert fmt == {(4, True): "int4", (4, False): "uint4", (8, True): "int8", (8, False): "uint8"}[bits, symmetric]


@pytest.mark.parametrize("symmetric", [True, False])
def test_qdq_int4_blocked_matches_onnxruntime(symmetric):
    m = _ort_quantized(4, 32, symmetric, qdq=True)
    assert [n.op_type for n in m.graph.node] == ["DequantizeLinear", "MatMul"]
    _compare(m)


def _qdq_model(x: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, axis: int, block: int = 0) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(x, "Wq"), numpy_helper.from_array(scale, "Ws")]
    ins = ["Wq", "Ws"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "Wz"))
        ins.append("Wz")
    attrs = {"axis": axis, **({"block_size": block} if block else {})}
    g = helper.make_graph([helper.make_node("DequantizeLinear", ins, ["W"], name="dq", **attrs),
                           helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, N])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("case", ["int8_channel", "uint8_channel_zp", "int8_tensor_zp", "uint8_blocked_zp"])
def test_qdq_int8_matches_onnxruntime(case):
    rng = np.random.default_rng(2)
    signed = case.startswith("int8")
    lo, hi, dt = (-128, 128, np.int8) if signed else (0, 256, np.uint8)
    x = rng.integers(lo, hi, size=(K, N)).astype(dt)
    if case == "int8_channel":
        m = _qdq_model(x, (rng.random(N) * 0.01 + 1e-3).astype(np.float32), None, axis=1)
    elif case == "uint8_channel_zp":
        m = _qdq_model(x, (rng.random(N) * 0.01).astype(np.float32), rng.integers(0, 256, N).astype(dt), axis=1)
    elif case == "int8_tensor_zp":
        m = _qdq_model(x, np.array(0.003, np.float32), np.array(-5, dt), axis=1)
    else:
        m = _qdq_model(x, (rng.random((K // 64, N)) * 0.01).astype(np.float32),
                       rng.integers(0, 256, (K // 64, N)).astype(dt), axis=0, block=64)
    _compare(m)


def test_qdq_that_cannot_stay_packed_still_imports():
    """Scales per row of K (axis 0 without blocks) are not per group of K: the weight is
    dequantized through the decomposition, and the answer is still onnxruntime's."""
    rng = np.random.default_rng(3)
    m = _qdq_model(rng.integers(-128, 128, (K, N)).astype(np.int8), (rng.random(K) * 0.01).astype(np.float32),
                   None, axis=0)
    x = rng.standard_normal((M, K)).astype(np.float32)
    want = _ort(m, x)
    g = import_onnx(m)
    assert Op.QMATMUL not in [n.op for n in g.nodes]
    np.testing.assert_allclose(reference.run(g, {"x": x})["y"], want, rtol=1e-5, atol=1e-6)


def _nbits(k: int = K, n: int = N, bits: int = 4, bs: int = 32, b_shape=None, s_shape=None, zp=None,
           g_idx=None) -> onnx.ModelProto:
    kb = -(-k // bs)
    b = np.zeros(b_shape or (n, kb, bs * bits // 8), np.uint8)
    s = np.ones(s_shape or (n, kb), np.float32)
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(s, "S")]
    ins = ["x", "B", "S"]
    if zp is not None or g_idx is not None:
        ins.append("Z" if zp is not None else "")
        if zp is not None:
            inits.append(numpy_helper.from_array(zp, "Z"))
    if g_idx is not None:
        ins.append("G")
        inits.append(numpy_helper.from_array(g_idx, "G"))
    node = helper.make_node("MatMulNBits", ins, ["y"], name="mmq", domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=bs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [M, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [M, n])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("model,needle", [
    (lambda: _nbits(k=200), "block_size 32 does not divide K=200"),
    (lambda: _nbits(bits=2), "bits=2 is not supported"),
    (lambda: _nbits(s_shape=(N, 3)), "scales are float32[40, 3], expected floats [40, 8] or [320]"),
    (lambda: _nbits(b_shape=(N, 8, 15)), "B is uint8[40, 8, 15], expected uint8[40, 8, 16]"),
    (lambda: _nbits(zp=np.zeros((N, 8), np.float32)), "float zero points are not supported"),
    (lambda: _nbits(g_idx=np.arange(K, dtype=np.int32)[::-1] // 32), "act-order"),
])
def test_matmul_nbits_bad_input_is_one_line(model, needle):
    with pytest.raises(ModelError) as e:
        import_onnx(model())
    msg = str(e.value)
    assert needle in msg and "'mmq' (MatMulNBits)" in msg and "\n" not in msg


def test_matmul_nbits_with_k_not_a_multiple_of_32_is_dequantized_at_import():
    rng = np.random.default_rng(4)
    k, bs = 48, 16
    b = rng.integers(0, 256, (N, k // bs, bs // 2), dtype=np.uint8)
    s = (rng.random((N, k // bs)) * 0.01).astype(np.float32)
    m = _nbits(k=k, bs=bs)
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(b, "B"))
    m.graph.initializer[1].CopyFrom(numpy_helper.from_array(s, "S"))
    x = rng.standard_normal((M, k)).astype(np.float32)
    want = _ort(m, x)
    g = import_onnx(m, {"x": (M, k)})
    assert [n.op for n in g.nodes] == [Op.MATMUL]
    np.testing.assert_allclose(reference.run(g, {"x": x})["y"], want, rtol=1e-5, atol=1e-6)
