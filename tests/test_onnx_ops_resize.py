"""Resize with constant scales/sizes (per-axis weight matrices / gathers), against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from test_onnx_ops import C, F, _build
from test_onnx_ops import test_op_matches_onnxruntime as check_against_onnxruntime

from fusec.errors import ModelError
from fusec.frontend.onnx_import import import_onnx

S = lambda *v: np.array(v, np.float32)  # noqa: E731
I64 = lambda *v: np.array(v, np.int64)  # noqa: E731
EMPTY = np.zeros(0, np.float32)

CASES = [
    C("nearest-up", "Resize", F(1, 2, 3, 4), EMPTY, S(1, 1, 2, 1.5), opset=19, ops=("gather",)),
    C("nearest-down-ceil-asym", "Resize", F(1, 1, 5, 6), EMPTY, S(1, 1, 0.6, 0.5),
      attrs={"coordinate_transformation_mode": "asymmetric", "nearest_mode": "ceil"}, opset=19),
    C("linear-up", "Resize", F(2, 3, 4, 4), EMPTY, S(1, 1, 2, 2), attrs={"mode": "linear"}, opset=19,
      ops=("matmul",)),
    C("linear-sizes-align", "Resize", F(1, 1, 4, 5), None, None, I64(1, 1, 7, 3),
      attrs={"mode": "linear", "coordinate_transformation_mode": "align_corners"}, opset=19),
    C("cubic-down-antialias", "Resize", F(1, 1, 8, 8), EMPTY, S(1, 1, 0.5, 0.75),
      attrs={"mode": "cubic", "antialias": 1}, opset=19),
    C("cubic-exclude-outside", "Resize", F(1, 1, 4, 4), EMPTY, S(1, 1, 1.5, 2),
      attrs={"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1}, opset=19),
    C("linear-pytorch-half-pixel-axes", "Resize", F(2, 6, 5), EMPTY, S(0.5, 1.5), attrs={
        "mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel", "axes": [1, 2]}, opset=19),
    C("tf-crop-and-resize", "Resize", F(1, 1, 4, 4), S(0, 0, 0.4, 0.6, 1, 1, 1.2, 0.7), None, I64(1, 1, 3, 3),
      attrs={"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 9.0},
      opset=19),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_resize_matches_onnxruntime(case) -> None:
    check_against_onnxruntime(case)


def test_run_time_scales_are_refused_in_one_line() -> None:
    model, _ = _build(C("rt-scales", "Resize", F(1, 1, 2, 2), EMPTY, ((4,), "f"), opset=19))
    with pytest.raises(ModelError, match="depends on run-time data") as e:
        import_onnx(model)
    assert "\n" not in str(e.value)
