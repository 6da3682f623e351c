"""Kernels and plans over packed quantized weights on the GPU (skipped without one), against the
numpy reference: the quantized GEMV for every format at odd sizes and M = 1..16 (epilogues too),
the prefill's dequantization, plans taking both paths, and generation from packed weights (a
Q4_K_M-like mix of random blocks; fusec's --quantize int4/int8) equal to the reference token for
token in fp32. Fresh random data each run; outputs poisoned before each launch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_decode_kernels_gpu import dev, host, poisoned
from test_quant_kernels import sample_weight

from fusec import quant
from fusec.codegen import kernels as K
from fusec.codegen.build_quant import packed_params
from fusec.codegen.specs import Epilogue
from fusec.codegen.specs_quant import QDequantSpec, QGemmSpec, QGemvSpec, dp4a_fits
from fusec.dtypes import DType
from fusec.runtime.generation import generate_with_plan

pytestmark = pytest.mark.gpu

F16, BF16, F32 = DType.F16, DType.BF16, DType.F32
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1e-2}
RNG = np.random.default_rng()


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(o).any(), f"{int(np.isnan(o).sum())} outputs never written (NaN)"
    return float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))


def _run(spec: object, args: list) -> None:  # noqa: ANN001
    import cupy as cp

    K.launch(K.build(spec), args)
    cp.cuda.runtime.deviceSynchronize()


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("fold", [False, True])
def test_qgemv_matches_reference(fmt, m, fold):
    n, k = 77, 768  # odd N; K three K-quant super-blocks, 24 chunks (fewer than a warp's lanes)
    qw = sample_weight(fmt, n, k, RNG)
    for dt in (F32, BF16):
        x = RNG.standard_normal((m, k)).astype(np.float32).astype(dt.np)
        ref = x.astype(np.float32) @ qw.dequantize().T
        out = poisoned((m, n), dt)
        spec = QGemvSpec(m, n, k, fmt, qw.group, dt, qw.scale_dtype, rows=2 if m <= 8 else 1, fold=fold)
        _run(spec, [dev(x), *[dev(a) for a in qw.arrays], out])
        assert rel_err(host(out, dt), ref) <= TOL[dt], (fmt, m, dt)


@pytest.mark.parametrize("fmt,rows,fold", [("uint4", 1, False), ("q4_k", 2, False), ("q6_k", 4, False),
                                            ("q4_k", 2, True), ("q4_1", 1, True)])
def test_qgemv_epilogue_and_long_rows(fmt, rows, fold):
    """bias + SiLU + residual in the epilogue; K = 11008 (several rounds of chunks per lane)."""
    m, n, k = 5, 83, 11008
    qw = sample_weight(fmt, n, k, RNG)
    x = RNG.standard_normal((m, k)).astype(np.float32)
    bias, res = RNG.standard_normal(n).astype(np.float32), RNG.standard_normal((m, n)).astype(np.float32)
    y = x @ qw.dequantize().T + bias
    ref = y / (1 + np.exp(-y)) + res
    out = poisoned((m, n), F32)
    spec = QGemvSpec(m, n, k, fmt, qw.group, F32, qw.scale_dtype, Epilogue(True, "silu", True), rows=rows, fold=fold)
    _run(spec, [dev(x), *[dev(a) for a in qw.arrays], dev(bias), dev(res), out])
    assert rel_err(host(out, F32), ref) <= 1e-5


def _norm_ref(x: np.ndarray, g: np.ndarray, eps: float, off: float, dt: DType) -> np.ndarray:
    """RMSNORM as the kernels compute it: x * (1 / sqrt(mean(x^2) + eps)) rounded, times (g + off) rounded."""
    xf = x.astype(np.float32)
    inv = np.float32(1.0) / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.float32(eps))
    n = (xf * inv).astype(dt.np).astype(np.float32)
    return ((g.astype(np.float32) + np.float32(off)) * n).astype(dt.np).astype(np.float32)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_qgemv_norm_prologue_and_gated_epilogue(fmt, m):
    """The FMA form with x RMS-normalized in the block (norm) and the two halves of a gated unit
    (glu: rows j and F + j a warp), with bias and residual; odd F, fp32 and bf16, against numpy over
    the reference's weights (the norm rounded as RMSNORM stores it, the epilogue as the unfused
    nodes round)."""
    f = 77
    n, k = 2 * f, 768
    qw = sample_weight(fmt, n, k, RNG)
    w = qw.dequantize().astype(np.float32)
    for dt in (F32, BF16):
        rd = (lambda a: a.astype(dt.np).astype(np.float32)) if dt != F32 else (lambda a: a.astype(np.float32))
        x = RNG.standard_normal((m, k)).astype(np.float32).astype(dt.np)
        g = (RNG.random(k) + 0.5).astype(np.float32).astype(dt.np)
        bias = RNG.standard_normal(n).astype(np.float32).astype(dt.np)
        res = RNG.standard_normal((m, f)).astype(np.float32).astype(dt.np)
        xn = _norm_ref(x, g, 1e-5, 1.0, dt)
        for swap in (False, True):
            y = xn @ w.T
            first, second = rd(rd(y[:, :f]) + bias[:f].astype(np.float32)), rd(rd(y[:, f:]) + bias[f:].astype(np.float32))
            if swap:
                first, second = second, first
            with np.errstate(over="ignore"):  # exp(-first) of a large negative first: inf, silu 0 (as the kernel's)
                ref = rd(rd(first / (1 + np.exp(-first))) * second) + res.astype(np.float32)
            out = poisoned((m, f), dt)
            spec = QGemvSpec(m, n, k, fmt, qw.group, dt, qw.scale_dtype, Epilogue(bias=True, residual=True),
                             norm=True, eps=1e-5, weight_offset=1.0, glu="silu", glu_swap=swap)
            _run(spec, [dev(x), *[dev(a) for a in qw.arrays], dev(g), dev(bias), dev(res), out])
            assert rel_err(host(out, dt), ref) <= TOL[dt], (fmt, m, dt, swap)
        # the norm alone over all N rows (no gated unit), N not a multiple of a block's 8 rows
        out = poisoned((m, n - 3), dt)
        q3 = sample_weight(fmt, n - 3, k, RNG)
        spec = QGemvSpec(m, n - 3, k, fmt, q3.group, dt, q3.scale_dtype, norm=True, eps=1e-5)
        _run(spec, [dev(x), *[dev(a) for a in q3.arrays], dev(g), out])
        ref = _norm_ref(x, g, 1e-5, 0.0, dt) @ q3.dequantize().astype(np.float32).T
        assert rel_err(host(out, dt), ref) <= TOL[dt], (fmt, m, dt, "norm")


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("blocks", [2, 1])
def test_dp4a_qgemv_matches_reference(fmt, m, blocks):
    """The dp4a form (x as one 16-bit integer a value in two bytes, per 32 values; integer dot products) against numpy
    over quant.dp4a_blocks(x): plain at odd N with a task loop (N past the grid's warps) and long rows (several
    rounds of chunks a lane), bias + SiLU + residual; the norm prologue with a gated unit (both orders);
    fp16 and bf16; 2 blocks of 8 warps an SM and 1. And against the exact product within the same tolerance
    (x's step is max|x| / 32767 a block of 32)."""
    for dt in (F16, BF16):
        rd = lambda a: a.astype(dt.np).astype(np.float32)  # noqa: E731
        for n, k in ((4501, 768), (83, next(k for k in (11008, 8192, 4096, 2048) if dp4a_fits(m, k, False, dt)))):
            qw = sample_weight(fmt, n, k, RNG)
            w = qw.dequantize().astype(np.float32)
            x = RNG.standard_normal((m, k)).astype(np.float32).astype(dt.np)
            bias = RNG.standard_normal(n).astype(np.float32).astype(dt.np)
            res = RNG.standard_normal((m, n)).astype(np.float32).astype(dt.np)
            out = poisoned((m, n), dt)
            spec = QGemvSpec(m, n, k, fmt, qw.group, dt, qw.scale_dtype, Epilogue(True, "silu", True), dp4a=True,
                             blocks=blocks)
            _run(spec, [dev(x), *[dev(a) for a in qw.arrays], dev(bias), dev(res), out])
            y = rd(rd(quant.dp4a_blocks(x) @ w.T) + bias.astype(np.float32))
            ref = rd(y / (1 + np.exp(-y))) + res.astype(np.float32)
            got = host(out, dt)
            assert rel_err(got, ref) <= TOL[dt], (fmt, m, dt, n, k)
            y = x.astype(np.float32) @ w.T + bias.astype(np.float32)
            assert rel_err(got, y / (1 + np.exp(-y)) + res.astype(np.float32)) <= TOL[dt], (fmt, m, dt, n, k, "exact")
        f, k = 1501, 2048
        qw = sample_weight(fmt, 2 * f, k, RNG)
        w = qw.dequantize().astype(np.float32)
        x = RNG.standard_normal((m, k)).astype(np.float32).astype(dt.np)
        # g + 1 in [0.05, 0.15]: the gated unit's y * silu(y) stays well inside fp16's range with int8's large weights
        g = (RNG.random(k) * 0.1 - 0.95).astype(np.float32).astype(dt.np)
        xh = quant.dp4a_blocks(_norm_ref(x, g, 1e-5, 1.0, dt))
        for swap in (False, True):
            y = rd(xh @ w.T)
            first, second = (y[:, f:], y[:, :f]) if swap else (y[:, :f], y[:, f:])
            with np.errstate(over="ignore"):
                ref = rd(rd(first / (1 + np.exp(-first))) * second)
            out = poisoned((m, f), dt)
            spec = QGemvSpec(m, 2 * f, k, fmt, qw.group, dt, qw.scale_dtype, dp4a=True, norm=True, eps=1e-5, blocks=blocks,
                             weight_offset=1.0, glu="silu", glu_swap=swap)
            _run(spec, [dev(x), *[dev(a) for a in qw.arrays], dev(g), out])
            assert rel_err(host(out, dt), ref) <= TOL[dt], (fmt, m, dt, swap, "norm+glu")


def _dp4a_bits_alike(fmt: str, m: int, n: int, k: int, variants: list[dict], epi: Epilogue = Epilogue(),
                     norm: bool = False, glu: str = "", **common) -> None:
    """The dp4a kernel once per entry of ``variants`` (QGemvSpec keywords, beside ``common``) on the same random
    bf16 operands (the norm's weights with ``norm``, bias and residual with ``epi``): the first output finite, the
    others equal to it bit for bit."""
    dt = BF16
    qw = sample_weight(fmt, n, k, RNG)
    args = [dev(RNG.standard_normal((m, k)).astype(np.float32).astype(dt.np)), *[dev(a) for a in qw.arrays]]
    if norm:
        args.append(dev((RNG.random(k) * 0.1 - 0.95).astype(np.float32).astype(dt.np)))
    if epi.bias:
        args += [dev(RNG.standard_normal(n).astype(np.float32).astype(dt.np)),
                 dev(RNG.standard_normal((m, n)).astype(np.float32).astype(dt.np))]
    outs = []
    for v in variants:
        out = poisoned((m, n // 2 if glu else n), dt)
        spec = QGemvSpec(m, n, k, fmt, qw.group, dt, qw.scale_dtype, epi, dp4a=True, norm=norm, glu=glu, eps=1e-5,
                         weight_offset=1.0 if norm else 0.0, **common, **v)
        _run(spec, args + [out])
        outs.append(host(out, dt))
    assert np.isfinite(outs[0].astype(np.float32)).all(), (fmt, m, n, k)
    for v, o in zip(variants[1:], outs[1:]):
        assert np.array_equal(o.view(np.uint16), outs[0].view(np.uint16)), (fmt, m, n, k, v)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_dp4a_eight_chunks_a_round_equal_four(fmt):
    """At one row of x, 8 chunks a lane a round (``chunks``: FUSEC_QGEMV_DP4A_CHUNKS=8) sum each lane's chunks in
    the order 4 a round does, so the bits are the same: odd N with a partial last task and tasks past the grid's
    warps, rows of 1 to 3 rounds (K 4096 at two rows a task, 11,008 at one), bias + SiLU + residual, the norm
    prologue with a gated unit."""
    chunks = [{"chunks": 4}, {"chunks": 8}]
    silu_res = Epilogue(True, "silu", True)
    _dp4a_bits_alike(fmt, 1, 4501, 4096, chunks, silu_res, rows=2)
    _dp4a_bits_alike(fmt, 1, 2051, 11008, chunks, silu_res, rows=1)
    _dp4a_bits_alike(fmt, 1, 1501 * 2, 4096, chunks, norm=True, glu="silu", rows=2)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_dp4a_two_long_rows_a_task_equal_one(fmt):
    """Long rows two a task at 4 chunks a round each (the FUSEC_QGEMV_DP4A_FILL rule where that makes fewer round
    trips: the 7B downs, K = 11,008) give chunk c to lane c % 32 and sum a lane's chunks in the order one row a task at
    8 chunks does, so the bits are the same: N odd (a last task of one row), tasks past the grid's warps, bias + SiLU
    + residual, and a norm prologue."""
    rows = [{"rows": 1, "chunks": 8}, {"rows": 2, "chunks": 8}]
    _dp4a_bits_alike(fmt, 1, 2051, 11008, rows, Epilogue(True, "silu", True))
    _dp4a_bits_alike(fmt, 1, 4097, 8192, rows, norm=True, blocks=1)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_dp4a_cluster_writes_the_same_digits(fmt):
    """A thread block cluster's blocks taking turns writing x's digits into every block's shared memory (``cluster``:
    FUSEC_QGEMV_DP4A_CLUSTER, sm_90; elsewhere the kernel ignores it) gives the bits of every block writing them all:
    long rows (K 11,008: pieces of x past 4 a thread), the norm prologue with a gated unit (K 4096) and with one piece
    a thread (K 2048, 4 rows a task), 3 rows of x, 8 rows (8-bit codes), a grid of fewer blocks than a cluster."""
    cl = [{"cluster": 1}, {"cluster": 2}, {"cluster": 4}]
    _dp4a_bits_alike(fmt, 1, 2051, 11008, cl, Epilogue(True, "silu", True), rows=2, chunks=8)
    _dp4a_bits_alike(fmt, 1, 2 * 1501, 4096, cl, norm=True, glu="silu", rows=2, chunks=8)
    _dp4a_bits_alike(fmt, 1, 4099, 2048, cl, norm=True, rows=4, chunks=8)
    _dp4a_bits_alike(fmt, 3, 1003, 4096, cl, norm=True, rows=1, chunks=4)
    _dp4a_bits_alike(fmt, 1, 24, 2048, cl, rows=2, chunks=8)
    if quant.FORMATS[fmt].bits == 8:
        _dp4a_bits_alike(fmt, 8, 1003, 2048, cl, norm=True, rows=1, chunks=2)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_dp4a_norm_weights_loaded_early_give_the_same_bits(fmt):
    """The norm's weights loaded before the PDL wait (``norm_early``, where x is one batch of a thread's pieces)
    give the bits of loading them beside x: 1-3 rows of x, a gated unit, K = 2048 and 4096 (one batch), and
    K = 8192 at 2 rows (two batches: the weights are loaded beside x either way)."""
    early = [{"norm_early": False}, {"norm_early": True}]
    for m, n, k, rows, glu in [(1, 2 * 1501, 2048, 2, "silu"), (2, 3001, 4096, 2, ""), (3, 2049, 2048, 2, ""),
                               (2, 1003, 8192, 1, "")]:
        _dp4a_bits_alike(fmt, m, n, k, early, norm=True, glu=glu, rows=rows, chunks=4)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_dp4a_four_rows_a_task_equal_two(fmt):
    """4 weight rows a task (the FUSEC_QGEMV_DP4A_FILL rule: two gated pairs, or 4 plain rows) sum each row's chunks in
    the order 2 rows a task do, so the bits are the same: an odd number of gated outputs (the last task's second pair
    past F), N not a multiple of 4, rows of one and of two rounds, the norm prologue, bias + SiLU + residual."""
    rows = [{"rows": 2}, {"rows": 4}]
    _dp4a_bits_alike(fmt, 1, 2 * 4099, 2048, rows, norm=True, glu="silu", chunks=8)
    _dp4a_bits_alike(fmt, 1, 2 * 1501, 4096, rows, glu="silu", chunks=8)
    _dp4a_bits_alike(fmt, 1, 30003, 2048, rows, norm=True, chunks=8)
    _dp4a_bits_alike(fmt, 1, 4101, 4096, rows, Epilogue(True, "silu", True), chunks=8)


@pytest.mark.parametrize("fmt", ["q8_0", "int8"])
@pytest.mark.parametrize("m", [4, 8])
def test_dp4a_four_rows_of_one_chunk_equal_one_row_of_two(fmt, m):
    """At 4-8 rows of x, 4 weight rows a task with one chunk a round each (the FUSEC_QGEMV_DP4A_WIDE_ROWS rule) sum each
    row's chunks in the order one row a task with two chunks a round does: the same bits (N not a multiple of 4,
    the norm prologue, bias + SiLU + residual, rows of one and of several rounds)."""
    wide = [{"rows": 1, "chunks": 2}, {"rows": 4, "chunks": 4}]
    _dp4a_bits_alike(fmt, m, 3001, 2048, wide, norm=True)
    _dp4a_bits_alike(fmt, m, 2050, 1024 if m == 8 else 4096, wide, Epilogue(True, "silu", True))


@pytest.mark.parametrize("norm", [False, True])
def test_dp4a_qgemv_propagates_nan(norm):
    """A NaN in one row of x makes that row's outputs NaN (its block's unit is NaN; a 0 digit would hide it),
    and leaves the other rows' finite."""
    m, n, k = 3, 301, 2048
    qw = sample_weight("q4_k", n, k, RNG)
    x = RNG.standard_normal((m, k)).astype(np.float32).astype(BF16.np)
    import cupy as cp

    x[1, 77] = np.nan
    out = cp.zeros((m, n), cp.uint16)  # zeros, not the NaN poison: a NaN must come from the kernel
    spec = QGemvSpec(m, n, k, "q4_k", qw.group, BF16, qw.scale_dtype, dp4a=True, norm=norm, eps=1e-5)
    args = [dev(x), *[dev(a) for a in qw.arrays]] + ([dev(np.ones(k, BF16.np))] if norm else []) + [out]
    _run(spec, args)
    got = host(out, BF16)
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()


TC_FORMATS = [(f, g) for f in quant.FORMATS for g in ((quant.FORMATS[f].group,) if quant.FORMATS[f].group else (16, 64))]


def _tc_weight(fmt: str, group: int, n: int, k: int) -> quant.QWeight:
    """A random [n, k] weight in ``fmt``: sampled blocks for the file formats, else fusec's affine codes in groups of
    ``group`` (int4/int8 symmetric, no zero points; uint4/uint8 with them)."""
    if quant.FORMATS[fmt].group:
        return sample_weight(fmt, n, k, RNG)
    bits = quant.FORMATS[fmt].bits
    half = 1 << (bits - 1)
    signed = fmt in ("int4", "int8")  # symmetric: int8 codes in [-half, half), no zero points
    q = RNG.integers(-half, half, (n, k)).astype(np.int8) if signed else RNG.integers(0, 2 * half, (n, k)).astype(np.uint8)
    qw = quant.from_affine(q, (RNG.random((n, k // group)) * 0.01 + 1e-3).astype(np.float16),
                           None if signed else RNG.integers(0, 2 * half, (n, k // group)).astype(np.uint8), bits)
    assert qw.format == fmt
    return qw


@pytest.mark.parametrize("fmt,group", TC_FORMATS)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 11, 16])
@pytest.mark.parametrize("warps,passes", [(4, 1), (8, 1), (16, 1), (16, 3), (4, 2), (8, 2)])
def test_tensor_core_qgemv_matches_reference(fmt, group, m, warps, passes):
    """The tensor-core form against the exact sum (float64 over the reference's weights), one tile of 8 rows of x or
    two (11 and 16 rows): within
    half an ulp of the stored type plus fp32 accumulation error, at odd N (a partial last block of
    16 rows), K not a multiple of the warps' chunks, bias + SiLU + residual; fp16 and bf16; 4-, 5-, 6-
    and 8-bit codes (signed, and unsigned with zero points) (their high words in 16-byte copies where every row's and
    warp's range is aligned, else 4-byte ones: tests/test_quant_kernels.py checks both occur here); a warp's chunks in one run or
    in 2-3 runs copied in turn (the last runs of the last warps partial or empty)."""
    n, k = 301, 1536 if quant.FORMATS[fmt].super_block else 1472  # 46 chunks (and 48): warps run out at odd places
    qw = _tc_weight(fmt, group, n, k)
    w = qw.dequantize().astype(np.float64)
    for dt in (F16, BF16):
        x = RNG.standard_normal((m, k)).astype(np.float32).astype(dt.np)
        bias = RNG.standard_normal(n).astype(np.float32).astype(dt.np)
        res = RNG.standard_normal((m, n)).astype(np.float32).astype(dt.np)
        xf = x.astype(np.float64)
        y = xf @ w.T
        out = poisoned((m, n), dt)
        spec = QGemvSpec(m, n, k, qw.format, qw.group, dt, qw.scale_dtype, Epilogue(True, "silu", True), tc=True, warps=warps,
                         passes=passes)
        _run(spec, [dev(x), *[dev(a) for a in qw.arrays], dev(bias), dev(res), out])
        got = host(out, dt).astype(np.float64)
        # the kernel rounds y, y + bias, silu(.) and the sum to dt as the unfused nodes do: compare y
        # through the same roundings from the exact sum, allowing one rounding step of slack each
        ulp = {F16: 2.0 ** -10, BF16: 2.0 ** -7}[dt]
        acc = np.abs(xf) @ np.abs(w).T * 2e-6  # fp32 accumulation of the dot products
        z = y + bias.astype(np.float64)
        want = z / (1 + np.exp(-z)) + res.astype(np.float64)
        slack = ulp * (np.abs(y) + np.abs(z) + 2 * np.abs(want) + np.abs(res.astype(np.float64))) + acc
        bad = np.abs(got - want) > slack
        assert not bad.any(), (fmt, m, dt, int(bad.sum()), float(np.abs(got - want).max()))


@pytest.mark.parametrize("fmt,group", TC_FORMATS)
@pytest.mark.parametrize("warps,passes", [(4, 1), (16, 3), (8, 2)])
@pytest.mark.parametrize("glu", ["", "silu"])
def test_tensor_core_stages_give_the_same_bits(fmt, group, warps, passes, glu):
    """A run's copy issued in 2-4 commit groups (each summed once it lands) gives the bits of one group: the same
    chunks summed in the same order, the scale table the same. At odd N and K not a multiple of the warps' chunks
    (partial and empty stages), 3, 8 and 13 rows of x, bf16, plain and gated."""
    n, k = (154, 1536) if quant.FORMATS[fmt].super_block else (154, 1472)
    qw = _tc_weight(fmt, group, n, k)
    nout = n // 2 if glu else n
    for m in (3, 8, 13):
        x = dev(RNG.standard_normal((m, k)).astype(np.float32).astype(BF16.np))
        res = dev(RNG.standard_normal((m, nout)).astype(np.float32).astype(BF16.np))
        outs = []
        for stages in (1, 2, 3, 4):
            out = poisoned((m, nout), BF16)
            spec = QGemvSpec(m, n, k, qw.format, qw.group, BF16, qw.scale_dtype, Epilogue(residual=True), tc=True,
                             warps=warps, passes=passes, stages=stages, glu=glu)
            _run(spec, [x, *[dev(a) for a in qw.arrays], res, out])
            outs.append(host(out, BF16))
        assert np.isfinite(outs[0].astype(np.float32)).all(), (fmt, m)
        for stages, got in zip((2, 3, 4), outs[1:]):
            assert np.array_equal(got.view(np.uint16), outs[0].view(np.uint16)), (fmt, group, m, stages)


@pytest.mark.parametrize("fmt,group", TC_FORMATS)
@pytest.mark.parametrize("warps,passes", [(4, 1), (8, 2), (16, 3)])
@pytest.mark.parametrize("glu", ["", "silu"])
def test_tensor_core_two_tiles_of_x_give_each_tiles_bits(fmt, group, warps, passes, glu):
    """Past 8 rows of x the tensor-core form multiplies each chunk's decoded weights with two tiles of 8 rows: every
    output row is bit for bit what the one-tile kernel gives for the same row of x (the same chunks, summed in the
    same order), at 16 rows and at 13 (a partial second tile), bf16, plain and gated, odd N."""
    n, k = (154, 1536) if quant.FORMATS[fmt].super_block else (154, 1472)
    qw = _tc_weight(fmt, group, n, k)
    nout = n // 2 if glu else n
    arrays = [dev(a) for a in qw.arrays]
    for m in (16, 13):
        x = RNG.standard_normal((m, k)).astype(np.float32).astype(BF16.np)
        res = RNG.standard_normal((m, nout)).astype(np.float32).astype(BF16.np)

        def run(xs: np.ndarray, rs: np.ndarray) -> np.ndarray:
            out = poisoned((len(xs), nout), BF16)
            spec = QGemvSpec(len(xs), n, k, qw.format, qw.group, BF16, qw.scale_dtype, Epilogue(residual=True),
                             tc=True, warps=warps, passes=passes, glu=glu)
            _run(spec, [dev(np.ascontiguousarray(xs)), *arrays, dev(np.ascontiguousarray(rs)), out])
            return host(out, BF16)
        both = run(x, res)
        halves = np.concatenate([run(x[:8], res[:8]), run(x[8:], res[8:])])
        assert np.isfinite(both.astype(np.float32)).all(), (fmt, m)
        assert np.array_equal(both.view(np.uint16), halves.view(np.uint16)), (fmt, group, m, warps, passes, glu)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q5_0", "q8_0", "uint4", "int8"])
@pytest.mark.parametrize("m", [3, 5, 8, 12, 16])
@pytest.mark.parametrize("warps,passes", [(4, 1), (16, 3)])
def test_tensor_core_gated_epilogue_matches_reference(fmt, m, warps, passes):
    """The tensor-core form with a gated unit (8 rows of each half a block) and bias + residual, both halves activated
    in turn, odd F (a partial last block), fp16 and bf16, against numpy over the reference's weights, the epilogue
    rounded as the unfused nodes round."""
    f = 77
    n, k = 2 * f, 1536 if quant.FORMATS[fmt].super_block else 1472
    qw = sample_weight(fmt, n, k, RNG)
    w = qw.dequantize().astype(np.float32)
    for dt in (F16, BF16):
        def rd(a: np.ndarray, dt: DType = dt) -> np.ndarray:
            return a.astype(dt.np).astype(np.float32)
        x = RNG.standard_normal((m, k)).astype(np.float32).astype(dt.np)
        bias = RNG.standard_normal(n).astype(np.float32).astype(dt.np)
        res = RNG.standard_normal((m, f)).astype(np.float32).astype(dt.np)
        y = x.astype(np.float32) @ w.T
        for swap in (False, True):
            first, second = rd(rd(y[:, :f]) + bias[:f].astype(np.float32)), rd(rd(y[:, f:]) + bias[f:].astype(np.float32))
            if swap:
                first, second = second, first
            with np.errstate(over="ignore"):
                ref = rd(rd(first / (1 + np.exp(-first))) * second) + res.astype(np.float32)
            out = poisoned((m, f), dt)
            spec = QGemvSpec(m, n, k, fmt, qw.group, dt, qw.scale_dtype, Epilogue(bias=True, residual=True), tc=True,
                             warps=warps, passes=passes, glu="silu", glu_swap=swap)
            _run(spec, [dev(x), *[dev(a) for a in qw.arrays], dev(bias), dev(res), out])
            assert rel_err(host(out, dt), ref) <= TOL[dt], (fmt, m, dt, swap)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
def test_dequantize_kernel_matches_reference(fmt):
    n, k = 53, 512  # 20 rows of 16 chunks: the second block's first two warps hold 64, its six others none
    qw = sample_weight(fmt, n, k, RNG)
    out = poisoned((20, k), F32)
    _run(QDequantSpec(n, k, fmt, qw.group, F32, qw.scale_dtype, row0=30, rows=20),
         [*[dev(a) for a in qw.arrays], out])
    got, want = host(out, F32), qw.dequantize(30, 50)
    if quant.FORMATS[fmt].offset == "none":
        np.testing.assert_array_equal(got, want)  # s * (q - z): the reference's two roundings
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-7 * max(1.0, float(np.abs(want).max())))
    assert len(packed_params(fmt)) == len(qw.arrays)


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0", "q5_1"])
def test_gather_kernel_matches_reference(fmt):
    n, k = 300, 512
    qw = sample_weight(fmt, n, k, RNG)
    ids = np.array([0, 299, -1, 17, 300, -301, 17], np.int64)  # the last-but-two ids are out of range: NaN rows
    out = poisoned((len(ids), k), BF16)  # 7 rows of 16 chunks: a partial warp
    _run(QDequantSpec(n, k, fmt, qw.group, BF16, qw.scale_dtype, ids=len(ids)),
         [dev(ids), *[dev(a) for a in qw.arrays], out])
    got = host(out, BF16).astype(np.float32)
    ok = [0, 1, 2, 3, 6]
    want = qw.dequantize()[ids[ok]].astype(BF16.np).astype(np.float32)
    np.testing.assert_allclose(got[ok], want, rtol=1e-2, atol=1e-3 * np.abs(want).max())
    assert np.isnan(got[[4, 5]]).all()


def _rounded_weights(qw, dt: DType) -> np.ndarray:  # noqa: ANN001
    """The weights as the prefill's dequantizing kernel writes them: the format's fp32 values rounded to ``dt``."""
    out = poisoned((qw.n, qw.k), dt)
    _run(QDequantSpec(qw.n, qw.k, qw.format, qw.group, dt, qw.scale_dtype), [*[dev(a) for a in qw.arrays], out])
    return host(out, dt).astype(np.float32)


@pytest.mark.parametrize("fmt", list(quant.FORMATS))
@pytest.mark.parametrize("m,tiling", [(17, (3, 1, 4, 1)), (40, (5, 2, 2, 1)), (130, (8, 4, 1, 1)), (100, (16, 1, 2, 1)),
                                      (45, (6, 4, 1, 4)), (70, (4, 4, 1, 8))])
def test_tile_gemm_matches_the_scratch_paths_weights(fmt, m, tiling):
    """The dequantize-in-tile GEMM against x @ W^T with W as the scratch path's dequantizing kernel writes it (the
    same rounded weights; only the order of the fp32 sums differs): odd N (a partial block of weight rows), rows of x
    past a block's (partial y blocks), K tiles that do not divide evenly among the K warps, K split over clusters of
    4 and 8 blocks (some with no k tile at K = 320), bf16 and fp16."""
    mt, rw, kw, ks = tiling
    n = 77
    k = 1280 if quant.FORMATS[fmt].super_block else 320
    qw = sample_weight(fmt, n, k, RNG)
    for dt in (BF16, F16):
        w = _rounded_weights(qw, dt)
        x = RNG.standard_normal((m, k)).astype(np.float32).astype(dt.np)
        ref = x.astype(np.float32) @ w.T
        out = poisoned((m, n), dt)
        _run(QGemmSpec(m, n, k, fmt, qw.group, dt, qw.scale_dtype, mt=mt, rw=rw, kw=kw, ks=ks),
             [dev(x), *[dev(a) for a in qw.arrays], out])
        got = host(out, dt).astype(np.float32)
        # one rounding of the output to dt (the sums' order is within fp32 noise)
        np.testing.assert_allclose(got, ref, rtol=2 ** -7, atol=2 ** -7 * float(np.abs(ref).max()) / 16)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q8_0", "uint4"])
def test_tile_gemm_epilogue_matches_reference(fmt):
    """bias + SiLU + residual fused, the rule's sm_90 tiling (K over a cluster), against the fp32 reference within fp16
    rounding."""
    from fusec.lower.quant import qgemm_tiling

    m, n, k = 45, 83, 2048
    qw = sample_weight(fmt, n, k, RNG)
    x = RNG.standard_normal((m, k)).astype(np.float16)
    bias = RNG.standard_normal(n).astype(np.float16)
    res = RNG.standard_normal((m, n)).astype(np.float16)
    y = x.astype(np.float32) @ qw.dequantize().T + bias.astype(np.float32)
    ref = y / (1 + np.exp(-y)) + res.astype(np.float32)
    out = poisoned((m, n), F16)
    spec = QGemmSpec(m, n, k, fmt, qw.group, F16, qw.scale_dtype, Epilogue(True, "silu", True),
                     **qgemm_tiling(m, n, k, clusters=True))
    _run(spec, [dev(x), *[dev(a) for a in qw.arrays], dev(bias), dev(res), out])
    assert rel_err(host(out, F16), ref) <= TOL[F16], fmt


@pytest.mark.parametrize("knob", ["tile", "scratch"])
def test_bf16_prefill_plan_takes_the_tile_gemm_or_scratch_and_matches_reference(knob, monkeypatch):
    """A bf16 plan of one packed product with its epilogue at 40 rows: the dequantize-in-tile GEMM or the scratch path
    (FUSEC_QGEMM=tile, scratch), each against the fp32 reference within bf16 rounding."""
    from test_quant_kernels import _qgraph

    import fusec
    from fusec import reference

    monkeypatch.setenv("FUSEC_QGEMM", knob)
    g = _qgraph(40, epilogue=True, fmt="q4_k")
    feeds = {"x": RNG.standard_normal((40, 512)).astype(np.float32).astype(BF16.np),
             "res": RNG.standard_normal((40, 96)).astype(np.float32).astype(BF16.np)}
    want = reference.run(g, {k: v.astype(np.float32) for k, v in feeds.items()})["y"]
    plan = fusec.compile(g, dtype="bf16")
    labels = [L.get("label", "") for L in plan.manifest["launches"]]
    assert any(lb.endswith(" qgemm") for lb in labels) == (knob == "tile"), labels
    got = host(plan.run(feeds)["y"], BF16)
    assert rel_err(got, want) <= TOL[BF16], knob


@pytest.mark.parametrize("m", [4, 40])
def test_plan_with_a_packed_product_matches_reference(m):
    """M = 4: the GEMV with the epilogue fused; M = 40: dequantize into scratch + cuBLAS + epilogue."""
    from test_quant_kernels import _qgraph

    import fusec
    from fusec import reference

    g = _qgraph(m, epilogue=True)
    feeds = {"x": RNG.standard_normal((m, 512)).astype(np.float32),
             "res": RNG.standard_normal((m, 96)).astype(np.float32)}
    want = reference.run(g, feeds)["y"]
    plan = fusec.compile(g, dtype="fp32")
    got = np.asarray(plan.run(feeds)["y"].get())
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q8_0"])
@pytest.mark.parametrize("m", [3, 4, 8])
def test_bf16_plan_with_a_packed_product_on_the_rules_form_matches_reference(fmt, m):
    """A bf16 plan of one packed product with its epilogue at 3, 4 and 8 rows: the rule's form there (tensor cores for
    these formats, the dp4a form where it still takes them) against the fp32 reference, within bf16 rounding."""
    from test_quant_kernels import _qgraph

    import fusec
    from fusec import reference
    from fusec.lower.qgemv_form import gemv_form

    assert gemv_form(m, 96, 512, fmt, quant.FORMATS[fmt].group, BF16).get("tc") or m == 3
    g = _qgraph(m, epilogue=True, fmt=fmt)
    feeds = {"x": RNG.standard_normal((m, 512)).astype(np.float32).astype(BF16.np),  # a bf16 plan takes bf16
             "res": RNG.standard_normal((m, 96)).astype(np.float32).astype(BF16.np)}
    want = reference.run(g, {k: v.astype(np.float32) for k, v in feeds.items()})["y"]
    plan = fusec.compile(g, dtype="bf16")
    got = host(plan.run(feeds)["y"], BF16)
    assert rel_err(got, want) <= TOL[BF16], (fmt, m)


def _packed_model(layers: int = 2):
    import dataclasses

    from fusec.genmodel import GenModel
    from fusec.models import get_config
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomPackedWeights, q4_k_m_types

    cfg = dataclasses.replace(get_config("llama-tiny"), hidden_size=256, intermediate_size=512, num_heads=4,
                              num_kv_heads=2, head_dim=64, num_layers=layers, tie_word_embeddings=False,
                              name="llama-q4km")
    return GenModel(cfg, SharedWeights(RandomPackedWeights(q4_k_m_types(layers), seed=1, scale=0.02)), None, (),
                    cfg.name)


PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [21, 22, 23], [31, 32, 33, 34, 35, 36]]


def test_generation_from_packed_weights_matches_reference_token_for_token():
    from fusec.compiler import compile_generation
    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import build_graphs

    plan = compile_generation(_packed_model(), batch=4, max_seq_len=48, prefill_len=12, dtype="fp32", eos_ids=[])
    assert plan.manifest["reports"]["decode"]["norms_split"] >= 1  # a layer with v in Q6_K: a norm copy each product
    got = generate_with_plan(plan, PROMPTS, max_new_tokens=20).new_ids
    gm = _packed_model()
    want = generate(ReferenceEngine(build_graphs(gm, 4, 48, 12, []), optimize=True), PROMPTS, 20,
                    gm.config.vocab_size).new_ids
    assert got == want
    kinds = plan.manifest["reports"]["decode"]["lowering"]["by_template"]
    assert kinds.get("qmatmul:qgemv", 0) >= 2 * 4 + 1  # every projection and the LM head in the GEMV


def test_decode_through_the_dequantizing_path_matches_reference_token_for_token(monkeypatch):
    """FUSEC_QGEMV_MAX_ROWS=2 at batch 4: the decode step's packed products dequantize to scratch and run cuBLAS
    (the prefill's path), fp32, token for token against the reference."""
    from fusec.compiler import compile_generation
    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import build_graphs

    monkeypatch.setenv("FUSEC_QGEMV_MAX_ROWS", "2")
    plan = compile_generation(_packed_model(), batch=4, max_seq_len=48, prefill_len=12, dtype="fp32", eos_ids=[])
    kinds = plan.manifest["reports"]["decode"]["lowering"]["by_template"]
    assert not kinds.get("qmatmul:qgemv") and kinds["qmatmul:dequant_gemm"] >= 2 * 4 + 1, kinds
    got = generate_with_plan(plan, PROMPTS, max_new_tokens=20).new_ids
    gm = _packed_model()
    want = generate(ReferenceEngine(build_graphs(gm, 4, 48, 12, []), optimize=True), PROMPTS, 20,
                    gm.config.vocab_size).new_ids
    assert got == want


def test_packed_generation_at_batch_16_matches_reference_token_for_token(monkeypatch):
    """At batch 16 in fp32 a decode step's packed products take the prefill's paths (the tensor-core GEMV, which takes
    9-16 rows, takes fp16/bf16): the step dequantizes into scratch for cuBLAS, token for token against the reference
    with 16 rows of prompts. And bf16 plans of one packed product at 12 and 16 rows, on the tensor-core GEMV (two tiles
    of x) and with FUSEC_QGEMV_MAX_ROWS=8 on the prefill's paths, against the fp32 reference within bf16 rounding."""
    from test_quant_kernels import _qgraph

    import fusec
    from fusec import reference
    from fusec.compiler import compile_generation, stage
    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import build_graphs

    prompts = [p + [41 + i] for i in range(6) for p in PROMPTS][:16]
    plan = compile_generation(_packed_model(), batch=16, max_seq_len=48, prefill_len=12, dtype="fp32", eos_ids=[])
    kinds = plan.manifest["reports"]["decode"]["lowering"]["by_template"]
    assert not kinds.get("qmatmul:qgemv") and kinds.get("qmatmul:dequant_gemm", 0) >= 2 * 4 + 1, kinds
    got = generate_with_plan(plan, prompts, max_new_tokens=12).new_ids
    gm = _packed_model()
    want = generate(ReferenceEngine(build_graphs(gm, 16, 48, 12, []), optimize=True), prompts, 12,
                    gm.config.vocab_size).new_ids
    assert got == want
    for rows in ("16", "8"):
        monkeypatch.setenv("FUSEC_QGEMV_MAX_ROWS", rows)
        for fmt in ("q4_k", "q8_0"):
            for m in (12, 16):
                g = _qgraph(m, epilogue=True, fmt=fmt)
                feeds = {"x": RNG.standard_normal((m, 512)).astype(np.float32).astype(BF16.np),
                         "res": RNG.standard_normal((m, 96)).astype(np.float32).astype(BF16.np)}
                want_y = reference.run(g, {k: v.astype(np.float32) for k, v in feeds.items()})["y"]
                by = stage(g, "bf16", "sm_90", dry_run=True).lowered.report["by_template"]
                assert (by.get("qmatmul:qgemv", 0) > 0) == (rows == "16"), (rows, by)
                got_y = host(fusec.compile(g, dtype="bf16").run(feeds)["y"], BF16)
                assert rel_err(got_y, want_y) <= TOL[BF16], (fmt, m, rows)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_generation_matches_reference(method):
    from fusec.compiler import compile_generation
    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import build_graphs, load_generation_model
    from fusec.passes.base import PassOptions

    q = {"quantize": method, "quantize_group": 32}
    plan = compile_generation("qwen3-tiny", batch=4, max_seq_len=48, prefill_len=12, dtype="fp32", eos_ids=[], **q)
    got = generate_with_plan(plan, PROMPTS, max_new_tokens=16).new_ids
    gm = load_generation_model("qwen3-tiny")
    eng = ReferenceEngine(build_graphs(gm, 4, 48, 12, []), optimize=True, options=PassOptions(**q))
    assert got == generate(eng, PROMPTS, 16, gm.config.vocab_size).new_ids


def test_packed_decode_steps_do_no_host_work():
    from fusec.compiler import compile_generation

    plan = compile_generation(_packed_model(), batch=2, max_seq_len=64, prefill_len=8, dtype="bf16", eos_ids=[])
    res = generate_with_plan(plan, [[5, 6, 7], [8, 9]], max_new_tokens=24, measure=True)
    dec = res.stats["decode"]
    assert dec["steps"] == 23 and dec["cuda_graph"]
    if dec.get("counters") != "cupti":
        pytest.skip(f"driver counters unavailable: {dec.get('counters')}")
    per = dec["per_step"]
    assert per["syncs"] == 0 and per["allocations"] == 0 and per["h2d_bytes"] == 0 and per["d2h_bytes"] == 0


@pytest.mark.parametrize("fmt", ["q6_k", "q4_k", "q8_0"])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_dp4a_argmax_partials_sample_as_the_logits_do(fmt, m):
    """The dp4a form's argmax partials (a sampler reads the product): its logits are the plain form's bit for bit, and
    the sampler merging its partials draws what the sampler reading the whole logits draws, for greedy rows and
    uncut sampled rows (Gumbel scores): at a vocabulary whose last task is partial and whose grid has warps without
    a task, and at one whose warps take several tasks each."""
    import cupy as cp

    from fusec.codegen.specs_decode import SampleSpec
    from fusec.lower.qgemv_form import gemv_form

    dt, k = BF16, 2048
    for n in (3001, 9001):
        qw = sample_weight(fmt, n, k, RNG)
        x = dev(RNG.standard_normal((m, k)).astype(np.float32).astype(dt.np))
        g = dev((RNG.random(k) * 0.1 + 0.95).astype(np.float32).astype(dt.np))
        w = [dev(a) for a in qw.arrays]
        form = gemv_form(m, n, k, fmt, qw.group, dt, True)
        assert form.get("dp4a"), form
        plain = QGemvSpec(m, n, k, fmt, qw.group, dt, qw.scale_dtype, norm=True, eps=1e-5, **form)
        spec = dataclasses.replace(plain, argmax=True)
        tasks = -(-n // spec.rows)
        assert (spec.parts > tasks) if n == 3001 else (spec.parts < tasks), (n, spec.parts, tasks)
        want_logits = poisoned((m, n), dt)
        _run(plain, [x, *w, g, want_logits])
        temperature = dev(np.array([0.0, 0.8, 1.3][:m], np.float32))
        seed, counter = dev(np.arange(7, 7 + m, dtype=np.int64)), dev(np.arange(100, 100 + m, dtype=np.int64))
        top_k, top_p = dev(np.zeros(m, np.int64)), dev(np.ones(m, np.float32))
        logits = poisoned((m, n), dt)
        part = cp.full((spec.part_floats,), np.nan, np.float32)
        _run(spec, [x, *w, g, logits, seed, counter, temperature, part])
        assert np.array_equal(host(logits, dt).view(np.uint16), host(want_logits, dt).view(np.uint16)), (fmt, m, n)
        assert not np.isnan(cp.asnumpy(part)[0::2]).any()  # every warp wrote its pair
        got, want = cp.zeros(m, np.int64), cp.full(m, -1, np.int64)
        _run(SampleSpec(m, n, dt, chunks=spec.parts), [logits, seed, counter, temperature, top_k, top_p, part, got])
        _run(SampleSpec(m, n, dt), [logits, seed, counter, temperature, top_k, top_p, want])
        assert cp.asnumpy(got).tolist() == cp.asnumpy(want).tolist(), (fmt, m, n)
        assert int(want[0]) == int(np.argmax(host(logits, dt)[0].astype(np.float32)))


def test_packed_generation_samples_the_same_with_the_heads_partials():
    """A bf16 packed plan at batch 1 (its LM head in the dp4a form, sampling from the head's partials) draws the
    same tokens as the same plan without ``gemm_sample`` (the sampler reading the logits), greedy and sampled."""
    from fusec.compiler import compile_generation
    from fusec.sampling import Sampling

    plans = [compile_generation(_packed_model(), batch=1, max_seq_len=48, prefill_len=12, dtype="bf16", eos_ids=[],
                                disabled_fusions=off) for off in ((), ("gemm_sample",))]
    labels = [[L["label"] for L in p.manifest["entries"]["decode"]["launches"]] for p in plans]
    assert any("sample scores" in lab for lab in labels[0]) and not any("sample scores" in lab for lab in labels[1])
    for s in (Sampling(), Sampling(temperature=0.9)):
        got, want = (generate_with_plan(p, PROMPTS[:1], max_new_tokens=20, seed=3, sampling=s).new_ids for p in plans)
        assert got == want, s


@pytest.mark.parametrize("fmts", [("q4_k", "q6_k"), ("q8_0", "q4_0"), ("q5_k", "q4_1"), ("int4", "q6_k")])
@pytest.mark.parametrize("m", [1, 2])
def test_dp4a_siblings_give_each_products_bits(fmts, m):
    """Packed siblings (one launch, two formats over the same normalized x, each product's tasks in blocks of its
    own) write each product's outputs bit for bit as its own launch does: odd N, and the 7B's q/k + v shapes,
    whose blocks together pass one wave (the wave shared by weight bytes)."""
    from fusec.codegen.specs_quant import QSibling
    from fusec.lower.qgemv_form import gemv_form

    dt = BF16
    for n0, n1, k in ((1001, 333, 2048), (8192, 4096, 4096)):
        w0, w1 = (sample_weight(f, n, k, RNG) for f, n in zip(fmts, (n0, n1)))
        x = dev(RNG.standard_normal((m, k)).astype(np.float32).astype(dt.np))
        g = dev((RNG.random(k) * 0.1 + 0.95).astype(np.float32).astype(dt.np))
        forms = [gemv_form(m, n, k, f, w.group, dt, True) for f, n, w in zip(fmts, (n0, n1), (w0, w1))]
        alone = [QGemvSpec(m, n, k, f, w.group, dt, w.scale_dtype, norm=True, eps=1e-5, **form)
                 for f, n, w, form in zip(fmts, (n0, n1), (w0, w1), forms)]
        want = [poisoned((m, n), dt) for n in (n0, n1)]
        for spec, w, out in zip(alone, (w0, w1), want):
            _run(spec, [x, *[dev(a) for a in w.arrays], g, out])
        sib = QSibling(n1, fmts[1], w1.group, w1.scale_dtype, forms[1]["rows"], forms[1]["chunks"])
        spec = dataclasses.replace(alone[0], siblings=(sib,))
        got = [poisoned((m, n), dt) for n in (n0, n1)]
        _run(spec, [x, *[dev(a) for a in w0.arrays], *[dev(a) for a in w1.arrays], g, *got])
        for a, b in zip(got, want):
            assert np.array_equal(host(a, dt).view(np.uint16), host(b, dt).view(np.uint16)), (fmts, m, n0, n1)


def test_packed_generation_is_the_same_with_packed_siblings():
    """A bf16 packed plan at batch 1 whose Q6_K v product runs in one launch with the Q4_K q/k product (packed_siblings)
    draws the same tokens as the plan with the norm copied into two launches."""
    from fusec.compiler import compile_generation

    plans = [compile_generation(_packed_model(), batch=1, max_seq_len=48, prefill_len=12, dtype="bf16", eos_ids=[],
                                disabled_fusions=off) for off in ((), ("packed_siblings",))]
    labels = [[L["label"] for L in p.manifest["entries"]["decode"]["launches"]] for p in plans]
    assert any("packed_siblings" in lab for lab in labels[0]) and not any("packed_siblings" in lab for lab in labels[1])
    got, want = (generate_with_plan(p, PROMPTS[:1], max_new_tokens=24).new_ids for p in plans)
    assert got == want
