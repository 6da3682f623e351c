"""fusec.debug's bisect verdict on the CPU (fake executor): the verdict's counts."""

from __future__ import annotations

import numpy as np

from fusec.debug import compare_launches, launch_map, reference_values
from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value
from fusec.ops import NoAttrs, Op


def _one_node(gpu_y: np.ndarray, x: np.ndarray):
    xv, yv = Value("x", (4,), DType.F32), Value("y", (4,), DType.F32)
    g = Graph([xv], [yv], [Node(Op.NEG, [xv], [yv], NoAttrs())], [])
    slots = launch_map(g, [{"label": "#0 neg"}], {"x": 0, "y": 256})
    ref = reference_values(g, {"x": x})
    return compare_launches(g, slots, ref, {"x": x}, lambda after: after(0), lambda addr, v: gpu_y, 1e-4, 1e-4)


def test_the_verdict_counts_the_new_non_finite_elements_not_a_difference_of_totals() -> None:
    x = np.array([1.0, np.inf, np.inf, 2.0], np.float32)
    gpu_y = np.array([np.nan, -5.0, -5.0, -2.0], np.float32)  # one new NaN; the reference's two -inf came out finite
    report = _one_node(gpu_y, x)
    row = report.rows[report.first]
    assert row.status == "NONFINITE" and row.nonfinite == 1 and row.ref_nonfinite == 2
    assert "value 'y': 1 non-finite elements where the reference is finite" in report.verdict()
    assert report.to_json()["launches"][0]["new_nonfinite"] == 1


def test_a_clean_launch_is_ok_and_counted() -> None:
    x = np.array([1.0, -0.0, 3.0, 2.0], np.float32)
    report = _one_node(-x, x)
    assert not report.diverged and report.rows[0].status == "ok"
    assert report.verdict().startswith("no divergence: 1 of 1 launches")
