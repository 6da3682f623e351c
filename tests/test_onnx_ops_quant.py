"""QuantizeLinear / DequantizeLinear (8/16-bit) decomposed into IR ops, against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from test_onnx_ops import C, F
from test_onnx_ops import test_op_matches_onnxruntime as check_against_onnxruntime

from fusec.errors import ModelError
from fusec.frontend.onnx_import import import_onnx

U8 = lambda *v: np.array(v, np.uint8)  # noqa: E731
S = lambda *v: np.array(v, np.float32)  # noqa: E731

CASES = [
    C("Q-scalar-u8", "QuantizeLinear", F(3, 4), S(0.02), U8(128), opset=21, out="u8", ops=("round", "cast")),
    C("Q-int8-ties", "QuantizeLinear", np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 300.0, -300.0], np.float32),
      S(1.0), np.array(0, np.int8), opset=21, out="i8"),
    C("Q-axis", "QuantizeLinear", F(2, 3, 4), S(0.01, 0.05, 0.1), U8(0, 10, 250), attrs={"axis": 1}, opset=21,
      out="u8"),
    C("Q-blocked", "QuantizeLinear", F(3, 4), np.full((3, 2), 0.03, np.float32), np.full((3, 2), 7, np.uint8),
      attrs={"axis": 1, "block_size": 2}, opset=21, out="u8"),
    C("Q-int16-default-zp", "QuantizeLinear", F(6), S(0.001), np.array(0, np.int16), opset=21, out="i16"),
    C("DQ-scalar", "DequantizeLinear", ((3, 4), "u8"), S(0.5), U8(3), opset=21),
    C("DQ-axis-int8", "DequantizeLinear", ((2, 3), "i8"), S(0.5, 2.0), np.array([1, -2], np.int8),
      attrs={"axis": 0}, opset=21, ops=("sub", "mul")),
    C("DQ-blocked", "DequantizeLinear", ((2, 4), "u8"), np.array([[0.5, 2.0], [1.0, 4.0]], np.float32),
      np.array([[1, 2], [3, 4]], np.uint8), attrs={"axis": 1, "block_size": 2}, opset=21),
    C("DQ-no-zp-fp16-scale", "DequantizeLinear", ((5,), "u8"), np.array(0.25, np.float16), opset=21, out="h"),
]


def _with_int_kinds():
    """test_onnx_ops' random data and output kinds, plus the 8/16-bit integers used here."""
    import test_onnx_ops as T
    from onnx import TensorProto

    T._ELEM.update({"u8": TensorProto.UINT8, "i8": TensorProto.INT8, "i16": TensorProto.INT16})
    real = T._data

    def data(kind: str, shape: tuple[int, ...]) -> np.ndarray:
        if kind in ("u8", "i8"):
            lo, hi, dt = (0, 256, np.uint8) if kind == "u8" else (-128, 128, np.int8)
            return T.rng.integers(lo, hi, shape).astype(dt)
        return real(kind, shape)

    return data


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_matches_onnxruntime(case, monkeypatch) -> None:
    import test_onnx_ops as T

    monkeypatch.setattr(T, "_data", _with_int_kinds())
    check_against_onnxruntime(case)


def test_float8_is_refused_in_one_line() -> None:
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("QuantizeLinear", ["x", "s"], ["y"], output_dtype=TensorProto.FLOAT8E4M3FN)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT8E4M3FN, [4])],
                              [numpy_helper.from_array(S(1.0), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    with pytest.raises(ModelError, match="quantizing to float8_e4m3fn is not supported") as e:
        import_onnx(model)
    assert "\n" not in str(e.value)
