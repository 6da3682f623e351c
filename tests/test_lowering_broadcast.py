"""GPU lowerings of broadcast matrix products and of reductions over non-adjacent axes.

On the CPU: the batching plans (``fusec.lower.batching``) against numpy; the launches the lowering
emits (cuBLAS strided-batched GEMM records and the copy / row-reduce kernel specs, with their
planned addresses) executed by a small numpy emulator over one byte arena and compared with the
reference; and a compile of each graph for sm_90 (NVRTC). On a GPU (``gpu`` mark): the plans run
against the reference."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from graph_checks import run_plan

import fusec
from fusec.errors import FusecError
from fusec.lower import argreduce
from fusec import reference
from fusec.builder import GraphBuilder
from fusec.codegen import copyspecs as CS
from fusec.codegen import elementwise as E
from fusec.codegen import specs as S
from fusec.dtypes import DType
from fusec.lower import Context
from fusec.lower.batching import MAX_CALLS, gemm_batches, reduce_transpose
from fusec.lower.nodes import lower_node
from fusec.ops import Op
from fusec.passes.memory_plan import plan_memory
from fusec.passes import select_kernels
from fusec.passes.base import PassOptions

# (A shape, B shape): every broadcast pattern the lowering plans differently
MATMULS = [
    ((5,), (3, 5, 4)),  # 1-D x 3-D: A shared by every product
    ((2, 3, 5), (5,)),  # 3-D x 1-D: folds into M
    ((2, 3, 5), (5, 4)),  # [B, M, K] x [K, N]: folds into M
    ((1, 3, 5), (2, 5, 4)),  # [1, M, K] x [B, K, N]: stride-0 A
    ((2, 3, 5), (1, 5, 4)),  # [B, M, K] x [1, K, N]: folds into M
    ((4, 1, 4), (2, 4, 4, 8)),  # A broadcast along the outer batch axis: one call per outer index
    ((2, 1, 3, 5), (1, 4, 5, 2)),  # both broadcast: outer calls
    ((MAX_CALLS + 1, 1, 2, 3), (1, 3, 3, 2)),  # too many calls: A copied broadcast into scratch
    ((3, 1, 2, 3), (1, MAX_CALLS + 2, 3, 2)),  # B grows instead
    ((2, 3, 4, 5), (3, 5, 6)),  # batch broadcast by rank, both full along the shared axis
]
REDUCES = [((2, 3, 4), (0, 2)), ((2, 3, 4, 5), (1, 3)), ((3, 1, 4, 2), (0, 2)), ((2, 1, 3), (0, 2)),
           ((2, 3, 4, 5), (0, 1, 3)), ((4, 5), (0,))]


@pytest.mark.parametrize("sa,sb", MATMULS)
@pytest.mark.parametrize("max_calls", [1, MAX_CALLS])
def test_gemm_batch_plan_computes_the_broadcast_product(sa, sb, max_calls: int) -> None:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(sa), rng.standard_normal(sb)
    a2 = a.reshape((1,) + sa) if len(sa) == 1 else a
    b2 = b.reshape(sb + (1,)) if len(sb) == 1 else b
    (m, k), n = a2.shape[-2:], b2.shape[-1]
    plan = gemm_batches(a2.shape[:-2], b2.shape[:-2], m, k, n, max_calls=max_calls)
    want = np.matmul(a, b)
    fa = (np.broadcast_to(a2, plan.expand_a + (m, k)) if plan.expand_a else a2).reshape(-1)
    fb = (np.broadcast_to(b2, plan.expand_b + (k, n)) if plan.expand_b else b2).reshape(-1)
    got = np.full(want.size, np.nan)
    for oa, ob, oc in plan.calls:
        for i in range(plan.batch):
            pa = fa[oa + i * plan.strides[0]:][:plan.m * k].reshape(plan.m, k)
            pb = fb[ob + i * plan.strides[1]:][:k * n].reshape(k, n)
            got[oc + i * plan.strides[2]:][:plan.m * n] = (pa @ pb).reshape(-1)
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-12, atol=1e-12)
    assert len(plan.calls) <= max(max_calls, 1)


@pytest.mark.parametrize("shape,axes", REDUCES)
def test_reduce_transpose_plan(shape, axes) -> None:
    x = np.random.default_rng(1).standard_normal(shape)
    perm, outer, cols, inner = reduce_transpose(shape, axes)
    src = x if perm is None else np.transpose(x, perm)
    got = np.ascontiguousarray(src).reshape(outer, cols, inner).sum(axis=1)
    np.testing.assert_allclose(got.reshape(-1), x.sum(axis=axes).reshape(-1), rtol=1e-12)
    kept_axes = [i for i in range(len(shape)) if shape[i] != 1]  # extent-1 axes do not separate others
    red = sorted(kept_axes.index(i) for i in axes if shape[i] != 1)
    assert (perm is None) == (red == list(range(red[0], red[-1] + 1)) if red else True)


# ---- the lowering's launches, executed in numpy -------------------------------------------------

class _Recorder(Context):
    """A lowering context that keeps each kernel's spec and bound addresses instead of compiling."""

    def __init__(self, offsets: dict[str, int], arena_base: int):
        super().__init__("sm_90", offsets, "f32", None, arena_base=arena_base)
        self.choices, self.choices_applied, self.choices_declined = {}, {}, {}

    def kernel(self, spec, args, label):  # noqa: ANN001
        self.emit({"type": "spec", "spec": spec, "args": [self.ptr(a)[1:] for a in args], "label": label}, list(args), [])


def _buf(mem: dict[str, np.ndarray], addr, dt: DType, n: int) -> np.ndarray:  # noqa: ANN001
    space, off = addr
    return mem[space][off:off + n * dt.itemsize].view(dt.np)


def _strided(mem, addr, dt: DType, shape, strides, offset: int) -> np.ndarray:  # noqa: ANN001
    flat = mem[addr[0]][addr[1]:].view(np.uint8)
    base = flat[: (len(flat) // dt.itemsize) * dt.itemsize].view(dt.np)
    return np.lib.stride_tricks.as_strided(base[offset:], shape, [s * dt.itemsize for s in strides], writeable=True)


def _eval(e, ins: list[np.ndarray]) -> np.ndarray:  # noqa: ANN001
    if isinstance(e, E.In):
        return ins[e.index]
    if isinstance(e, E.Const):
        return np.asarray(e.value, e.dtype.np)
    with np.errstate(all="ignore"):
        return np.asarray(reference.IMPL[e.op](e.attrs, *[_eval(a, ins) for a in e.args]))


def _emulate(launches: list[dict], mem: dict[str, np.ndarray]) -> None:
    for L in launches:
        if L["type"] == "gemm":
            dt = DType(L["dtype"])
            m, n, k = L["m"], L["n"], L["k"]
            for i in range(L["batch"]):
                if L["trans_a"]:  # A stored [k, m]
                    a = _strided(mem, L["a"], dt, (k, m), (L["lda"], 1), i * L["stride_a"]).T
                else:
                    a = _strided(mem, L["a"], dt, (m, k), (L["lda"], 1), i * L["stride_a"])
                bs = (n, k) if L["trans_b"] else (k, n)
                b = _strided(mem, L["b"], dt, bs, (L["ldb"], 1), i * L["stride_b"])
                c = _strided(mem, L["c"], dt, (m, n), (L["ldc"], 1), i * L["stride_c"])
                c[...] = (a.astype(np.float64) @ (b.T if L["trans_b"] else b).astype(np.float64)).astype(dt.np)
            continue
        spec, args = L["spec"], L["args"]
        if isinstance(spec, CS.CopySpec):
            assert spec.index is None and not spec.src_mod and spec.trilu is None, L["label"]
            src = _strided(mem, args[0], spec.dtype, spec.shape, spec.src_strides, spec.src_offset)
            dst = _strided(mem, args[1], spec.dtype, spec.shape, spec.dst_strides, spec.dst_offset)
            dst[...] = src.copy()
        elif isinstance(spec, S.ElementwiseSpec):  # the expression evaluated by the reference's op table
            ins = [_strided(mem, a, o.dtype, spec.shape, o.strides, 0).copy() for a, o in zip(args, spec.inputs)]
            _buf(mem, args[-1], spec.out_dtype, math.prod(spec.shape))[...] = _eval(spec.expr, ins).reshape(-1)
        elif isinstance(spec, S.CumsumSpec):
            x = _buf(mem, args[0], spec.dtype, spec.outer * spec.n * spec.inner).reshape(spec.outer, spec.n, spec.inner)
            c = np.cumsum(x[:, ::-1] if spec.reverse else x, axis=1)
            c = (c - (x[:, ::-1] if spec.reverse else x)) if spec.exclusive else c
            _buf(mem, args[1], spec.dtype, x.size)[...] = (c[:, ::-1] if spec.reverse else c).reshape(-1)
        elif isinstance(spec, S.RowReduceSpec) and spec.kind in ("sum", "mean", "max", "prod"):
            x = _buf(mem, args[0], spec.dtype, spec.outer * spec.cols * spec.inner).reshape(spec.outer, spec.cols, spec.inner)
            fn = {"sum": np.sum, "mean": np.mean, "max": np.max, "prod": np.prod}[spec.kind]
            wide = x if spec.dtype.is_int else x.astype(np.float64)
            _buf(mem, args[1], spec.dtype, spec.outer * spec.inner)[...] = fn(wide, axis=1).reshape(-1)
        else:
            raise AssertionError(f"{L['label']}: the emulator has no model of {type(spec).__name__}")


def _run_lowered(graph, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[dict]]:  # noqa: ANN001
    graph = select_kernels.run(graph, PassOptions()).graph  # lower_node reads each node's kernel selection
    mplan = plan_memory(graph)
    ctx = _Recorder(mplan.offsets, -(-mplan.arena_bytes // 256) * 256)
    for i, node in enumerate(graph.nodes):
        lower_node(ctx, node, f"#{i} {node.op.value}")
    arena = np.full(ctx.arena_base + ctx.scratch_bytes + 64, 0xFF, np.uint8)  # NaN-filled
    mem = {"arena": arena, "weights": np.frombuffer(bytes(ctx.weights.blob()) + b"\0" * 64, np.uint8).copy()}
    for v in graph.inputs:
        _buf(mem, ctx.addr(v), v.dtype, v.numel)[...] = feeds[v.name].reshape(-1)
    _emulate(ctx.launches, mem)
    out = {v.name: _buf(mem, ctx.addr(v), v.dtype, v.numel).reshape(v.shape).copy() for v in graph.outputs}
    return out, ctx.launches


def _matmul_graph(sa, sb, dt: DType = DType.F32, const_b: bool = False):  # noqa: ANN001
    b = GraphBuilder("bmm")
    x = b.input("a", sa, dt)
    rng = np.random.default_rng(2)
    y = b.const(rng.standard_normal(sb).astype(np.float32), name="w", dtype=dt) if const_b else b.input("b", sb, dt)
    b.output(b.emit(Op.MATMUL, x, y), "y")
    return b.build()


def _reduce_graph(shape, axes, op: Op = Op.REDUCE_SUM, keepdims: bool = False, dt: DType = DType.F32):  # noqa: ANN001
    b = GraphBuilder("red")
    x = b.input("x", shape, dt)
    b.output(b.emit(op, x, axes=tuple(axes), keepdims=keepdims), "y")
    return b.build()


def _feeds(graph, seed: int = 0) -> dict[str, np.ndarray]:  # noqa: ANN001
    rng = np.random.default_rng(seed)
    return {v.name: rng.standard_normal(v.shape).astype(v.dtype.np) for v in graph.inputs}


@pytest.mark.parametrize("sa,sb", MATMULS)
def test_broadcast_matmul_launches_compute_the_reference(sa, sb) -> None:
    g = _matmul_graph(sa, sb)
    feeds = _feeds(g)
    got, launches = _run_lowered(g, feeds)
    np.testing.assert_allclose(got["y"], reference.run(g, feeds)["y"], rtol=1e-5, atol=1e-5)
    gemms = [L for L in launches if L["type"] == "gemm"]
    assert 1 <= len(gemms) <= MAX_CALLS
    if math.prod(sa[:-2]) == 1 or len(sb) <= 2 or math.prod(sb[:-2]) == 1:
        assert len(gemms) == 1 and not [L for L in launches if L["type"] != "gemm"]  # no copy: strides only


@pytest.mark.parametrize("shape,axes", REDUCES)
@pytest.mark.parametrize("op,dt", [(Op.REDUCE_SUM, DType.F32), (Op.REDUCE_MEAN, DType.F32), (Op.REDUCE_MAX, DType.F32),
                                   (Op.REDUCE_MIN, DType.F32), (Op.REDUCE_MIN, DType.I64)])
def test_reduce_over_any_axes_launches_compute_the_reference(shape, axes, op: Op, dt: DType) -> None:
    g = _reduce_graph(shape, axes, op, keepdims=bool(len(axes) % 2), dt=dt)
    feeds = _feeds(g)
    if dt.is_int:  # the whole int64 range, its ends included: ~x never overflows
        rng = np.random.default_rng(3)
        x = rng.integers(-(2**63), 2**63 - 1, size=shape, dtype=np.int64, endpoint=True)
        x.reshape(-1)[:2] = (-(2**63), 2**63 - 1)
        feeds = {"x": x}
    got, launches = _run_lowered(g, feeds)
    np.testing.assert_allclose(got["y"], reference.run(g, feeds)["y"], rtol=1e-5, atol=1e-6)
    copies = [L for L in launches if isinstance(L.get("spec"), CS.CopySpec)]
    assert len(copies) == (reduce_transpose(shape, tuple(axes))[0] is not None)


ARGS = [((3, 5), 1), ((4, 3, 2), 1), ((2, 3, 4), 0), ((6,), 0)]


@pytest.mark.parametrize("shape,axis", ARGS)
@pytest.mark.parametrize("op", [Op.ARGMAX, Op.ARGMIN])
@pytest.mark.parametrize("dt", [DType.F32, DType.F16, DType.I64])
@pytest.mark.parametrize("last", [False, True])
def test_arg_reduce_launches_compute_the_reference(shape, axis: int, op: Op, dt: DType, last: bool) -> None:
    """Ties (values drawn from a few), NaNs (floats: a NaN is the extremum) and the int64 range ends."""
    g = _arg_graph(shape, axis, op, dt, last)
    rng = np.random.default_rng(7)
    if dt.is_int:
        vals = np.array([-(2**63), -1, 0, 5, 2**63 - 1], np.int64)
    else:
        vals = np.array([-np.inf, -1.5, 0.0, 2.0, np.inf, np.nan]).astype(dt.np)
    feeds = {"x": rng.choice(vals, size=shape)}
    got, _ = _run_lowered(g, feeds)
    np.testing.assert_array_equal(got["y"], reference.run(g, feeds)["y"])


def _arg_graph(shape, axis: int, op: Op, dt: DType = DType.F32, last: bool = False):  # noqa: ANN001
    b = GraphBuilder("arg")
    x = b.input("x", shape, dt)
    b.output(b.emit(op, x, axis=axis, keepdims=bool(axis), select_last_index=last), "y")
    return b.build()


def test_arg_reduce_compiles_for_sm90() -> None:
    for (shape, axis), op in itertools.product(ARGS[:2], (Op.ARGMAX, Op.ARGMIN)):
        plan = fusec.compile(_arg_graph(shape, axis, op), dtype="fp16", arch="sm_90")
        assert plan.info()["launches"] == (7 if op == Op.ARGMIN else 6)


def test_arg_reduce_is_refused_on_the_gpu_path_when_switched_off(monkeypatch) -> None:
    monkeypatch.setattr(argreduce, "ENABLED", False)
    for op in (Op.ARGMAX, Op.ARGMIN):
        with pytest.raises(FusecError, match=f"{op.value} has no GPU lowering \\(switched off"):
            fusec.compile(_arg_graph((3, 5), 1, op), dtype="fp32", arch="sm_90")


@pytest.mark.parametrize("case", ["matmul", "reduce"])
def test_broadcast_lowerings_compile_for_sm90(case: str) -> None:
    graphs = ([_matmul_graph(sa, sb) for sa, sb in MATMULS] if case == "matmul"
              else [_reduce_graph(s, a, op) for s, a in REDUCES for op in (Op.REDUCE_SUM, Op.REDUCE_MIN)])
    for g in graphs:
        plan = fusec.compile(g, dtype="fp16", arch="sm_90")
        assert plan.info()["launches"] >= 1


def test_weight_shared_by_a_batch_is_one_gemm_after_the_passes() -> None:
    """[B, M, K] @ W[K, N] and 1-D @ [B, K, N] with a constant: still one cuBLAS call each."""
    for sa, sb in (((2, 3, 5), (5, 4)), ((5,), (3, 5, 4))):
        plan = fusec.compile(_matmul_graph(sa, sb, const_b=True), dtype="fp32", arch="sm_90")
        assert sum(L["type"] == "gemm" for L in plan.manifest["launches"]) == 1


# ---- on the GPU --------------------------------------------------------------------------------

def _gpu_check(graph, dtype: str, tol: float) -> None:  # noqa: ANN001
    import cupy

    feeds = _feeds(graph, seed=4)
    want = reference.run(graph, feeds)["y"].astype(np.float64)
    got = cupy.asnumpy(run_plan(fusec.compile(graph, dtype=dtype), feeds)["y"]).astype(np.float64)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("sa,sb", MATMULS)
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("fp16", 2e-3)])
def test_broadcast_matmul_on_the_gpu(sa, sb, dtype: str, tol: float) -> None:
    _gpu_check(_matmul_graph(sa, sb), dtype, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,axis", ARGS)
@pytest.mark.parametrize("op", [Op.ARGMAX, Op.ARGMIN])
@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_arg_reduce_on_the_gpu(shape, axis: int, op: Op, last: bool, dtype: str) -> None:
    """Rows with NaNs, ties and numbers: 14 of the 16 fp32 cases failed while the row max dropped
    NaN (fmaxf in its warp fold); the reference runs on the values the plan reads."""
    import cupy

    g = _arg_graph(shape, axis, op, DType.F32, last)
    x = np.random.default_rng(8).choice(np.array([-1.0, 0.0, 2.0, np.nan], np.float32), size=shape)
    x = x.astype(np.float16 if dtype == "fp16" else np.float32)
    got = cupy.asnumpy(run_plan(fusec.compile(g, dtype=dtype), {"x": x})["y"])
    np.testing.assert_array_equal(got, reference.run(g, {"x": x.astype(np.float32)})["y"])


@pytest.mark.gpu
@pytest.mark.parametrize("shape,axes", REDUCES)
@pytest.mark.parametrize("op", [Op.REDUCE_SUM, Op.REDUCE_MAX, Op.REDUCE_MIN])
def test_reduce_over_any_axes_on_the_gpu(shape, axes, op: Op) -> None:
    _gpu_check(_reduce_graph(shape, axes, op), "fp32", 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("op", [Op.REDUCE_MAX, Op.REDUCE_MIN])
@pytest.mark.parametrize("shape,axes", [((3, 70), (1,)), ((2, 300, 3), (1,)), ((4, 5), (0,))])
def test_reduce_max_min_keep_nan_on_the_gpu(op: Op, shape, axes) -> None:
    """A NaN anywhere in a row is the row's max / min, as numpy says (the warp fold once dropped it)."""
    import cupy

    g = _reduce_graph(shape, axes, op)
    x = np.random.default_rng(9).choice(np.array([-1.0, 0.0, 2.0, np.nan], np.float32), size=shape)
    got = cupy.asnumpy(run_plan(fusec.compile(g, dtype="fp32"), {"x": x})["y"])
    np.testing.assert_array_equal(got, reference.run(g, {"x": x})["y"])


def test_plan_products_cover_every_output_once() -> None:
    """Every C element is written by exactly one product of one call (no gap, no overlap)."""
    for (sa, sb), mc in itertools.product(MATMULS, (1, MAX_CALLS)):
        a2 = (1,) + sa if len(sa) == 1 else sa
        b2 = sb + (1,) if len(sb) == 1 else sb
        (m, k), n = a2[-2:], b2[-1]
        plan = gemm_batches(a2[:-2], b2[:-2], m, k, n, max_calls=mc)
        total = math.prod(np.broadcast_shapes(a2[:-2], b2[:-2])) * m * n
        hits = np.zeros(total, int)
        for _, _, oc in plan.calls:
            for i in range(plan.batch):
                hits[oc + i * plan.strides[2]:][:plan.m * n] += 1
        assert (hits == 1).all(), (sa, sb, mc)


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
def test_transpose_flag_products_compute_the_reference(ta: bool, tb: bool, batch: tuple) -> None:
    """A gradient product (A read transposed, fusec.autodiff) as cuBLAS launches: lda, strides."""
    m, k, n = 5, 7, 6
    b = GraphBuilder("tmm")
    x = b.input("a", batch + ((k, m) if ta else (m, k)), DType.F32)
    y = b.input("b", batch + ((n, k) if tb else (k, n)), DType.F32)
    b.output(b.emit(Op.MATMUL, x, y, trans_a=ta, trans_b=tb), "y")
    g = b.build()
    feeds = _feeds(g)
    got, launches = _run_lowered(g, feeds)
    np.testing.assert_allclose(got["y"], reference.run(g, feeds)["y"], rtol=1e-5, atol=1e-5)
    assert [L["type"] for L in launches] == ["gemm"] and launches[0]["trans_a"] == ta
