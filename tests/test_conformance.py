"""ONNX's backend node tests through fusec (fusec/conformance.py): no test crashes (every failure
is a one-line FusecError), the reference pass count stays at or above the committed floor, and a
fixed subset of the passing tests also goes through the sm_90 compile path without a crash.

The full table (both paths over every test) is ``python benchmarks/conformance.py --compile``.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from fusec import conformance as C

FLOOR_FILE = pathlib.Path(__file__).with_name("conformance_floor.json")
# ops whose passing tests also take the compile path here (the full compile path runs in the script)
COMPILE_OPS = {"Add", "Relu", "Softmax", "Gelu", "LayerNormalization", "Gemm", "Transpose", "Where",
               "ReduceMean", "LogSoftmax", "Softplus", "Elu", "HardSwish", "Mish", "LeakyRelu", "Clip",
               "RMSNormalization", "GroupNormalization", "Selu", "HardSigmoid"}


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
    ops = C.op_names(cases)
    passing = {r.name for r in reference_results if r.status == "pass"}
    chosen = [c for c in cases if c.name in passing and ops[c.name] in COMPILE_OPS]
    assert len(chosen) >= 20, f"only {len(chosen)} passing tests of {sorted(COMPILE_OPS)}"
    results = [C.compile_case(c, ops[c.name]) for c in chosen]
    crashed = C.listing(results, "crashed")
    assert not crashed, "compile path crashed:\n" + "\n".join(crashed)
    assert C.counts(results)["pass"] >= len(chosen) // 2, C.listing(results, "refused")


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
