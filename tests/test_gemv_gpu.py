"""The skinny-product kernel (``GemvSpec``: decode's matrix products, M <= 16) against float64
numpy on the GPU (skipped without one): plain, with the RMSNorm prologue, the gated (SwiGLU)
epilogue and the greedy argmax partials, at odd sizes (K with a partial last chunk, N not a
multiple of the 8-row tile, every M from 1 to 16), and K of several k groups.
Outputs are poisoned first; tolerances as in test_kernels_gpu."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fusec.codegen import specs as S
from fusec.codegen.build_gemm import gemv_coop_norm, gemv_prewait
from fusec.dtypes import DType

from test_kernels_gpu import BF16, F16, F32, FLOATS, check, dev, epilogue_ref, host, poisoned, rand, run

pytestmark = pytest.mark.gpu


def _rd(a: np.ndarray, dt: DType) -> np.ndarray:
    return a.astype(np.float32).astype(dt.np).astype(np.float64)


def norm_ref(x: np.ndarray, g: np.ndarray, eps: float, off: float, dt: DType) -> np.ndarray:
    """RMSNORM as the kernels compute it: x * (1 / sqrt(mean(x^2) + eps)) rounded, times (g + off) rounded."""
    xf = x.astype(np.float32)
    inv = np.float32(1.0) / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.float32(eps))
    n = (xf * inv).astype(dt.np).astype(np.float32)
    return ((g.astype(np.float32) + np.float32(off)) * n).astype(dt.np).astype(np.float64)


def _gemv(dt: DType, M: int, N: int, K: int, ring: tuple[int, ...] | None = None, **kw: object):  # noqa: ANN202
    """Runs the product on random inputs against float64 numpy; with ``ring`` (stages, tiles per
    block[, bulk copies]), the shared-memory ring's form of the same spec on the same inputs too,
    which must give the same bits (each tile's sums run in the same order)."""
    spec = S.GemvSpec(M, N, K, dt, **kw)  # type: ignore[arg-type]
    rule = "coop_norm" not in kw  # else where the rule (kernel selection's) normalizes x in the block
    if rule:
        coop = gemv_coop_norm(M, K, dt, spec.norm, spec.stages, spec.spread)
        spec = dataclasses.replace(spec, coop_norm=coop, prewait=gemv_prewait(coop, spec.stages))
    e = spec.epilogue
    x, w = rand((M, K), dt), rand((N, K), dt, -0.2, 0.2)
    g = rand((K,), dt) if spec.norm else None
    bv = rand((N,), dt) if e.bias else None
    rv = rand((M, spec.n_out), dt) if e.residual else None
    out = poisoned((M, spec.n_out), dt)
    part = None
    args = [dev(x), dev(w)] + ([dev(g)] if g is not None else []) + ([dev(bv)] if bv is not None else []) \
        + ([dev(rv)] if rv is not None else []) + [out]
    if spec.argmax:  # rows alternate greedy (temperature 0) and sampled (temperature 0.8, seed 7 + m)
        import cupy as cp

        part = cp.full((spec.part_floats,), np.nan, dtype=np.float32)
        temp = np.array([0.0 if m % 2 == 0 else 0.8 for m in range(M)], np.float32)
        args += [dev(np.arange(7, 7 + M, dtype=np.int64)), dev(np.full(M, 3, np.int64)), dev(temp), part]
    run(spec, args)
    if ring is not None:
        rspec = dataclasses.replace(spec, stages=ring[0], tiles_per_block=ring[1], bulk=bool(ring[2:] and ring[2]))
        if rule:
            coop = gemv_coop_norm(M, K, dt, spec.norm, ring[0], spec.spread)
            rspec = dataclasses.replace(rspec, coop_norm=coop, prewait=gemv_prewait(coop, ring[0]))
        rout = poisoned((M, spec.n_out), dt)
        rargs = args[:len(args) - (5 if spec.argmax else 1)] + [rout] + (args[-4:-1] if spec.argmax else [])
        if spec.argmax:
            import cupy as cp

            rpart = cp.full((spec.part_floats,), np.nan, dtype=np.float32)
            rargs.append(rpart)
        run(rspec, rargs)
        assert np.array_equal(host(rout, dt).view(np.uint8), host(out, dt).view(np.uint8)), f"ring {ring}"
        if spec.argmax:
            assert np.array_equal(rpart.get().view(np.uint32), part.get().view(np.uint32)), f"ring {ring} partials"
    xn = norm_ref(x, g, spec.eps, spec.weight_offset, dt) if g is not None else x.astype(np.float64)
    acc = xn @ w.astype(np.float64).T
    if spec.glu:
        F = N // 2
        first, second = _rd(acc[:, :F], dt), _rd(acc[:, F:], dt)
        if bv is not None:
            first, second = _rd(first + bv[:F].astype(np.float64), dt), _rd(second + bv[F:].astype(np.float64), dt)
        if spec.glu_swap:
            first, second = second, first
        gated = epilogue_ref(first, None, spec.glu, None, dt)  # activation, rounded
        ref = _rd(gated * second, dt)
        if rv is not None:
            ref = ref + rv.astype(np.float64)
    else:
        ref = epilogue_ref(acc, bv, e.activation, rv, dt)
    got = host(out, dt)
    check(got, ref, dt)
    return spec, got, part


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("M,N,K", [(1, 4096, 1024), (1, 1000, 3072), (8, 6144, 1024), (16, 1024, 2048),
                                   (3, 77, 72), (5, 13, 8), (11, 300, 1096)])
def test_gemv_plain_and_epilogue(dt: DType, M: int, N: int, K: int) -> None:
    if dt == F32 and K % 4:
        pytest.skip("fp32 rows are read 4 at a time")
    _gemv(dt, M, N, K)
    _gemv(dt, M, N, K, epilogue=S.Epilogue(bias=True, activation="silu", residual=True))


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("M", list(range(1, 17)))
def test_gemv_every_m_with_norm(dt: DType, M: int) -> None:
    _gemv(dt, M, 136, 520, norm=True, eps=1e-6, weight_offset=1.0 if M % 2 else 0.0)


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("M,F,K,swap,act", [(1, 3072, 1024, False, "silu"), (8, 3072, 1024, False, "silu"),
                                            (3, 37, 264, True, "gelu_tanh"), (16, 100, 128, False, "gelu")])
def test_gemv_norm_and_gated_epilogue(dt: DType, M: int, F: int, K: int, swap: bool, act: str) -> None:
    _gemv(dt, M, 2 * F, K, norm=True, eps=1e-5, glu=act, glu_swap=swap,
          epilogue=S.Epilogue(bias=M == 3, residual=M == 16))


@pytest.mark.parametrize("dt", [BF16, F16, F32])
@pytest.mark.parametrize("M,N,K", [(1, 151936, 1024), (8, 49152, 576), (4, 1001, 64), (2, 333, 40)])
def test_gemv_argmax_partials(dt: DType, M: int, N: int, K: int) -> None:
    spec, got, part = _gemv(dt, M, N, K, norm=True, argmax=True)
    from fusec import sampling

    p = part.get().reshape(M, spec.tiles, 2)
    assert not np.isnan(p[..., 0]).any(), "a block wrote no partial"
    idx = p[..., 1].view(np.int32)
    for m in range(M):
        best = max(range(spec.tiles), key=lambda b: (p[m, b, 0], -idx[m, b]))
        x = got[m].astype(np.float32)
        # the row's draw as fusec/sampling.py defines it, over the product's own stored logits
        want = sampling.sample_row(x, 7 + m, 3, 0.0 if m % 2 == 0 else 0.8, 0, 1.0)
        assert idx[m, best] == want, f"row {m}"
        if m % 2 == 0:
            assert p[m, best, 0] == x.max()


@pytest.mark.parametrize("dt", FLOATS)
def test_gemv_several_k_groups(dt: DType) -> None:
    """K beyond one group (8 warps x 4 chunks of 64): the next group's weights load while one computes,
    and the norm takes its statistic in a pass of its own."""
    for M in (1, 9):
        _gemv(dt, M, 520, 8200, norm=True, epilogue=S.Epilogue(residual=True))
        _gemv(dt, M, 2 * 136, 4104, glu="silu", norm=True)


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("spread", [2, 4])
def test_gemv_spread_over_more_warps(dt: DType, spread: int) -> None:
    """A k group spread over 2 or 4 times the warps (fewer chunks a lane): against float64 and, ring
    against register buffers of the same geometry, bit for bit; norm (fast and two-pass), gated,
    argmax, several k groups, odd sizes."""
    _gemv(dt, 1, 4096, 1024, ring=(3, 2), spread=spread, norm=True)
    _gemv(dt, 3, 77, 72, ring=(3, 1), spread=spread, epilogue=S.Epilogue(bias=True, activation="silu", residual=True))
    _gemv(dt, 8, 2 * 100, 1024, ring=(2, 3), spread=spread, norm=True, glu="silu", epilogue=S.Epilogue(residual=True))
    _gemv(dt, 2, 1001, 64, ring=(3, 4), spread=spread, norm=True, argmax=True)
    _gemv(dt, 16, 520, 3072, ring=(3, 1), spread=spread, norm=True, epilogue=S.Epilogue(residual=True))
    _gemv(dt, 5, 136, 8200, ring=(4, 2), spread=spread)


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("stages,tpb", [(2, 1), (3, 3), (4, 8), (4, 2)])
def test_gemv_ring_equals_register_buffers(dt: DType, stages: int, tpb: int) -> None:
    """The shared-memory ring (stages, several tiles per block, a last block with fewer tiles)
    gives the register form's bits: plain and epilogue, norm prologue (fast and two-pass), gated,
    argmax partials, several k groups, odd M, N and K."""
    _gemv(dt, 1, 4096, 1024, ring=(stages, tpb))
    _gemv(dt, 3, 77, 72, ring=(stages, tpb), epilogue=S.Epilogue(bias=True, activation="silu", residual=True))
    _gemv(dt, 5, 136, 520, ring=(stages, tpb), norm=True, weight_offset=1.0)
    _gemv(dt, 16, 2 * 100, 128, ring=(stages, tpb), norm=True, glu="gelu", epilogue=S.Epilogue(residual=True))
    _gemv(dt, 2, 1001, 64, ring=(stages, tpb), norm=True, argmax=True)
    _gemv(dt, 9, 520, 8200, ring=(stages, tpb), norm=True, epilogue=S.Epilogue(residual=True))


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("stages,tpb", [(2, 1), (3, 2), (4, 3)])
def test_gemv_bulk_copies_equal_register_buffers(dt: DType, stages: int, tpb: int) -> None:
    """The ring filled by TMA bulk copies from one thread (``bulk``; K a multiple of the k group) gives
    the register form's bits: N not a multiple of the tile (rows past N copy row N - 1), norm prologue,
    gated, argmax partials, several k groups."""
    _gemv(dt, 1, 4096, 1024, ring=(stages, tpb, True), norm=True)
    _gemv(dt, 3, 77, 256, ring=(stages, tpb, True), epilogue=S.Epilogue(bias=True, activation="silu", residual=True))
    _gemv(dt, 8, 2 * 101, 1024, ring=(stages, tpb, True), norm=True, glu="silu", epilogue=S.Epilogue(residual=True))
    _gemv(dt, 2, 1001, 1024, ring=(stages, tpb, True), norm=True, argmax=True)
    _gemv(dt, 5, 520, 8192, ring=(stages, tpb, True), norm=True, epilogue=S.Epilogue(residual=True))
    # 3-4 rows: x normalized once by the block into dynamic shared memory after the ring (gemv_coop_norm), in both
    # forms at K = 1024 (at K = 2048 a 4-stage ring leaves one block an SM, so the ring form normalizes in the
    # fragments and the register form in the block: other sums, other bits)
    _gemv(dt, 4, 2 * 101, 1024, ring=(stages, tpb, True), norm=True, glu="silu", epilogue=S.Epilogue(residual=True))
    _gemv(dt, 3, 520, 1024, ring=(stages, tpb, True), norm=True, weight_offset=1.0)
