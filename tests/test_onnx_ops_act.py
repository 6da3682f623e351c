"""Activations, hyperbolic functions and losses decomposed into IR ops, against onnxruntime.

Each case is a one-node model (fusec's import + numpy reference vs onnxruntime's CPU kernels);
``ops`` names IR ops the decomposition must use. Ops onnxruntime lacks at the tested opset
(SwiGLU, opset 28) are checked against numpy formulas written here.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_onnx_ops import C, F, _build
from test_onnx_ops import test_op_matches_onnxruntime as check_against_onnxruntime

from fusec import reference
from fusec.frontend.onnx_import import import_onnx

H = lambda *s: (s, "h")  # noqa: E731  (an fp16 run-time input)
T3 = np.array([0, 2, 1, 2], np.int64)  # targets for 4 rows of 3 classes
T3_II = np.array([0, 2, 1, 1], np.int64)  # with ignore_index=1 used twice

CASES = [
    C("LogSoftmax", "LogSoftmax", F(3, 5), opset=13, ops=("reduce_max", "exp", "log")),
    C("LogSoftmax-axis0", "LogSoftmax", F(3, 4, 5), attrs={"axis": 0}, opset=13),
    C("LogSoftmax-large", "LogSoftmax", np.array([[1000.0, 0.0, -1000.0]], np.float32), opset=13),
    C("Softplus", "Softplus", F(3, 4), ops=("log", "exp", "relu")),
    C("Softplus-large", "Softplus", np.array([-120.0, -3.0, 0.0, 3.0, 95.0], np.float32)),
    C("Softsign", "Softsign", F(3, 4)),
    C("Mish", "Mish", F(3, 4), opset=18, ops=("tanh",)),
    C("Elu", "Elu", F(3, 4), attrs={"alpha": 2.0}),
    C("Elu-fp16", "Elu", H(3, 4), out="h", tol=2e-3),
    C("Selu", "Selu", F(3, 4), attrs={"alpha": 2.0, "gamma": 3.0}),
    C("Selu-default", "Selu", F(3, 4)),
    C("Celu", "Celu", F(3, 4), attrs={"alpha": 2.0}),
    C("LeakyRelu", "LeakyRelu", F(3, 4), attrs={"alpha": 0.1}, opset=16),
    C("LeakyRelu-default", "LeakyRelu", F(3, 4), opset=16),
    C("PRelu", "PRelu", F(3, 4, 5), F(5), opset=16),
    C("PRelu-channel", "PRelu", F(2, 3, 4), np.array([[0.1], [0.5], [-2.0]], np.float32), opset=16),
    C("ThresholdedRelu", "ThresholdedRelu", F(3, 4), attrs={"alpha": 0.5}),
    C("HardSigmoid", "HardSigmoid", F(3, 4), attrs={"alpha": 0.5, "beta": 0.6}),
    C("HardSigmoid-default", "HardSigmoid", F(3, 4)),
    C("HardSwish", "HardSwish", ((3, 4), "f"), opset=14),
    C("Shrink", "Shrink", F(3, 4), attrs={"lambd": 0.7, "bias": 0.2}, opset=13),
    C("Mean-3", "Mean", F(3, 4), F(4), F(3, 1), opset=13),
    C("Mean-1", "Mean", F(3, 4), opset=13),
    C("Sinh", "Sinh", F(3, 4)),
    C("Cosh", "Cosh", F(3, 4)),
    C("Tan", "Tan", F(3, 4)),
    C("Asinh", "Asinh", F(3, 4)),
    C("Acosh", "Acosh", np.array([1.0, 1.5, 3.0, 40.0], np.float32)),
    C("Atanh", "Atanh", np.array([-0.9, -0.2, 0.0, 0.5, 0.95], np.float32)),
    C("NLL-mean", "NegativeLogLikelihoodLoss", F(4, 3), T3, opset=13, out="f",
      ops=("gather_elements", "reduce_sum")),
    C("NLL-none-weight", "NegativeLogLikelihoodLoss", F(4, 3), T3, np.array([0.2, 1.0, 3.0], np.float32),
      attrs={"reduction": "none"}, opset=13),
    C("NLL-mean-weight-ii", "NegativeLogLikelihoodLoss", F(4, 3), T3_II, np.array([0.2, 1.0, 3.0], np.float32),
      attrs={"ignore_index": 1}, opset=13),
    C("NLL-sum-3d-ii", "NegativeLogLikelihoodLoss", F(2, 3, 4), np.array([[0, 1, 2, 1], [2, 2, 1, 0]], np.int64),
      attrs={"reduction": "sum", "ignore_index": 2}, opset=13),
    C("SCE-mean", "SoftmaxCrossEntropyLoss", F(4, 3), T3, opset=13, ops=("softmax", "log")),
    C("SCE-log-prob-weight", "SoftmaxCrossEntropyLoss", F(4, 3, 2),
      np.array([[0, 1], [2, 2], [1, 0], [0, 0]], np.int64), np.array([1.0, 0.5, 2.0], np.float32),
      out=("f", "f"), opset=13),
]
# (cases with fixed values store them as initializers: the import folds them through the same
# decomposition, evaluated by the reference)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_matches_onnxruntime(case) -> None:
    check_against_onnxruntime(case)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_swiglu_matches_numpy(alpha: float) -> None:
    case = C(f"SwiGLU-{alpha}", "SwiGLU", F(2, 8), F(2, 8), attrs={"alpha": alpha}, opset=28)
    model, feeds = _build(case)
    g = import_onnx(model)
    a, b = feeds["in0"].astype(np.float64), feeds["in1"].astype(np.float64)
    want = a / (1.0 + np.exp(-alpha * a)) * b
    got = reference.run(g, feeds)["out0"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert ("silu" in g.op_histogram()) == (alpha == 1.0)


def test_float_only_activations_refuse_integers() -> None:
    from fusec.errors import ModelError

    model, _ = _build(C("Elu-int", "Elu", ((3,), "i"), out="i", opset=13))
    with pytest.raises(ModelError, match="floating-point"):
        import_onnx(model)


def test_bfloat16_input_is_a_float() -> None:
    """ml_dtypes' bfloat16 is not numpy kind 'f': it must still count as floating point."""
    import ml_dtypes

    case = C("Celu-bf16", "Celu", F(5), attrs={"alpha": 2.0}, opset=13)
    model, _ = _build(case)
    model.graph.input[0].type.tensor_type.elem_type = 16  # BFLOAT16
    model.graph.output[0].type.tensor_type.elem_type = 16
    x = np.array([-3.0, -0.5, 0.0, 0.5, 3.0], np.float32)
    got = reference.run(import_onnx(model), {"in0": x.astype(ml_dtypes.bfloat16)})["out0"]
    want = np.maximum(0, x) + np.minimum(0, 2.0 * (np.exp(x / 2.0) - 1))
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2**-7, atol=1e-2)
