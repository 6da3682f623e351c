"""The A/B decision rule and the numerical gate (pure functions: the CPU tests drive them).

Numerics first: the fused variant's outputs are compared with the unfused variant's on the same
random non-zero inputs by ``||fused - unfused|| / ||unfused||`` over all outputs; NaN or Inf
anywhere in the fused output (where the unfused one is finite), or an error above the dtype's
tolerance (DESIGN §8), rejects the fused variant whatever its speed.

Then time. Each side is a distribution of per-request latencies (median, p10, p90). The fused
variant is accepted only when its median is lower than the unfused median by more than

- the noise band: the larger of the two p90 - p10 spreads, and
- ``MARGIN`` (3%) of the unfused median: a gain the next driver or clock state could erase is
  not worth a more complex kernel (and a per-region gain must survive the whole-plan check).

Anything else (slower, within noise, or below the margin) keeps the simpler unfused form.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

MARGIN = 0.03
TOLERANCE = {"fp32": 1e-5, "tf32": 1e-3, "fp16": 2e-3, "bf16": 1e-2}

FUSED, UNFUSED, NOT_MEASURED = "fused", "unfused", "not measured"


def rel_error(fused: Mapping[str, np.ndarray], unfused: Mapping[str, np.ndarray]) -> float:
    """``||fused - unfused|| / ||unfused||`` over every output (fp64); inf when the outputs differ
    in names or shapes or the fused side has a NaN/Inf the unfused side does not."""
    if set(fused) != set(unfused):
        return math.inf
    num = den = 0.0
    for name, b in unfused.items():
        a = np.asarray(fused[name], dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            return math.inf
        bad_a, bad_b = ~np.isfinite(a), ~np.isfinite(b)
        if np.any(bad_a != bad_b) or np.any(a[bad_a] != b[bad_b]):
            return math.inf  # NaN never equals NaN: a NaN on either side fails too
        a, b = a[~bad_a], b[~bad_b]
        num += float(np.sum((a - b) ** 2))
        den += float(np.sum(b ** 2))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


def decide(fused: Mapping[str, Any] | None, unfused: Mapping[str, Any] | None, error: float | None, tolerance: float,
           margin: float = MARGIN, failure: str | None = None) -> tuple[str, str]:
    """(decision, reason): FUSED when the fused variant is correct and faster beyond noise and
    margin, else UNFUSED. ``fused``/``unfused``: {"median_ms", "p10_ms", "p90_ms"}; ``failure``: why
    the fused variant could not be built or run (rejects it)."""
    if failure is not None:
        return UNFUSED, f"fused variant failed: {failure}"
    if error is None or not math.isfinite(error) or error > tolerance:
        shown = "NaN/Inf or mismatched outputs" if error is None or not math.isfinite(error) else f"{error:.3g}"
        return UNFUSED, f"numerics: error {shown} > tolerance {tolerance:g}; rejected whatever its speed"
    if fused is None or unfused is None:
        return UNFUSED, "not timed"
    f, u = float(fused["median_ms"]), float(unfused["median_ms"])
    spread = max(float(fused["p90_ms"]) - float(fused["p10_ms"]), float(unfused["p90_ms"]) - float(unfused["p10_ms"]))
    gain = u - f
    pct = 100.0 * gain / u if u > 0 else 0.0
    if gain < 0:
        return UNFUSED, f"fused slower: {f:.4f} ms vs {u:.4f} ms ({-pct:.1f}% slower)"
    if gain <= spread:
        return UNFUSED, f"within noise: gain {gain:.4f} ms <= spread {spread:.4f} ms; keep the simpler form"
    if gain <= margin * u:
        return UNFUSED, f"below margin: gain {pct:.1f}% <= {100 * margin:.0f}%; keep the simpler form"
    return FUSED, f"fused faster by {gain:.4f} ms ({pct:.1f}%) > spread {spread:.4f} ms and margin {100 * margin:.0f}%"
