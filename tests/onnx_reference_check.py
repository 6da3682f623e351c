"""Shared by the ONNX op tests: fusec's import + numpy reference against ONNX's own reference
evaluator (onnx.reference), for ops onnxruntime lacks at the tested opset."""

from __future__ import annotations

import numpy as np
from onnx.reference import ReferenceEvaluator

from fusec import reference
from fusec.frontend.onnx_import import import_onnx


def check_against_onnx_reference(model, feeds, ops=(), tol: float = 1e-5, label: str = "") -> None:
    g = import_onnx(model)
    for op in ops:
        assert op in g.op_histogram(), f"{label}: expected IR op {op!r} in {g.op_histogram()}"
    got = reference.run(g, feeds)
    want = ReferenceEvaluator(model).run(None, feeds)
    for (name, r), w in zip(got.items(), want):
        assert not np.isnan(r).any() or np.isnan(w).any(), f"{label}/{name}: NaN in fusec's result"
        np.testing.assert_allclose(r, w, rtol=tol, atol=tol, err_msg=f"{label}/{name}")
