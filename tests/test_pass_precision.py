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


def _angles(form: str, n: int = 4096, hd: int = 64):  # noqa: ANN202
    """HF's rotary angles from integer positions: cos/sin(position_ids.float() x inv_freq)."""
    inv = (1.0 / (10000.0 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))).astype(np.float32)
    b = GraphBuilder()
    pos = b.input("position_ids", (1, n), DType.I64)
    p = b.emit(Op.CAST, pos, to=DType.F32)
    if form == "matmul":  # inv_freq[None, :, None] @ position_ids[:, None, :], transposed
        f = b.emit(Op.MATMUL, b.const(inv.reshape(1, hd // 2, 1), name="inv_freq"), b.emit(Op.RESHAPE, p, shape=(1, 1, n)))
        f = b.emit(Op.TRANSPOSE, f, perm=(0, 2, 1))
    else:
        f = b.emit(Op.MUL, b.emit(Op.RESHAPE, p, shape=(1, n, 1)), b.const(inv.reshape(1, 1, hd // 2), name="inv_freq"))
    emb = b.emit(Op.CONCAT, f, f, axis=2)
    b.output(b.emit(Op.COS, emb), "cos")
    b.output(b.emit(Op.SIN, emb), "sin")
    b.output(emb, "angles")  # an angle that is itself an output: stored in the storage dtype
    return b.build()


@pytest.mark.parametrize("dt,tol", [("f16", 1e-3), ("bf16", 4e-3)])
@pytest.mark.parametrize("form", ["matmul", "mul"])
def test_rotary_angles_from_integer_positions_are_computed_in_fp32(dt: str, tol: float, form: str) -> None:
    """fp16 holds integers exactly only to 2048, bf16 to 256: angles of thousands of radians kept in
    them were off by whole radians (cos 0.98 off at position 4095 in fp16)."""
    g = _angles(form)
    res = precision.run(g, PassOptions(storage_dtype=dt))
    verify(res.graph)
    feeds = {"position_ids": np.arange(4096)[None]}
    want, got = reference.run(g, feeds), reference.run(res.graph, feeds)
    for k in ("cos", "sin"):
        assert got[k].dtype == DType(dt).np  # the outputs in the storage dtype
        np.testing.assert_allclose(got[k].astype(np.float32), want[k], atol=tol, err_msg=k)
    assert got["angles"].dtype == DType(dt).np
    np.testing.assert_allclose(got["angles"].astype(np.float32), want["angles"], rtol=tol)
    kept = {v.name for n in res.graph.nodes for v in n.outputs if v.dtype == DType.F32}
    assert kept and all("cos" not in k and "sin" not in k for k in kept - {"cos_f32", "sin_f32"})


def test_an_integer_mask_made_float_is_stored_as_before() -> None:
    """The fp32 exception is for paths that end in cos/sin: a mask from an integer input goes on
    in the storage dtype (its finfo.min constant saturated), as every other value."""
    b = GraphBuilder()
    m = b.input("mask", (2, 8), DType.I64)
    s = b.input("scores", (2, 8), DType.F32)
    inv = b.emit(Op.SUB, b.scalar(1.0, DType.F32), b.emit(Op.CAST, m, to=DType.F32))
    add = b.emit(Op.MUL, inv, b.scalar(float(np.finfo(np.float32).min), DType.F32))
    b.output(b.emit(Op.SOFTMAX, b.emit(Op.ADD, s, add), axis=1), "p")
    g = b.build()
    res = precision.run(g, PassOptions(storage_dtype="f16"))
    assert not any(v.dtype == DType.F32 for n in res.graph.nodes for v in n.outputs)
    feeds = {"mask": np.array([[1] * 8, [1] * 4 + [0] * 4]), "scores": np.zeros((2, 8), np.float16)}
    p = reference.run(res.graph, feeds)["p"].astype(np.float32)
    assert np.isfinite(p).all()
    np.testing.assert_allclose(p[1, :4], 0.25, atol=1e-3)


def test_a_plan_with_fp32_angles_in_half_storage_compiles() -> None:
    """The fused kernels that mix the fp32 angle path with half-precision storage build (NVRTC, sm_90)."""
    import fusec

    plan = fusec.compile(_angles("matmul", n=256), dtype="bf16", arch="sm_90")
    outs = {o["name"]: o["dtype"] for o in plan.manifest["outputs"]}
    assert outs == {"cos": "bf16", "sin": "bf16", "angles": "bf16"}
