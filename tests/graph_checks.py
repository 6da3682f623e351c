"""Helpers shared by the pass tests: random non-zero data and "the rewrite changed nothing"."""

from __future__ import annotations

import numpy as np

from fusec import reference
from fusec.ir import Graph, verify


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Standard normal shifted by 0.5: non-zero, both signs, fp32."""
    return (rng.standard_normal(shape) + 0.5).astype(np.float32)


def check_same(before: Graph, after: Graph, feeds: dict[str, np.ndarray]) -> None:
    """``after`` verifies and computes bit for bit what ``before`` does on ``feeds``."""
    verify(after)
    want, got = reference.run(before, feeds), reference.run(after, feeds)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def run_plan(plan, feeds: dict[str, np.ndarray]) -> dict:  # noqa: ANN001
    """``plan.run`` on ``feeds`` with float arrays cast to the plan's input dtypes (an fp16 plan
    takes fp16 inputs: fusec refuses a float32 array for them rather than convert silently)."""
    want = {i.name: i.np_dtype for i in plan.inputs}
    return plan.run({k: (np.asarray(v).astype(want[k]) if np.asarray(v).dtype.kind == "f" else v)
                     for k, v in feeds.items()})
