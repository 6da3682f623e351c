"""Normalizations and reductions decomposed into IR ops, against onnxruntime (and ONNX's reference
evaluator for what onnxruntime lacks at the tested opset)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_reference_check import check_against_onnx_reference
from test_onnx_ops import C, F, _build
from test_onnx_ops import test_op_matches_onnxruntime as check_against_onnxruntime

from fusec import reference
from fusec.frontend.onnx_import import import_onnx

rng = np.random.default_rng(5)
P = lambda *s: rng.uniform(0.5, 1.5, s).astype(np.float32)  # noqa: E731  (a positive parameter)

ORT_CASES = [
    C("LayerNorm-stats", "LayerNormalization", F(2, 3, 8), F(8), F(8), out=("f", "f", "f"), opset=17,
      ops=("reduce_mean", "sqrt")),
    C("LayerNorm-stats-axis1", "LayerNormalization", F(2, 3, 4), F(3, 4), attrs={"axis": 1, "epsilon": 0.1},
      out=("f", "f", "f"), opset=17),
    C("InstanceNorm", "InstanceNormalization", F(2, 3, 4, 5), P(3), F(3), ops=("reduce_mean",)),
    C("MVN", "MeanVarianceNormalization", F(3, 2, 4, 1), attrs={"axes": [0, 2, 3]}, opset=13),
    C("MVN-axes", "MeanVarianceNormalization", F(3, 2, 4), attrs={"axes": [1, 2]}, opset=13),
    C("LpNorm-l2", "LpNormalization", F(2, 3, 4), attrs={"axis": 1}),
    C("LpNorm-l1-zero-row", "LpNormalization", np.array([[0.0, 0.0], [1.0, -3.0]], np.float32), attrs={"p": 1}),
    C("BatchNorm", "BatchNormalization", F(2, 3, 4, 5), P(3), F(3), F(3), P(3), attrs={"epsilon": 1e-2}, opset=15),
    C("LRN", "LRN", F(2, 5, 3, 3), attrs={"size": 3, "alpha": 2e-4, "beta": 0.5, "bias": 2.0}, opset=13,
      ops=("matmul", "pow")),
    C("ReduceL1", "ReduceL1", F(2, 3, 4), np.array([1], np.int64), ops=("abs", "reduce_sum")),
    C("ReduceL2", "ReduceL2", F(2, 3, 4), np.array([0, 2], np.int64), attrs={"keepdims": 0}),
    C("ReduceSumSquare-13", "ReduceSumSquare", F(2, 3, 4), attrs={"axes": [-1]}, opset=13),
    C("ReduceLogSum", "ReduceLogSum", ((2, 3, 4), "pos"), np.array([1], np.int64)),
    C("ReduceLogSumExp", "ReduceLogSumExp", F(2, 3, 4), np.array([2], np.int64), attrs={"keepdims": 0}),
    C("ReduceLogSumExp-all", "ReduceLogSumExp", F(2, 3)),
    C("ReduceL2-noop", "ReduceL2", F(2, 3), attrs={"noop_with_empty_axes": 1}),
]


@pytest.mark.parametrize("case", ORT_CASES, ids=[c.id for c in ORT_CASES])
def test_op_matches_onnxruntime(case) -> None:
    check_against_onnxruntime(case)


def _built(case):
    """_build, with output shapes ONNX's shape inference leaves open (function ops) filled in:
    Y like input 0, other outputs [C]."""
    model, feeds = _build(case)
    x = model.graph.input[0].type.tensor_type.shape.dim
    for i, out in enumerate(model.graph.output):
        tt = out.type.tensor_type
        if not tt.HasField("shape"):
            dims = [d.dim_value for d in x] if i == 0 else [x[1].dim_value]
            for d in dims:
                tt.shape.dim.add().dim_value = d
    return model, feeds


REF_CASES = [
    C("RMSNorm-last-axis", "RMSNormalization", F(2, 3, 8), P(8), opset=23, ops=("rmsnorm",)),
    C("RMSNorm-two-axes", "RMSNormalization", F(2, 3, 8), P(3, 8), attrs={"axis": 1, "epsilon": 0.1}, opset=23,
      ops=("reduce_mean",)),
    C("GroupNorm-21", "GroupNormalization", F(3, 4, 2, 2), P(4), F(4), attrs={"num_groups": 2}, opset=21),
    C("BatchNorm-training", "BatchNormalization", F(2, 3, 4), P(3), F(3), F(3), P(3),
      attrs={"training_mode": 1, "momentum": 0.8}, out=("f", "f", "f"), opset=15),
]


@pytest.mark.parametrize("case", REF_CASES, ids=[c.id for c in REF_CASES])
def test_op_matches_onnx_reference(case) -> None:
    model, feeds = _built(case)
    check_against_onnx_reference(model, feeds, case.ops, label=case.id)


def test_group_norm_refuses_groups_that_do_not_divide_channels() -> None:
    from fusec.errors import ModelError

    model, _ = _built(C("GroupNorm-bad", "GroupNormalization", F(2, 6, 3), P(6), F(6), attrs={"num_groups": 4},
                        opset=21))
    with pytest.raises(ModelError, match="divisible by num_groups"):
        import_onnx(model)


def test_lrn_even_size_matches_the_spec() -> None:
    """onnxruntime takes odd sizes only (and ONNX's reference loops over the batch, not the
    channels): the window of the spec, written out in numpy, is the oracle."""
    case = C("LRN-even-size", "LRN", F(2, 6, 2, 3), attrs={"size": 4, "alpha": 0.5, "beta": 0.75, "bias": 1.5},
             opset=13)
    model, feeds = _build(case)
    x = feeds["in0"].astype(np.float64)
    sq = np.zeros_like(x)
    for ch in range(x.shape[1]):  # window [c - floor((size-1)/2), c + ceil((size-1)/2)]
        sq[:, ch] = (x[:, max(0, ch - 1):min(x.shape[1], ch + 3)] ** 2).sum(axis=1)
    want = x / (1.5 + 0.5 / 4 * sq) ** 0.75
    got = reference.run(import_onnx(model), feeds)["out0"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
