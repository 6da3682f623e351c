"""A graph output that is also a graph input (valid ONNX) on the GPU: the plan hands the input
back under its own name, next to the computed outputs."""

from __future__ import annotations

import numpy as np
import pytest
from hostile_helpers import model, save, vi
from onnx import helper

import fusec

pytestmark = pytest.mark.gpu


def test_a_passthrough_output_comes_back_as_given(tmp_path):
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2, 4])], [vi("y", [2, 4]), vi("x", [2, 4])])
    plan = fusec.compile(str(save(m, tmp_path / "p.onnx")), dtype="fp32")
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    out = plan.run({"x": x})
    np.testing.assert_array_equal(out["x"].get(), x)
    np.testing.assert_array_equal(out["y"].get(), np.maximum(x, 0))
