"""Storage precision pass: fp32 tensors become fp16/bf16, numerics stay within the dtype's tolerance."""

from __future__ import annotations

import numpy as np
import pytest

from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import verify
from fusec.ops import Op
from fusec.passes import precision
from fusec.passes.base import PassOptions


def _graph():
    rng = np.random.default_rng(0)
    b = GraphBuilder()
    x = b.input("x", (4, 32), DType.F32)
    ids = b.input("ids", (4,), DType.I64)
    w = b.const(rng.standard_normal((32, 16)).astype(np.float32) * 0.2, name="w")
    mask = b.const(np.where(rng.random((4, 16)) < 0.3, np.finfo(np.float32).min, 0).astype(np.float32), name="mask")
    h = b.emit(Op.MATMUL, x, w)
    h = b.emit(Op.ADD, h, mask)
    h = b.emit(Op.SOFTMAX, h, axis=1)
    up = b.emit(Op.CAST, h, to=DType.F32)
    idf = b.emit(Op.CAST, ids, to=DType.F32)
    b.output(b.emit(Op.MUL, up, b.emit(Op.RESHAPE, idf, shape=(4, 1))), "y")
    return b.build()


@pytest.mark.parametrize("dt,tol", [("f16", 2e-3), ("bf16", 1e-2)])
def test_precision_retypes_floats_and_keeps_numerics(dt: str, tol: float) -> None:
    g = _graph()
    out = precision.run(g, PassOptions(storage_dtype=dt)).graph
    verify(out)
    target = DType(dt)
    assert all(v.dtype in (target, DType.I64, DType.BOOL) for v in out.values())
    assert g.inputs[0].dtype == DType.F32, "the caller's graph must not change"
    mask = next(c for c in out.constants if c.name == "mask")
    assert np.isfinite(mask.data.astype(np.float32)).all(), "mask constants saturate instead of becoming -inf"
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    ids = rng.integers(1, 5, size=4)
    want = reference.run(g, {"x": x, "ids": ids})["y"]
    got = reference.run(out, {"x": x.astype(target.np), "ids": ids})["y"].astype(np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol


def test_precision_f32_is_a_no_op() -> None:
    g = _graph()
    res = precision.run(g, PassOptions())
    assert not res.changed and [n.op for n in res.graph.nodes] == [n.op for n in g.nodes]


def test_scalar_constants_keep_their_rank() -> None:
    b = GraphBuilder()
    x = b.input("x", (3,), DType.F32)
    b.output(b.emit(Op.MUL, x, b.scalar(0.5, DType.F32)), "y")
    out = precision.run(b.build(), PassOptions(storage_dtype="f16")).graph
    verify(out)
    assert out.constants[0].data.shape == () and out.constants[0].data.dtype == np.float16
