"""ONNX's backend node tests through fusec (fusec/conformance.py): no test crashes (every failure
is a one-line FusecError), the reference pass count stays at or above the committed floor, and a
fixed subset of the passing tests also goes through the sm_90 compile path without a crash.

The full table (both paths over every test) is ``python benchmarks/conformance.py --compile``.
"""

from __future__ import annotations

import collections
import json
import pathlib

import numpy as np
import pytest

from fusec import conformance as C

FLOOR_FILE = pathlib.Path(__file__).with_name("conformance_floor.json")
# ops whose passing (non-_expanded) tests also take the compile path here; the full compile path
# runs in the script (about 4 minutes with a cold kernel cache: too long for CI)
COMPILE_OPS = {
    "Add", "Relu", "Softmax", "Gelu", "Gemm", "Transpose", "Where", "Clip", "MatMul", "Concat", "Gather", "Slice",
    "Attention", "RotaryEmbedding", "RMSNormalization", "LayerNormalization", "GroupNormalization",
    "InstanceNormalization", "MeanVarianceNormalization", "LpNormalization", "BatchNormalization", "LRN",
    "LogSoftmax", "Softplus", "Softsign", "Mish", "Elu", "Selu", "Celu", "LeakyRelu", "PRelu", "ThresholdedRelu",
    "HardSigmoid", "HardSwish", "Shrink", "SwiGLU", "Mean", "Sinh", "Cosh", "Tan", "Asinh", "Acosh", "Atanh",
    "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss", "SpaceToDepth", "DepthToSpace",
    "LinearAttention", "ScatterElements", "TensorScatter", "ReverseSequence",
}
PER_OP = 5  # Attention alone has 90 plain tests; five of each op keep the test near a minute


@pytest.fixture(scope="module")
def cases() -> list:
    return C.load_cases()


@pytest.fixture(scope="module")
def reference_results(cases: list) -> list[C.Result]:
    ref, _ = C.run_all(cases)
    return ref


def test_no_reference_crash(reference_results: list[C.Result]) -> None:
    crashed = C.listing(reference_results, "crashed")
    assert not crashed, f"{len(crashed)} node test(s) crashed (a non-FusecError exception):\n" + "\n".join(crashed)


def test_reference_pass_floor(reference_results: list[C.Result]) -> None:
    floor = int(json.loads(FLOOR_FILE.read_text())["reference_pass"])
    got = C.counts(reference_results)
    print(f"reference: {got} of {len(reference_results)} node tests; floor {floor}")
    if got["pass"] > floor:
        print(f"the pass count rose: set reference_pass to {got['pass']} in {FLOOR_FILE}")
    assert got["pass"] >= floor, (f"reference passes {got['pass']} node tests, below the floor {floor} "
                                 f"({FLOOR_FILE.name}); run python benchmarks/conformance.py -v to see which fail")


def test_compile_path_subset(cases: list, reference_results: list[C.Result]) -> None:
    """The sm_90 compile path (passes, lowering, codegen, NVRTC; no GPU) on passing tests of
    COMPILE_OPS: no crash, and at least the committed number compile."""
    ops = C.op_names(cases)
    passing = {r.name for r in reference_results if r.status == "pass"}
    chosen, per_op = [], collections.Counter()
    for c in cases:  # the first PER_OP passing plain tests of each op, in the loader's order
        op = ops[c.name]
        if c.name in passing and op in COMPILE_OPS and "_expanded" not in c.name and per_op[op] < PER_OP:
            chosen.append(c)
            per_op[op] += 1
    results = [C.compile_case(c, ops[c.name]) for c in chosen]
    crashed = C.listing(results, "crashed")
    assert not crashed, "compile path crashed:\n" + "\n".join(crashed)
    floor = int(json.loads(FLOOR_FILE.read_text())["compile_subset_pass"])
    got = C.counts(results)["pass"]
    print(f"compile path: {got} of {len(chosen)} pass; floor {floor}")
    if got > floor:
        print(f"the compile pass count rose: set compile_subset_pass to {got} in {FLOOR_FILE}")
    assert got >= floor, "compile-path refusals:\n" + "\n".join(C.listing(results, "refused"))


def test_compare_rules() -> None:
    """The comparison the table rests on: dtype, shape, then allclose; a numpy scalar is a 0-d
    tensor; bf16 gets two ulps of relative slack, like ONNX's own runner."""
    e = np.array([1.0, 2.0], np.float32)
    assert C.compare("y", e, e.copy(), 1e-3, 1e-7) == ""
    assert "dtype" in C.compare("y", e, e.astype(np.float64), 1e-3, 1e-7)
    assert "shape" in C.compare("y", e, e[:1], 1e-3, 1e-7)
    assert "1 of 2 elements differ" in C.compare("y", e, np.array([1.0, 2.1], np.float32), 1e-3, 1e-7)
    assert C.compare("y", np.float32(3.0), np.array(3.0, np.float32), 1e-3, 1e-7) == ""
    assert "1 of 2" in C.compare("y", np.array([1, 2]), np.array([1, 3]), 1e-3, 1e-7)
    nan = np.array([np.nan], np.float32)
    assert C.compare("y", nan, nan.copy(), 1e-3, 1e-7) == ""


def test_classification() -> None:
    """A FusecError is a refusal, any other exception a crash, a mismatch is wrong."""
    from fusec.errors import ModelError

    def refuse() -> str:
        raise ModelError("m: node 'n' (Foo): no")

    def crash() -> str:
        raise KeyError("k")

    assert C._guarded("t", "Foo", refuse).status == "refused"
    r = C._guarded("t", "Foo", crash)
    assert r.status == "crashed" and "KeyError" in r.reason
    assert C._guarded("t", "Foo", lambda: "output differs").status == "wrong"
    assert C._guarded("t", "Foo", lambda: "").status == "pass"
    assert C.reason_group("m.onnx: node 'a1' (Foo): input 3 ('x') is bad") == C.reason_group(
        "n.onnx: node 'b2' (Foo): input 4 ('y') is bad")


def test_inputs_take_tensor_protos_and_give_shapes_only_where_the_model_leaves_them_open() -> None:
    import ml_dtypes
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "g",
                              [helper.make_tensor_value_info("a", TensorProto.BFLOAT16, [2]),
                               helper.make_tensor_value_info("b", TensorProto.BFLOAT16, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2])])
    a = np.array([1.0, 2.0], ml_dtypes.bfloat16)
    case = type("Case", (), {"model": helper.make_model(graph), "data_sets": [([onnx.numpy_helper.from_array(a), a],
                                                                              [])]})
    feeds, shapes = C._inputs(case)
    assert feeds["a"].dtype == ml_dtypes.bfloat16 and list(feeds["a"]) == list(a)
    assert shapes == {"b": (2,)}


def test_binding_a_shape_input_turns_its_refusal_into_a_run() -> None:
    """reference_case(bind_shape_inputs=True): the Reshape target given as a graph input is refused
    (it decides a shape), then bound to the test's value and run; the data input stays an input."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                               helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    from onnx.backend.test.case.test_case import TestCase

    case = TestCase(name="t", model_name="t", url=None, model_dir=None,
                    model=helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
                    data_sets=[([x, np.array([3, 2], np.int64)], [x.reshape(3, 2)])], kind="node", rtol=1e-6, atol=0)
    plain = C.reference_case(case, "Reshape")
    assert plain.status == "refused" and "depends on run-time data" in plain.reason
    assert C.reference_case(case, "Reshape", bind_shape_inputs=True).status == "pass"
    (again,) = C.run_bound([case], [plain])
    assert again.status == "pass"
    assert [vi.name for vi in C.bind_inputs(case, ["shape"]).model.graph.input] == ["x"]
