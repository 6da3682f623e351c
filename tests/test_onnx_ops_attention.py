"""ONNX Attention (opsets 23-25) against onnxruntime and ONNX's own reference evaluator.

The common form must import as one IR ``attention`` node (the op the GPU runs fused); the rest
(softcap, present/qk outputs, sliding windows, key padding) decomposes into primitive IR ops.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx_reference_check import check_against_onnx_reference
from test_onnx_ops import C, F, _build
from test_onnx_ops import test_op_matches_onnxruntime as check_against_onnxruntime

from fusec.frontend.onnx_import import import_onnx

MASK_BOOL = np.array([[1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 0, 1]], bool)
PAST = (None, F(2, 3, 3, 8), F(2, 3, 3, 8))

ORT_CASES = [
    C("plain-4d", "Attention", F(2, 3, 4, 8), F(2, 3, 6, 8), F(2, 3, 6, 8), opset=23, ops=("attention",)),
    C("causal-gqa-s-ne-t", "Attention", F(2, 6, 4, 8), F(2, 2, 6, 8), F(2, 2, 6, 8), attrs={"is_causal": 1},
      opset=23, ops=("attention",)),
    C("causal-square", "Attention", F(1, 2, 5, 8), F(1, 2, 5, 8), F(1, 2, 5, 8), attrs={"is_causal": 1},
      opset=23, ops=("attention",)),
    C("3d-diff-v-dim", "Attention", F(2, 4, 24), F(2, 6, 24), F(2, 6, 30),
      attrs={"q_num_heads": 3, "kv_num_heads": 3}, opset=23, ops=("attention",)),
    C("3d-gqa-scaled", "Attention", F(2, 4, 72), F(2, 6, 24), F(2, 6, 24),
      attrs={"q_num_heads": 9, "kv_num_heads": 3, "scale": 0.1}, opset=23, ops=("attention",)),
    C("float-mask-causal", "Attention", F(2, 3, 4, 8), F(2, 3, 6, 8), F(2, 3, 6, 8), F(2, 1, 4, 6),
      attrs={"is_causal": 1}, opset=23, ops=("attention",)),
    C("bool-mask", "Attention", F(2, 3, 4, 8), F(2, 3, 6, 8), F(2, 3, 6, 8),
      MASK_BOOL[:, :6] | np.eye(4, 6, dtype=bool), opset=23, ops=("attention",)),
    C("softcap", "Attention", F(2, 3, 4, 8), F(2, 3, 6, 8), F(2, 3, 6, 8), attrs={"softcap": 2.0}, opset=23,
      ops=("attention",)),
    C("softcap-mask-causal-gqa", "Attention", F(2, 6, 4, 8), F(2, 2, 6, 8), F(2, 2, 6, 8), F(2, 1, 4, 6),
      attrs={"softcap": 0.5, "is_causal": 1, "scale": 2.0}, opset=23, ops=("attention",)),  # cap, then the masks
    C("past-present-causal", "Attention", F(2, 3, 4, 8), F(2, 3, 4, 8), F(2, 3, 4, 8), *PAST,
      attrs={"is_causal": 1}, out=("f", "f", "f"), opset=23, ops=("concat", "softmax")),
    C("past-qk-bias", "Attention", F(2, 3, 4, 8), F(2, 3, 4, 8), F(2, 3, 4, 8), F(4, 7), F(2, 3, 3, 8),
      F(2, 3, 3, 8), attrs={"qk_matmul_output_mode": 2}, out=("f", "f", "f", "f"), opset=23),
    C("fp16", "Attention", ((2, 3, 4, 8), "h"), ((2, 3, 6, 8), "h"), ((2, 3, 6, 8), "h"), out="h", opset=23,
      tol=1e-2),
]


@pytest.mark.parametrize("case", ORT_CASES, ids=[c.id for c in ORT_CASES])
def test_attention_matches_onnxruntime(case) -> None:
    check_against_onnxruntime(case)


def _rng_feeds(model, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


ONNX_REF_CASES = [
    # a fully masked row (row 1 of MASK_BOOL): ONNX specifies zeros, not NaN
    C("bool-mask-dead-row", "Attention", F(1, 2, 4, 8), F(1, 2, 6, 8), F(1, 2, 6, 8), MASK_BOOL, opset=23,
      ops=("attention",)),
    C("dead-row-mode3", "Attention", F(1, 2, 4, 8), F(1, 2, 6, 8), F(1, 2, 6, 8), MASK_BOOL, None, None, None,
      attrs={"qk_matmul_output_mode": 3}, opset=24),
    C("window-causal", "Attention", F(2, 3, 4, 8), F(2, 3, 6, 8), F(2, 3, 6, 8),
      attrs={"is_causal": 1, "left_window_size": 2}, opset=25),
    C("window-bidirectional", "Attention", F(1, 1, 5, 4), F(1, 1, 5, 4), F(1, 1, 5, 4),
      attrs={"left_window_size": 1, "right_window_size": 2}, opset=25),
    C("nonpad-causal-decode", "Attention", F(2, 4, 1, 8), F(2, 2, 8, 8), F(2, 2, 8, 8), None, None, None,
      np.array([3, 8], np.int64), attrs={"is_causal": 1}, opset=24),
]


@pytest.mark.parametrize("case", ONNX_REF_CASES, ids=[c.id for c in ONNX_REF_CASES])
def test_attention_matches_onnx_reference(case) -> None:
    model, _ = _build(case)
    if case.id == "dead-row-mode3":  # only Y and qk_matmul_output
        node = model.graph.node[0]
        node.output[:] = ["out0", "", "", "out3"]
        del model.graph.output[1:]
        model.graph.output.add().CopyFrom(model.graph.output[0])
        model.graph.output[1].name = "out3"
        dims = model.graph.output[1].type.tensor_type.shape.dim
        for d, n in zip(dims, (1, 2, 4, 6)):
            d.dim_value = n
    check_against_onnx_reference(model, _rng_feeds(model, 7), case.ops, tol=1e-5, label=case.id)


def test_plain_attention_is_one_ir_node_and_decomposed_forms_are_not() -> None:
    plain = import_onnx(_build(ORT_CASES[0])[0]).op_histogram()
    assert plain.get("attention") == 1 and "softmax" not in plain, plain
    by_id = {c.id: c for c in ORT_CASES}
    g = import_onnx(_build(by_id["softcap"])[0])
    assert g.op_histogram() == {"attention": 1} and [n.attrs.softcap for n in g.nodes] == [2.0]
    present = import_onnx(_build(by_id["past-present-causal"])[0]).op_histogram()
    assert "attention" not in present and present.get("matmul") == 2, present


def test_attention_refusals_are_one_line() -> None:
    from fusec.errors import ModelError

    bad = C("bad-heads", "Attention", F(2, 4, 20), F(2, 6, 24), F(2, 6, 24),
            attrs={"q_num_heads": 3, "kv_num_heads": 3}, opset=23)
    model = _build_unchecked(bad)
    with pytest.raises(ModelError, match="head count") as e:
        import_onnx(model)
    assert "\n" not in str(e.value)


def _build_unchecked(case):
    from onnx import TensorProto, helper

    names = [f"in{i}" for i in range(len(case.ins))]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, (s, _) in zip(names, case.ins)]
    node = helper.make_node(case.op, names, ["out0"], name="n", **case.attrs)
    out = helper.make_tensor_value_info("out0", TensorProto.FLOAT, [2, 4, 24])
    graph = helper.make_graph([node], "g", inputs, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)], ir_version=10)


LINEAR_CASES = [
    C("linear", "LinearAttention", F(2, 3, 8), F(2, 3, 8), F(2, 3, 8),
      attrs={"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "linear"}, out=("f", "f"), opset=27),
    C("gated-per-dim", "LinearAttention", F(2, 3, 8), F(2, 3, 8), F(2, 3, 8), None, F(2, 3, 8),
      attrs={"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "gated"}, out=("f", "f"), opset=27),
    C("delta", "LinearAttention", F(1, 4, 8), F(1, 4, 8), F(1, 4, 6), None, None, F(1, 4, 2),
      attrs={"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "delta"}, out=("f", "f"), opset=27),
    C("gated-delta-gqa-past", "LinearAttention", F(2, 3, 16), F(2, 3, 4), F(2, 3, 4), F(2, 1, 4, 4), F(2, 3, 1),
      F(2, 3, 1), attrs={"q_num_heads": 4, "kv_num_heads": 1, "scale": 0.3}, out=("f", "f"), opset=27,
      ops=("matmul", "exp")),
]


@pytest.mark.parametrize("case", LINEAR_CASES, ids=[c.id for c in LINEAR_CASES])
def test_linear_attention_matches_onnx_reference(case) -> None:
    model, _ = _build(case)
    check_against_onnx_reference(model, _rng_feeds(model, 11), case.ops, tol=1e-4, label=case.id)
