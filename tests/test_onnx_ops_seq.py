"""OneHot, CumProd and the window functions on IR ops, against onnxruntime or numpy."""

from __future__ import annotations

import numpy as np
import pytest
from test_onnx_ops import C, F, _build
from test_onnx_ops import test_op_matches_onnxruntime as check_against_onnxruntime

from fusec import reference
from fusec.frontend.onnx_import import import_onnx

I64 = lambda *v: np.array(v, np.int64)  # noqa: E731

CASES = [
    C("OneHot", "OneHot", ((2, 3), "i"), I64(5), np.array([0.0, 2.5], np.float32), opset=13, ops=("equal", "where")),
    C("OneHot-axis0-neg", "OneHot", ((3,), "i"), np.array(4, np.int64), np.array([-1.0, 1.0], np.float32),
      attrs={"axis": 0}, opset=13),
    C("HannWindow", "HannWindow", np.array(8, np.int64), opset=17),
    C("HammingWindow-symmetric", "HammingWindow", np.array(7, np.int64), attrs={"periodic": 0}, opset=17),
    C("BlackmanWindow", "BlackmanWindow", np.array(10, np.int64), opset=17),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_matches_onnxruntime(case) -> None:
    check_against_onnxruntime(case)


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cum_prod_matches_numpy(exclusive: int, reverse: int) -> None:
    model, feeds = _build(C("CumProd", "CumProd", F(3, 4), np.array(1, np.int64),
                            attrs={"exclusive": exclusive, "reverse": reverse}, opset=26))
    x = feeds["in0"]
    y = x[:, ::-1] if reverse else x
    want = np.cumprod(y, axis=1)
    if exclusive:
        want = np.concatenate([np.ones((3, 1), np.float32), want[:, :-1]], axis=1)
    want = want[:, ::-1] if reverse else want
    g = import_onnx(model)
    assert "mul" in g.op_histogram()
    np.testing.assert_allclose(reference.run(g, feeds)["out0"], want, rtol=1e-6)
