"""Each generated kernel against a numpy reference on the GPU (skipped without one).

Random non-zero inputs drawn fresh each run; outputs are poisoned (NaN / sentinel bytes) before
the launch; ||out - ref|| / ||ref|| per dtype: fp32 1e-5, fp16 2e-3, bf16 1e-2. References use
fusec.reference where the IR has the op; attention, rope and gemm epilogues use float64 numpy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fusec import ops as O
from fusec import reference as R
from fusec.codegen import copyspecs as C
from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.codegen.elementwise import Apply, Const, Expr, In
from fusec.dtypes import DType

pytestmark = pytest.mark.gpu

F16, BF16, F32, I64, I32, BOOL = DType.F16, DType.BF16, DType.F32, DType.I64, DType.I32, DType.BOOL
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1e-2}
FLOATS = [F32, F16, BF16]
RNG = np.random.default_rng(20261123)  # fresh data each run


# ---- helpers -----------------------------------------------------------------------------------

def rand(shape: tuple[int, ...], dt: DType, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    if dt.is_float:
        x = RNG.uniform(lo, hi, size=shape)
        x = np.where(np.abs(x) < 1e-3, 0.5, x)  # non-zero
        return x.astype(np.float32).astype(dt.np)
    if dt == BOOL:
        return RNG.random(shape) < 0.5
    return RNG.integers(1, 50, size=shape).astype(dt.np)


def dev(x: np.ndarray):  # noqa: ANN201
    import cupy as cp

    x = np.ascontiguousarray(x)
    if x.dtype == DType.BF16.np:
        return cp.asarray(x.view(np.uint16))
    return cp.asarray(x)


def poisoned(shape: tuple[int, ...], dt: DType):  # noqa: ANN201
    """An output buffer full of NaN (floats) or 0xAA bytes (ints, bools): a kernel that skips an
    element leaves something the comparison cannot mistake for a result."""
    import cupy as cp

    if dt == F32:
        return cp.full(shape, np.nan, dtype=np.float32)
    if dt == F16:
        return cp.full(shape, np.nan, dtype=np.float16)
    if dt == BF16:
        return cp.full(shape, 0x7FC0, dtype=np.uint16)
    buf = cp.full(shape + (dt.itemsize,), 0xAA, dtype=np.uint8)
    return buf.view(dt.np).reshape(shape)


def host(x, dt: DType) -> np.ndarray:  # noqa: ANN001
    a = x.get()
    return a.view(DType.BF16.np) if dt == BF16 else a


def run(spec: object, args: list) -> None:  # noqa: ANN001
    import cupy as cp

    ck = K.build(spec)
    K.launch(ck, args)
    cp.cuda.runtime.deviceSynchronize()


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    assert o.shape == r.shape
    assert np.array_equal(np.isnan(o), np.isnan(r)), "NaN pattern differs"
    fin = np.isfinite(r)
    return float(np.linalg.norm((o - r)[fin]) / max(np.linalg.norm(r[fin]), 1e-30))


def check(out: np.ndarray, ref: np.ndarray, dt: DType) -> None:
    err = rel_err(out, ref)
    assert err <= TOL[dt], f"relative error {err:.3e} > {TOL[dt]:.0e}"


def eval_expr(e: Expr, xs: list[np.ndarray]) -> np.ndarray:
    """The reference meaning of an expression tree: fusec.reference op by op."""
    if isinstance(e, In):
        return xs[e.index]
    if isinstance(e, Const):
        return np.asarray(e.value, dtype=e.dtype.np)
    with np.errstate(all="ignore"):
        return np.asarray(R.IMPL[e.op](e.attrs, *[eval_expr(a, xs) for a in e.args]))


# ---- elementwise ---------------------------------------------------------------------------------

def _ew_cases() -> list[tuple[str, Expr, list[tuple[int, ...]], list[DType], tuple[int, ...]]]:
    cases = []
    for dt in FLOATS:
        gelu = Apply(O.Op.GELU, (Apply(O.Op.ADD, (In(0), In(1))),), O.GeluAttrs())
        cases.append((f"gelu_bias_{dt.value}", gelu, [(8, 33, 64), (64,)], [dt, dt], (8, 33, 64)))
        silu_mul = Apply(O.Op.MUL, (Apply(O.Op.SILU, (In(0),)), In(1)))
        cases.append((f"silu_mul_odd_{dt.value}", silu_mul, [(7, 13), (7, 13)], [dt, dt], (7, 13)))
        mid = Apply(O.Op.DIV, (Apply(O.Op.SUB, (In(0), In(1))), Apply(O.Op.SQRT, (Apply(O.Op.ABS, (In(1),)),))))
        cases.append((f"mid_broadcast_{dt.value}", mid, [(4, 5, 6), (4, 1, 6)], [dt, dt], (4, 5, 6)))
        scale = Apply(O.Op.MUL, (In(0), In(1)))  # one value a row: stride 0 along it, vectors of the other
        cases.append((f"row_scale_{dt.value}", scale, [(6, 40), (6, 1)], [dt, dt], (6, 40)))
        wh = Apply(O.Op.WHERE, (In(0), In(1), Const(-3.25, dt)))
        cases.append((f"where_{dt.value}", wh, [(3, 1, 40), (3, 9, 40)], [BOOL, dt], (3, 9, 40)))
        cast = Apply(O.Op.CAST, (Apply(O.Op.TANH, (In(0),)),), O.CastAttrs(F32))
        cases.append((f"tanh_cast_{dt.value}", cast, [(5, 48)], [dt], (5, 48)))
    idiv = Apply(O.Op.DIV, (Apply(O.Op.NEG, (In(0),)), In(1)))
    cases.append(("int_div_i64", idiv, [(6, 10), (10,)], [I64, I64], (6, 10)))
    cmp = Apply(O.Op.AND, (Apply(O.Op.LESS, (In(0), In(1))), Apply(O.Op.NOT, (In(2),))))
    cases.append(("compare_bool", cmp, [(4, 16), (16,), (4, 16)], [F32, F32, BOOL], (4, 16)))
    return cases


EW = _ew_cases()


@pytest.mark.parametrize("label,expr,shapes,dts,out_shape", EW, ids=[c[0] for c in EW])
def test_elementwise(label: str, expr: Expr, shapes: list, dts: list, out_shape: tuple) -> None:
    spec = S.elementwise_spec(expr, shapes, dts, out_shape)
    xs = [rand(s, d) for s, d in zip(shapes, dts)]
    if label.startswith("int_div"):
        xs[0] = RNG.integers(-100, 100, size=shapes[0]).astype(np.int64)
    out = poisoned(out_shape, spec.out_dtype)
    run(spec, [dev(x) for x in xs] + [out])
    ref = eval_expr(expr, xs)
    got = host(out, spec.out_dtype)
    if spec.out_dtype.is_float:
        # the least precise float involved sets the tolerance (fp16 rounding inside an fp32 result)
        floats = [d for d in dts + [spec.out_dtype] if d.is_float]
        check(got, np.broadcast_to(ref, out_shape), max(floats, key=lambda d: TOL[d]))
    else:
        assert np.array_equal(got, np.broadcast_to(ref, out_shape))


@pytest.mark.parametrize("dt", FLOATS)
def test_elementwise_over_views_in_vectors(dt: DType) -> None:
    """An indexed chain over views, as a gated unit's halves after a prefill's product (``lower.fused._indexed_vec``):
    silu(y[:, :F]) * y[:, F:] * s[:, None], each half read 16 bytes at a time at its row stride 2F, s one value a
    group (last stride 0)."""
    M, F = 37, 48
    silu_mul = Apply(O.Op.MUL, (Apply(O.Op.MUL, (Apply(O.Op.SILU, (In(0),)), In(1))), In(2)))
    vec = 16 // max(dt.itemsize, 2)
    spec = S.ElementwiseSpec(silu_mul, (M, F), (S.Operand(dt, (2 * F, 1)), S.Operand(dt, (2 * F, 1)),
                                                 S.Operand(dt, (1, 0))), dt, vec)
    y, sc = rand((M, 2 * F), dt), rand((M,), dt)
    yd = dev(y)
    out = poisoned((M, F), dt)
    run(spec, [yd[:, :F], yd[:, F:], dev(sc), out])
    ref = eval_expr(silu_mul, [y[:, :F], y[:, F:], sc[:, None]])
    check(host(out, dt), ref, dt)


@pytest.mark.parametrize("dt", FLOATS)
def test_elementwise_multi_output(dt: DType) -> None:
    """One kernel writing several outputs at one index (a multi-output group: siblings and intermediates read
    elsewhere): a float, a bool and an int64 result over a row broadcast, one of them over its input's own
    storage (an in-place state update) and a second shape equal but for a size-1 axis."""
    M, N = 9, 40
    t = Apply(O.Op.MUL, (In(0), In(1)))  # x * s[row]
    neg = Apply(O.Op.NEG, (t,))
    gt = Apply(O.Op.GREATER, (t, Const(0.25, dt)))
    cnt = Apply(O.Op.ADD, (In(2), Apply(O.Op.CAST, (gt,), O.CastAttrs(I64))))  # counter += (t > 0.25)
    ops = (S.Operand(dt, (N, 1)), S.Operand(dt, (1, 0)), S.Operand(I64, (N, 1)))
    spec = S.ElementwiseSpec(neg, (M, N), ops, dt, 1, ((gt, BOOL), (cnt, I64)))
    x, sc = rand((M, N), dt), rand((M, 1), dt)
    c0 = RNG.integers(0, 9, size=(M, N)).astype(np.int64)
    cd = dev(c0)
    o_neg, o_gt = poisoned((M, N), dt), poisoned((M, N), BOOL)
    run(spec, [dev(x), dev(sc), cd, o_neg, o_gt, cd])  # the counter updated over itself
    ref_t = eval_expr(t, [x, sc, c0])
    check(host(o_neg, dt), -ref_t, dt)
    ref_gt = ref_t.astype(np.float64) > 0.25
    assert np.array_equal(host(o_gt, BOOL), ref_gt)
    assert np.array_equal(host(cd, I64), c0 + ref_gt.astype(np.int64))


@pytest.mark.parametrize("dt", [F16, BF16])
def test_gelu_erf_half_per_element(dt: DType) -> None:
    """A half result's erf-GELU (common.cuh fc_gelu_erf16, a polynomial erfc) element by element over [-12, 12] and
    the specials: within one step of the half nearest the exact value (float64), or 0 where that is under 6e-8; +inf,
    NaN and NaN for +inf, -inf and NaN, as the erff form gives."""
    from math import erfc

    x = np.concatenate([np.linspace(-12.0, 12.0, 24001), [0.0, -0.0, 5.65, -5.65, 5.66, -5.66, 1e-4, -1e-4]])
    x = x.astype(np.float32).astype(dt.np)
    xd = x.astype(np.float64)
    exact = xd * np.array([0.5 * erfc(-v / math.sqrt(2.0)) for v in xd])
    spec = S.elementwise_spec(Apply(O.Op.GELU, (In(0),), O.GeluAttrs()), [x.shape], [dt], x.shape)
    assert "fc_gelu_erf16(" in K.prepare(spec)[1].partition("// ---- end common.cuh ----")[2]
    out = poisoned(x.shape, dt)
    run(spec, [dev(x), out])
    got = host(out, dt).astype(np.float64)
    near = exact.astype(np.float32).astype(dt.np).astype(np.float64)
    if dt == F16:
        step = np.abs(np.spacing(near.astype(np.float16))).astype(np.float64)
    else:  # bf16: 8 significant bits
        a = np.abs(near)
        step = np.where(a > 0, 2.0 ** (np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), -126) - 7), 2.0**-133)
    # |GELU| under 6e-8 (x < -5.66) is 0: fp16 has no such value; bf16 has, but the erff form loses it too (1 + erff
    # rounds to 0 from about the same x)
    bad = (np.abs(got - near) > step) & ~((np.abs(exact) < 6e-8) & (got == 0))
    assert not bad.any(), f"{int(bad.sum())} values off by more than a step, first at x={xd[bad][0]}: {got[bad][0]} " \
                          f"against {near[bad][0]}"
    specials = np.array([np.inf, -np.inf, np.nan], np.float32).astype(dt.np)
    out2 = poisoned((3,), dt)
    run(S.elementwise_spec(Apply(O.Op.GELU, (In(0),), O.GeluAttrs()), [(3,)], [dt], (3,)), [dev(specials), out2])
    got2 = host(out2, dt).astype(np.float64)
    assert got2[0] == np.inf and np.isnan(got2[1]) and np.isnan(got2[2])  # -inf * Phi(-inf) = -inf * 0, as erff's


# ---- row reductions ------------------------------------------------------------------------------

@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("cols", [768, 1000, 37, 9000])
@pytest.mark.parametrize("rows", [11, 531])  # 531: a warp a row where the row is short, the last block partial
def test_layernorm_and_add(dt: DType, cols: int, rows: int) -> None:
    x, r, g, b = rand((rows, cols), dt), rand((rows, cols), dt), rand((cols,), dt), rand((cols,), dt)
    out = poisoned((rows, cols), dt)
    run(S.RowReduceSpec("layernorm", rows, cols, dt, w_dtype=dt, has_bias=True, eps=1e-5), [dev(x), dev(g), dev(b), out])
    a = O.LayerNormAttrs(axis=1, eps=1e-5)
    check(host(out, dt), R.IMPL[O.Op.LAYERNORM](a, x, g, b), dt)
    s_out, out2 = poisoned((rows, cols), dt), poisoned((rows, cols), dt)
    run(S.RowReduceSpec("add_layernorm", rows, cols, dt, w_dtype=dt, eps=1e-5), [dev(x), dev(r), dev(g), s_out, out2])
    s_ref = R.IMPL[O.Op.ADD](None, x, r)
    assert np.array_equal(host(s_out, dt).view(np.uint8), s_ref.view(np.uint8))  # the stored sum is exact
    check(host(out2, dt), R.IMPL[O.Op.LAYERNORM](a, s_ref, g), dt)


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("rows", [9, 530])
def test_rmsnorm_and_add(dt: DType, offset: float, rows: int) -> None:
    cols = 1024
    x, r, w = rand((rows, cols), dt), rand((rows, cols), dt), rand((cols,), dt)
    a = O.RMSNormAttrs(eps=1e-6, weight_offset=offset)
    out = poisoned((rows, cols), dt)
    run(S.RowReduceSpec("rmsnorm", rows, cols, dt, w_dtype=dt, eps=1e-6, weight_offset=offset), [dev(x), dev(w), out])
    check(host(out, dt), R.IMPL[O.Op.RMSNORM](a, x, w), dt)
    s_out, out2 = poisoned((rows, cols), dt), poisoned((rows, cols), dt)
    run(S.RowReduceSpec("add_rmsnorm", rows, cols, dt, w_dtype=dt, eps=1e-6, weight_offset=offset),
        [dev(x), dev(r), dev(w), s_out, out2])
    check(host(out2, dt), R.IMPL[O.Op.RMSNORM](a, R.IMPL[O.Op.ADD](None, x, r), w), dt)


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("Sq", [5, 89])  # 89: 534 rows, a warp each
def test_softmax_scale_mask(dt: DType, Sq: int) -> None:
    B, H, T = 2, 3, 77
    x = rand((B, H, Sq, T), dt, -4, 4)
    mask = np.where(RNG.random((B, 1, 1, T)) < 0.2, np.float32(-1e4), np.float32(0)).astype(dt.np)
    out = poisoned((B, H, Sq, T), dt)
    spec = S.RowReduceSpec("softmax", B * H * Sq, T, dt, scale=0.125, mask_dtype=dt, rows_shape=(B, H, Sq),
                           mask_row_strides=(T, 0, 0), mask_col_stride=1)
    run(spec, [dev(x), dev(mask), out])
    z = R.IMPL[O.Op.ADD](None, R.IMPL[O.Op.MUL](None, x, np.asarray(0.125, dt.np)), mask)
    check(host(out, dt), R.IMPL[O.Op.SOFTMAX](O.AxisAttrs(3), z), dt)


def test_softmax_streaming_long_row() -> None:
    x = rand((3, 50257), F32, -5, 5)  # too long to keep in registers: the kernel reloads per pass
    out = poisoned((3, 50257), F32)
    run(S.RowReduceSpec("softmax", 3, 50257, F32), [dev(x), out])
    check(host(out, F32), R.IMPL[O.Op.SOFTMAX](O.AxisAttrs(1), x), F32)


@pytest.mark.parametrize("kind,op", [("sum", O.Op.REDUCE_SUM), ("mean", O.Op.REDUCE_MEAN), ("max", O.Op.REDUCE_MAX)])
@pytest.mark.parametrize("dt", [F32, F16, I64])
def test_reduce_middle_axis(kind: str, op: O.Op, dt: DType) -> None:
    if kind == "mean" and dt == I64:
        pytest.skip("mean is float-only")
    x = rand((4, 19, 3), dt)
    out = poisoned((4, 1, 3), dt)
    run(S.RowReduceSpec(kind, 4, 19, dt, inner=3), [dev(x), out])
    ref = R.IMPL[op](O.ReduceAttrs(axes=(1,), keepdims=True), x)
    if dt.is_float:
        check(host(out, dt), ref, dt)
    else:
        assert np.array_equal(host(out, dt), ref)


@pytest.mark.parametrize("kind,op", [("sum", O.Op.REDUCE_SUM), ("max", O.Op.REDUCE_MAX), ("prod", O.Op.REDUCE_PROD)])
@pytest.mark.parametrize("dt", [F32, F16, I64])
def test_reduce_last_axis_a_warp_a_row(kind: str, op: O.Op, dt: DType) -> None:
    """601 short rows: a warp each, four a block, the last block holding one."""
    from fusec.codegen.build_misc import warp_rows

    x = rand((601, 45), dt, 0.5, 1.5) if kind == "prod" else rand((601, 45), dt)
    if kind == "max" and dt.is_float:
        x[7, 3] = np.nan  # numpy's max keeps a NaN: so does the warp's fold
    assert warp_rows(45, 601, 1)
    out = poisoned((601, 1), dt)
    run(S.RowReduceSpec(kind, 601, 45, dt), [dev(x), out])
    ref = R.IMPL[op](O.ReduceAttrs(axes=(1,), keepdims=True), x)
    if dt.is_float:
        check(host(out, dt), ref, dt)
    else:
        assert np.array_equal(host(out, dt), ref)


@pytest.mark.parametrize("dt", [F32, I64])
@pytest.mark.parametrize("exclusive,reverse", [(False, False), (True, True)])
def test_cumsum(dt: DType, exclusive: bool, reverse: bool) -> None:
    x = rand((3, 17, 2), dt)
    out = poisoned((3, 17, 2), dt)
    run(S.CumsumSpec(3, 17, 2, dt, exclusive=exclusive, reverse=reverse), [dev(x), out])
    ref = R.IMPL[O.Op.CUMSUM](O.CumSumAttrs(axis=1, exclusive=exclusive, reverse=reverse), x)
    if dt.is_float:
        check(host(out, dt), ref, dt)
    else:
        assert np.array_equal(host(out, dt), ref)


# ---- embedding, rope ---------------------------------------------------------------------------

@pytest.mark.parametrize("dt", FLOATS)
def test_embedding_with_positions_and_bad_id(dt: DType) -> None:
    tokens, vocab, hidden, npos = 13, 50, 72, 20
    ids = RNG.integers(0, vocab, size=tokens).astype(np.int64)
    ids[3] = -2  # negative ids count from the end, as in the reference gather
    ids[5] = vocab + 7  # out of range: a NaN row, no out-of-bounds read
    pids = RNG.integers(0, npos, size=tokens).astype(np.int32)
    table, ptable = rand((vocab, hidden), dt), rand((npos, hidden), dt)
    out = poisoned((tokens, hidden), dt)
    run(S.EmbeddingSpec(tokens, vocab, hidden, dt, pos_vocab=npos, pos_id_dtype=I32),
        [dev(ids), dev(table), dev(pids), dev(ptable), out])
    got = host(out, dt).astype(np.float32)
    assert np.isnan(got[5]).all()
    keep = np.arange(tokens) != 5
    ref = R.IMPL[O.Op.ADD](None, table[np.where(ids < 0, ids + vocab, ids)[keep]], ptable[pids[keep]])
    check(got[keep], ref, dt)


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("D,rot", [(64, 64), (128, 64), (80, 32)])
def test_rope(dt: DType, D: int, rot: int) -> None:
    B, H, Sq = 2, 3, 7
    x = rand((B, H, Sq, D), dt)
    pos = np.arange(Sq)[None, :] + np.array([[0], [5]])  # per-batch positions
    inv = 1.0 / (10000 ** (np.arange(0, rot, 2) / rot))
    freqs = pos[..., None] * inv  # [B, S, rot/2]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb).astype(dt.np), np.sin(emb).astype(dt.np)
    out = poisoned((B, H, Sq, D), dt)
    st = (H * Sq * D, Sq * D, D)
    run(S.RopeSpec(B, H, Sq, D, rot, dt, st, st, (Sq * rot, rot)), [dev(x), dev(cos), dev(sin), out])
    xf = x.astype(np.float64)
    xr, xp = xf[..., :rot], xf[..., rot:]
    half = rot // 2
    rh = np.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    c, s = cos.astype(np.float64)[:, None], sin.astype(np.float64)[:, None]
    ref = np.concatenate([xr * c + rh * s, xp], axis=-1)
    check(host(out, dt), ref, dt)


# ---- data movement -------------------------------------------------------------------------------

def _copy_cases() -> list:
    x = (2, 3, 4)
    return [
        ("transpose", [C.transpose(x, (2, 0, 1), F16)], [x], O.Op.TRANSPOSE, O.PermAttrs((2, 0, 1)), None),
        ("slice_neg_step", [C.slice_((5, 6), (1,), (5,), (0,), (-2,), F32)], [(5, 6)], O.Op.SLICE,
         O.SliceAttrs((1,), (5,), (0,), (-2,)), None),
        ("expand", [C.expand((3, 1), (2, 3, 4), BF16)], [(3, 1)], O.Op.EXPAND, O.ShapeAttrs((2, 3, 4)), None),
        ("tile", [C.tile((2, 3), (2, 3), I64)], [(2, 3)], O.Op.TILE, O.TileAttrs((2, 3)), None),
        ("trilu", [C.trilu((3, 4, 5), False, 1, F32)], [(3, 4, 5)], O.Op.TRILU, O.TriluAttrs(False, 1), None),
    ]


COPY = _copy_cases()


@pytest.mark.parametrize("label,specs,shapes,op,attrs,_", COPY, ids=[c[0] for c in COPY])
def test_copy_ops(label: str, specs: list, shapes: list, op: O.Op, attrs: object, _: object) -> None:
    spec = specs[0]
    x = rand(shapes[0], spec.dtype)
    ref = R.IMPL[op](attrs, x)
    out = poisoned(ref.shape, spec.dtype)
    run(spec, [dev(x), out])
    assert np.array_equal(host(out, spec.dtype).view(np.uint8), np.ascontiguousarray(ref).view(np.uint8))


def test_concat_one_launch_per_input() -> None:
    xs = [rand((2, 3, 4), F16), rand((2, 5, 4), F16), rand((2, 1, 4), F16)]
    specs = C.concat([x.shape for x in xs], 1, F16)
    out = poisoned((2, 9, 4), F16)
    for s, x in zip(specs, xs):
        run(s, [dev(x), out])
    assert np.array_equal(host(out, F16), np.concatenate(xs, axis=1))


@pytest.mark.parametrize("idx_dt", [I64, I32])
def test_gathers(idx_dt: DType) -> None:
    data = rand((6, 5, 4), F32)
    idx = RNG.integers(-5, 5, size=(2, 3)).astype(idx_dt.np)
    out = poisoned((6, 2, 3, 4), F32)
    run(C.gather(data.shape, idx.shape, 1, F32, idx_dt), [dev(data), dev(idx), out])
    assert np.array_equal(host(out, F32), R.IMPL[O.Op.GATHER](O.AxisAttrs(1), data, idx))
    ie = RNG.integers(0, 5, size=(6, 7, 4)).astype(idx_dt.np)
    out = poisoned(ie.shape, F32)
    run(C.gather_elements(data.shape, ie.shape, 1, F32, idx_dt), [dev(data), dev(ie), out])
    assert np.array_equal(host(out, F32), R.IMPL[O.Op.GATHER_ELEMENTS](O.AxisAttrs(1), data, ie))
    ind = np.stack([RNG.integers(0, 5, size=(6, 3)), RNG.integers(0, 4, size=(6, 3))], -1).astype(idx_dt.np)
    out = poisoned((6, 3), F32)
    run(C.gather_nd(data.shape, ind.shape, 1, F32, idx_dt), [dev(data), dev(ind), out])
    assert np.array_equal(host(out, F32), R.IMPL[O.Op.GATHER_ND](O.GatherNDAttrs(1), data, ind))


def test_gather_out_of_range_writes_nan() -> None:
    data = rand((4, 3), F32)
    idx = np.array([0, 9, -1], dtype=np.int64)
    out = poisoned((3, 3), F32)
    run(C.gather(data.shape, idx.shape, 0, F32, I64), [dev(data), dev(idx), out])
    got = host(out, F32)
    assert np.isnan(got[1]).all() and np.array_equal(got[[0, 2]], data[[0, -1]])


def test_scatter_nd() -> None:
    data = rand((6, 4), F32)
    idx = np.array([[4], [0], [2]], dtype=np.int64)
    upd = rand((3, 4), F32)
    out = poisoned((6, 4), F32)
    for s, src in zip(C.scatter_nd(data.shape, idx.shape, F32, I64), [data, upd]):
        run(s, [dev(src), out] if s.index is None else [dev(src), dev(idx), out])
    assert np.array_equal(host(out, F32), R.IMPL[O.Op.SCATTER_ND](None, data, idx, upd))


# ---- attention -------------------------------------------------------------------------------

def attention_ref(q, k, v, scale, causal, mask=None, mask_kind="none"):  # noqa: ANN001, ANN201
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    B, Hq, Sq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    k = np.repeat(k, Hq // Hkv, axis=1)
    v = np.repeat(v, Hq // Hkv, axis=1)
    s = np.einsum("bhsd,bhtd->bhst", q, k) * scale
    if mask_kind == "additive":
        s = s + mask.astype(np.float64)
    elif mask_kind == "bool":
        s = np.where(mask, s, -np.inf)
    if causal:
        i = np.arange(Sq)[:, None]
        j = np.arange(T)[None, :]
        s = np.where(j <= i + (T - Sq), s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    return np.einsum("bhst,bhtd->bhsd", p / p.sum(-1, keepdims=True), v)


ATTN = [
    # dt, B, Hq, Hkv, S, T, D, causal, mask
    (F16, 2, 4, 4, 128, 128, 64, False, "additive"),   # BERT-like padding mask (a key row for all queries, 16-byte copies)
    (BF16, 2, 3, 3, 100, 160, 64, False, "bool"),      # a bool key mask by 16-byte copies, the last query block partial
    (BF16, 1, 8, 2, 77, 77, 128, True, "none"),        # GQA prefill, S not a tile multiple
    (F16, 2, 4, 1, 70, 70, 80, True, "bool"),          # MQA, head_dim 80, causal + padding
    (BF16, 2, 16, 8, 1, 300, 128, True, "none"),       # decode against a KV cache
    (F16, 1, 2, 2, 33, 129, 32, False, "additive"),    # a key mask copied by element (258-byte rows)
    (F32, 2, 4, 2, 45, 45, 80, True, "additive"),
    (F32, 1, 2, 2, 9, 70, 64, False, "none"),
    (BF16, 1, 16, 8, 128, 128, 128, True, "none"),     # Qwen3-0.6B's prefill of 128 tokens
    (BF16, 2, 4, 2, 150, 333, 64, True, "none"),       # a prompt after a cache: 6 key tiles through 2 stages
    (F16, 1, 3, 3, 200, 200, 128, False, "bool"),      # 4 key tiles, padding mask
    (BF16, 1, 16, 8, 128, 128, 128, False, "rows"),    # a generation prefill's causal mask, a row a query
    (F16, 2, 4, 2, 77, 140, 64, False, "rows"),        # 3 key tiles, a row a query (280-byte rows: copied by element)
    (BF16, 1, 4, 4, 72, 200, 64, False, "rows"),       # 16-byte copies, the last one partial (200 = 3 x 64 + 8)
]
# fp16/bf16 cases take each block shape (query warps; the rest split each key tile) at 64-key tiles and, where a
# split keeps 16 keys, 32-key tiles (AttentionSpec.bn); fp32 its one form
ATTN_Q = [(*a, qw, bn) for a in ATTN for qw in ((1, 2, 4) if a[0] != F32 else (4,))
          for bn in ((64, 32) if a[0] != F32 and qw > 1 else (0,))]


@pytest.mark.parametrize("dt,B,Hq,Hkv,Sq,T,D,causal,mask,qwarps,bn", ATTN_Q,
                         ids=[f"{a[0].value}-D{a[6]}-S{a[4]}-T{a[5]}-{a[8]}{'-causal' if a[7] else ''}-qw{a[9]}-bn{a[10]}"
                              for a in ATTN_Q])
def test_attention(dt: DType, B: int, Hq: int, Hkv: int, Sq: int, T: int, D: int, causal: bool, mask: str,
                   qwarps: int, bn: int) -> None:
    q, k, v = rand((B, Hq, Sq, D), dt), rand((B, Hkv, T, D), dt), rand((B, Hkv, T, D), dt)
    scale = 1.0 / math.sqrt(D)
    args = [dev(q), dev(k), dev(v)]
    m = None
    kw: dict = {}
    if mask == "additive":
        keep = RNG.random((B, 1, 1, T)) < 0.8
        keep[..., 0] = True  # every row keeps a key (an all-masked row is NaN in both)
        m = np.where(keep, 0.0, np.finfo(np.float16).min).astype(dt.np)
        kw = dict(mask="additive", mask_dtype=dt, mask_strides=(T, 0, 0, 1))
    elif mask == "bool":
        m = RNG.random((B, 1, 1, T)) < 0.8
        m[..., 0] = True
        kw = dict(mask="bool", mask_dtype=BOOL, mask_strides=(T, 0, 0, 1))
    elif mask == "rows":  # [B, 1, S, T]: a causal pattern (bottom-right) with random holes, finfo.min where hidden
        keep = (np.arange(T)[None, :] <= np.arange(Sq)[:, None] + (T - Sq)) & (RNG.random((B, 1, Sq, T)) < 0.9)
        keep[..., 0] = True
        m = np.where(keep, 0.0, np.finfo(np.float16).min).astype(dt.np)
        kw = dict(mask="additive", mask_dtype=dt, mask_strides=(Sq * T, 0, T, 1))
    if m is not None:
        args.append(dev(m))  # 16-byte copies of the mask's tiles where its rows allow them, as the lowering decides
        kw["mask_vec"] = dt != F32 and S.mask_rows_16(kw["mask_strides"], kw["mask_dtype"])
    out = poisoned((B, Hq, Sq, D), dt)
    run(S.AttentionSpec(B, Hq, Hkv, Sq, T, D, dt, scale, causal=causal, qwarps=qwarps, bn=bn, **kw), args + [out])
    check(host(out, dt), attention_ref(q, k, v, scale, causal, m, "additive" if mask == "rows" else mask), dt)


@pytest.mark.parametrize("stages", [1, 2])
def test_attention_stages_over_many_key_tiles(stages: int) -> None:
    """The K/V ring at both depths over 5 key tiles (a causal prompt after a cache): one stage refilled after every
    warp's step (a forced ``stages``), or two."""
    B, Hq, Hkv, Sq, T, D = 1, 4, 2, 40, 300, 128
    q, k, v = rand((B, Hq, Sq, D), BF16), rand((B, Hkv, T, D), BF16), rand((B, Hkv, T, D), BF16)
    out = poisoned((B, Hq, Sq, D), BF16)
    run(S.AttentionSpec(B, Hq, Hkv, Sq, T, D, BF16, 0.088, causal=True, qwarps=2, stages=stages),
        [dev(q), dev(k), dev(v), out])
    check(host(out, BF16), attention_ref(q, k, v, 0.088, True, None, "none"), BF16)


def test_attention_bshd_strides() -> None:
    """q/k/v/out laid out [B, S, H, D] (no transposes needed around the kernel)."""
    B, H, Sq, D = 2, 4, 50, 64
    q, k, v = (rand((B, Sq, H, D), F16) for _ in range(3))
    st = (Sq * H * D, D, H * D)
    out = poisoned((B, Sq, H, D), F16)
    run(S.AttentionSpec(B, H, H, Sq, Sq, D, F16, 0.125, causal=True, q_strides=st, k_strides=st, v_strides=st,
                        o_strides=st), [dev(q), dev(k), dev(v), out])
    tr = lambda a: a.transpose(0, 2, 1, 3)
    check(tr(host(out, F16)), attention_ref(tr(q), tr(k), tr(v), 0.125, True), F16)


ATTN_F32 = [
    # B, Hq, Hkv, S, T, D, causal, mask
    (8, 12, 12, 128, 128, 64, True, "additive"),  # GPT-2 small's layer (BN 64)
    (2, 8, 2, 77, 77, 128, True, "none"),          # GQA, head_dim 128 (BN 32), S not a tile multiple
    (2, 4, 1, 70, 93, 32, False, "bool"),          # MQA, T not a tile multiple, padding mask
    (1, 2, 2, 1, 300, 64, True, "none"),           # one query row against 300 keys
]
# 3xTF32 keeps fp32 accuracy (the reference is float64); one tf32 product rounds inputs to 10 bits.
F32_MATH_TOL = {"3xtf32": 1e-5, "simt": 1e-5, "tf32": 3e-3}


@pytest.mark.parametrize("math_", ["3xtf32", "tf32", "simt"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,T,D,causal,mask", ATTN_F32,
                         ids=[f"D{a[5]}-S{a[3]}-T{a[4]}-{a[7]}{'-causal' if a[6] else ''}" for a in ATTN_F32])
def test_attention_fp32_math(math_: str, B: int, Hq: int, Hkv: int, Sq: int, T: int, D: int, causal: bool,
                             mask: str) -> None:
    """fp32 attention on tf32 tensor cores (split into big + small parts, or one tf32 product) and
    on the SIMT path, against a float64 reference."""
    q, k, v = rand((B, Hq, Sq, D), F32), rand((B, Hkv, T, D), F32), rand((B, Hkv, T, D), F32)
    scale = 1.0 / math.sqrt(D)
    args, m, kw = [dev(q), dev(k), dev(v)], None, {}
    if mask != "none":
        keep = RNG.random((B, 1, 1, T)) < 0.8
        keep[..., 0] = True
        m = keep if mask == "bool" else np.where(keep, 0.0, -1e4).astype(np.float32)
        kw = dict(mask=mask, mask_dtype=BOOL if mask == "bool" else F32, mask_strides=(T, 0, 0, 1))
        args.append(dev(m))
    out = poisoned((B, Hq, Sq, D), F32)
    run(S.AttentionSpec(B, Hq, Hkv, Sq, T, D, F32, scale, causal=causal, fp32_math=math_, **kw), args + [out])
    err = rel_err(host(out, F32), attention_ref(q, k, v, scale, causal, m, mask))
    assert err <= F32_MATH_TOL[math_], f"{math_}: relative error {err:.3e} > {F32_MATH_TOL[math_]:.0e}"


# ---- gemm / gemv -------------------------------------------------------------------------------

def epilogue_ref(acc, bias, act, res, dt):  # noqa: ANN001, ANN201
    rd = lambda a: a.astype(dt.np).astype(np.float64)
    y = rd(acc)
    if bias is not None:
        y = rd(y + bias.astype(np.float64))
    if act == "relu":
        y = rd(np.maximum(y, 0))
    elif act == "gelu":
        y = rd(R.IMPL[O.Op.GELU](O.GeluAttrs(), y.astype(np.float32)).astype(np.float64))
    elif act == "gelu_tanh":
        y = rd(R.IMPL[O.Op.GELU](O.GeluAttrs("tanh"), y.astype(np.float32)).astype(np.float64))
    elif act == "silu":
        y = rd(y / (1 + np.exp(-y)))
    if res is not None:
        y = y + res.astype(np.float64)
    return y


GEMM = [
    # dt, M, N, K, batch, trans_a, trans_b, bias, act, residual
    (F16, 128, 256, 64, 1, False, False, False, "none", False),
    (F16, 1000, 2304, 768, 1, False, False, True, "gelu_tanh", False),   # big tiles
    (BF16, 77, 130, 72, 1, False, True, True, "silu", True),             # odd M, N
    (BF16, 33, 17, 13, 2, False, False, False, "none", False),           # K, N % 8 != 0
    (F16, 45, 64, 40, 3, True, True, False, "relu", False),              # trans A (element copies)
    (F32, 70, 90, 37, 2, False, True, True, "gelu", True),
    (F32, 64, 64, 64, 1, True, False, False, "none", False),
]


@pytest.mark.parametrize("dt,M,N,K,batch,ta,tb,bias,act,res", GEMM, ids=[f"{g[0].value}-{g[1]}x{g[2]}x{g[3]}-b{g[4]}{'-ta' if g[5] else ''}{'-tb' if g[6] else ''}-{g[8]}" for g in GEMM])
def test_gemm(dt: DType, M: int, N: int, K: int, batch: int, ta: bool, tb: bool, bias: bool, act: str, res: bool) -> None:
    a = rand((batch, K, M) if ta else (batch, M, K), dt)
    b = rand((batch, N, K) if tb else (batch, K, N), dt)
    bv = rand((N,), dt) if bias else None
    rv = rand((batch, M, N), dt) if res else None
    out = poisoned((batch, M, N), dt)
    spec = S.GemmSpec(M, N, K, dt, batch=batch, trans_a=ta, trans_b=tb,
                      epilogue=S.Epilogue(bias=bias, activation=act, residual=res))
    run(spec, [dev(a), dev(b)] + ([dev(bv)] if bias else []) + ([dev(rv)] if res else []) + [out])
    af = a.astype(np.float64).transpose(0, 2, 1) if ta else a.astype(np.float64)
    bf = b.astype(np.float64).transpose(0, 2, 1) if tb else b.astype(np.float64)
    ref = epilogue_ref(af @ bf, bv, act, rv, dt)
    check(host(out, dt), ref, dt)


GEMM_STREAM = [
    # dt, M, N, K, splits, bias, act, residual: the stream form (M <= 128, B [K, N] read once), K split over clusters
    (BF16, 128, 4096, 1024, 4, False, "none", False),   # Qwen3-0.6B's QKV at a 128-token prefill
    (BF16, 128, 1024, 3072, 8, False, "none", True),    # its down product + residual: 8 blocks a cluster
    (F16, 77, 1000, 320, 1, True, "gelu", True),        # M and N not tile multiples, 5 K slices, no split
    (F16, 100, 200, 512, 2, True, "silu", False),       # two splits, the last column tile partial
    (BF16, 32, 2048, 2048, 4, False, "none", True),     # a 32-token prefill: 32-row blocks
    (F16, 5, 136, 128, 2, False, "none", False),        # 5 rows; K's share one slice a block
]


@pytest.mark.parametrize("dt,M,N,K,splits,bias,act,res", GEMM_STREAM,
                         ids=[f"{g[0].value}-{g[1]}x{g[2]}x{g[3]}-s{g[4]}-{g[6]}" for g in GEMM_STREAM])
def test_gemm_stream(dt: DType, M: int, N: int, K: int, splits: int, bias: bool, act: str, res: bool) -> None:
    from fusec.device import gpu_arch

    if splits > 1 and int(gpu_arch()[3:]) < 90:
        pytest.skip("K splits need thread-block clusters (sm_90)")
    a, b = rand((M, K), dt), rand((K, N), dt)
    bv = rand((N,), dt) if bias else None
    rv = rand((M, N), dt) if res else None
    out = poisoned((M, N), dt)
    spec = S.GemmSpec(M, N, K, dt, splits=splits, epilogue=S.Epilogue(bias=bias, activation=act, residual=res))
    assert spec.stream
    run(spec, [dev(a), dev(b)] + ([dev(bv)] if bias else []) + ([dev(rv)] if res else []) + [out])
    ref = epilogue_ref(a.astype(np.float64) @ b.astype(np.float64), bv, act, rv, dt)
    check(host(out, dt), ref, dt)


@pytest.mark.parametrize("bn", [0, 32, 128], ids=["bn-rule", "bn32", "bn128"])
@pytest.mark.parametrize("dt,M,N,K,splits,bias,act,res", GEMM_STREAM,
                         ids=[f"{g[0].value}-{g[1]}x{g[2]}x{g[3]}-s{g[4]}-{g[6]}" for g in GEMM_STREAM])
def test_gemm_wgmma(dt: DType, M: int, N: int, K: int, splits: int, bias: bool, act: str, res: bool, bn: int) -> None:
    """The stream form's blocking on wgmma (sm_90 only: an sm_90a cubin), B the weight stored [N, K], at the tiling
    rule's columns a block (build_gemm.wgmma_tiling) and at 32 and 128 (m64n16 to m64n128 instructions)."""
    from fusec.device import gpu_arch

    if gpu_arch() != "sm_90":
        pytest.skip("wgmma is sm_90a")
    a, b = rand((M, K), dt), rand((N, K), dt)
    bv = rand((N,), dt) if bias else None
    rv = rand((M, N), dt) if res else None
    out = poisoned((M, N), dt)
    spec = S.GemmSpec(M, N, K, dt, trans_b=True, splits=splits, wgmma=True, bn=bn,
                      epilogue=S.Epilogue(bias=bias, activation=act, residual=res))
    run(spec, [dev(a), dev(b)] + ([dev(bv)] if bias else []) + ([dev(rv)] if res else []) + [out])
    ref = epilogue_ref(a.astype(np.float64) @ b.astype(np.float64).T, bv, act, rv, dt)
    check(host(out, dt), ref, dt)


GEMM_GLU = [
    # dt, M, N (both halves), K, splits, bn, act, swap: the wgmma form's gated epilogue (a SwiGLU after gate/up)
    (BF16, 128, 6144, 1024, 1, 0, "silu", False),   # Qwen3-0.6B's gate/up at a 128-token prefill, the rule's tiling
    (BF16, 32, 16384, 2048, 2, 64, "silu", False),  # Llama-1B's at 32 tokens, split over a cluster of 2
    (F16, 77, 1000, 320, 1, 32, "gelu", True),      # rows and a half (500) not tile multiples; the second half activated
    (F16, 5, 136, 512, 4, 128, "silu", False),      # 5 rows, a 128-column tile over halves of 68
]


@pytest.mark.parametrize("dt,M,N,K,splits,bn,act,swap", GEMM_GLU,
                         ids=[f"{g[0].value}-{g[1]}x{g[2]}x{g[3]}-s{g[4]}-bn{g[5]}-{g[6]}" for g in GEMM_GLU])
def test_gemm_wgmma_gated(dt: DType, M: int, N: int, K: int, splits: int, bn: int, act: str, swap: bool) -> None:
    """The wgmma form with a gated unit as its epilogue: C = act(y[:, :F]) * y[:, F:] (swapped: act of the second
    half), y = A @ B^T rounded, then each step rounded as the unfused nodes store it."""
    from fusec.device import gpu_arch

    if gpu_arch() != "sm_90":
        pytest.skip("wgmma is sm_90a")
    a, b = rand((M, K), dt), rand((N, K), dt)
    out = poisoned((M, N // 2), dt)
    run(S.GemmSpec(M, N, K, dt, trans_b=True, splits=splits, wgmma=True, bn=bn, glu=act, glu_swap=swap),
        [dev(a), dev(b), out])
    y = a.astype(np.float64) @ b.astype(np.float64).T
    first, second = y[:, :N // 2], y[:, N // 2:]
    gated = epilogue_ref(second if swap else first, None, act, None, dt)
    ref = (gated * (first if swap else second).astype(dt.np).astype(np.float64)).astype(dt.np)
    check(host(out, dt), ref.astype(np.float64), dt)


def test_gemm_broadcast_b_over_batch() -> None:
    a, b = rand((3, 50, 64), F16), rand((64, 40), F16)
    out = poisoned((3, 50, 40), F16)
    run(S.GemmSpec(50, 40, 64, F16, batch=3, b_batch_stride=0), [dev(a), dev(b), out])
    check(host(out, F16), a.astype(np.float64) @ b.astype(np.float64), F16)
