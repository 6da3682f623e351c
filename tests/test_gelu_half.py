"""The half-precision erf-GELU's polynomial (templates/common.cuh, ``fc_gelu_erf16``), checked on the CPU: its
coefficients are read from the template and evaluated in float32 as the device does (fmaf steps; exp2 exact where the
device's ex2.approx is within 2^-22), against float64's erfc. The GPU test (tests/test_kernels_gpu.py) runs the kernel."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from fusec import ops as O
from fusec.codegen import specs as S
from fusec.codegen.elementwise import Apply, In
from fusec.codegen.kernels import prepare
from fusec.dtypes import DType

CUH = Path(__file__).resolve().parent.parent / "templates" / "common.cuh"


def _coefficients() -> list[float]:
    """P's coefficients, highest degree first, as the template's Horner steps hold them."""
    body = CUH.read_text().split("fc_gelu_erf16(float x) {", 1)[1].split("\n}", 1)[0]
    first = re.search(r"float p = ([-+0-9.e]+)f;", body)
    assert first, "fc_gelu_erf16 starts its polynomial with `float p = <c>f;`"
    rest = re.findall(r"p = fmaf\(p, u, ([-+0-9.e]+)f\);", body)
    return [float(first.group(1))] + [float(c) for c in rest]


def _device_gelu(x: np.ndarray) -> np.ndarray:
    f32 = np.float32
    t = (np.abs(x.astype(f32)) * f32(0.7071067811865476)).astype(f32)
    u = np.minimum(t, f32(4.0))
    cs = _coefficients()
    p = np.full_like(u, f32(cs[0]))
    for c in cs[1:]:
        p = (p.astype(np.float64) * u + f32(c)).astype(f32)  # fmaf: one rounding of the exact product-sum
    e = np.exp2((p * u).astype(f32).astype(np.float64)).astype(f32)
    e = np.where(t < 4.0, f32(0.5) * e, f32(0.0)).astype(f32)
    phi = np.where(x < 0, e, f32(1.0) - e).astype(f32)
    return (x.astype(f32) * phi).astype(f32)


def test_polynomial_erfc_relative_error() -> None:
    """erfc(t) = 2^(t * P(t)) within 1.2e-5 relative on [0, 4] (a half's rounding step is 4.9e-4): what the comment
    in the template promises."""
    cs = _coefficients()
    assert len(cs) == 9, "P is of degree 8"
    t = np.linspace(0.0, 4.0, 40001).astype(np.float32)
    p = np.full_like(t, np.float32(cs[0]))
    for c in cs[1:]:
        p = (p.astype(np.float64) * t + np.float32(c)).astype(np.float32)
    approx = np.exp2((p * t).astype(np.float32).astype(np.float64))
    exact = np.array([math.erfc(float(v)) for v in t])
    assert np.max(np.abs(approx / exact - 1.0)) < 1.2e-5


def test_gelu_half_within_a_step() -> None:
    """The GELU rounded to fp16 within one half step of the exact value rounded to fp16, over [-12, 12]: where
    erfc is zeroed (|x| > 5.66) the negative side's exact value is below a half's smallest step."""
    x = np.linspace(-12.0, 12.0, 48001).astype(np.float16)
    xd = x.astype(np.float64)
    exact = xd * np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in xd])
    got = _device_gelu(x.astype(np.float32)).astype(np.float16).astype(np.float64)
    near = exact.astype(np.float16)
    step = np.abs(np.spacing(near)).astype(np.float64)
    assert np.all(np.abs(got - near.astype(np.float64)) <= step)
    # and the fp32 erff form would have lost the negative side's relative accuracy the polynomial keeps
    neg = (xd < -3.0) & (xd > -5.5)
    rel = np.abs(_device_gelu(x.astype(np.float32))[neg].astype(np.float64) / exact[neg] - 1.0)
    assert np.max(rel) < 2e-5


def test_half_results_take_the_polynomial_and_fp32_keeps_erff() -> None:
    expr = Apply(O.Op.GELU, (In(0),), O.GeluAttrs())
    for dt, name in ((DType.F16, "fc_gelu_erf16("), (DType.BF16, "fc_gelu_erf16("), (DType.F32, "fc_gelu_erf(")):
        body = prepare(S.elementwise_spec(expr, [(4, 64)], [dt], (4, 64)))[1].partition("// ---- end common.cuh ----")[2]
        assert name in body, (dt, body)
        if dt == DType.F32:
            assert "fc_gelu_erf16(" not in body
