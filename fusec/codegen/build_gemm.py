"""Builders for fusec's own GEMM and GEMV templates (the A/B alternatives to cuBLAS)."""

from __future__ import annotations

from fusec.codegen import specs as S
from fusec.codegen.kernels import Rendered, builder, cdiv, kernel_name
from fusec.codegen.render import Ident, ctype, float_lit
from fusec.dtypes import DType

_SMS = 132  # H100/H200 SXM; only steers the tile-size choice


def _round_fn(dt: DType) -> Ident | None:
    return {DType.F16: Ident("fc_round_f16"), DType.BF16: Ident("fc_round_bf16")}.get(dt)


def _epi_params(e: S.Epilogue) -> tuple[str, ...]:
    return (("bias",) if e.bias else ()) + (("residual",) if e.residual else ())


@builder(S.GemmSpec)
def _gemm(spec: S.GemmSpec) -> Rendered:
    tc = spec.dtype in S.HALFS
    out_dt = spec.out_dtype or spec.dtype
    if tc:
        # big tiles only when they still fill the machine; small problems want more blocks
        big = cdiv(spec.M, 128) * cdiv(spec.N, 128) * spec.batch >= _SMS
        bm, bn, wm, wn = (128, 128, 2, 4) if big else (64, 64, 2, 2)
    else:
        bm, bn, wm, wn = 64, 64, 1, 1
    threads = 32 * wm * wn if tc else 256
    aligned_batches = spec.a_bs % 8 == 0 and spec.b_bs % 8 == 0
    ctx = {
        "name": kernel_name("gemm", spec), "tc": tc, "M": spec.M, "N": spec.N, "K": spec.K,
        "t": ctype(spec.dtype), "out_t": ctype(out_dt), "a_bs": spec.a_bs, "b_bs": spec.b_bs,
        "trans_a": spec.trans_a, "trans_b": spec.trans_b, "BM": bm, "BN": bn,
        "warps_m": wm, "warps_n": wn, "threads": threads,
        "a_vec": (not spec.trans_a) and spec.K % 8 == 0 and aligned_batches,
        "b_vec": (spec.K % 8 == 0 if spec.trans_b else spec.N % 8 == 0) and aligned_batches,
        "bias": spec.epilogue.bias, "act": Ident(spec.epilogue.activation), "residual": spec.epilogue.residual,
        "round_x": _round_fn(out_dt),
    }
    grid = (cdiv(spec.N, bn), cdiv(spec.M, bm), spec.batch)
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"gemm grid {grid} exceeds the y/z launch limits")
    return Rendered("gemm.cu.jinja", ctx, grid, (threads, 1, 1), ("A", "B") + _epi_params(spec.epilogue) + ("C",))


@builder(S.GemvSpec)
def _gemv(spec: S.GemvSpec) -> Rendered:
    nch = cdiv(spec.K, 64)  # 64-wide k chunks
    cmax = 4 if spec.dtype in S.HALFS else 2  # chunks a lane holds per k group: 64 (fp32 128) bytes, x 2 buffers
    kg = cdiv(nch, 8 * cmax)  # k groups of at most 8 warps
    warps = max(4, cdiv(nch, cmax * kg))  # >= 4: the epilogue takes one thread per output of a tile
    ch = cdiv(nch, warps * kg)
    e = spec.epilogue
    ctx = {
        "name": kernel_name("gemv", spec), "M": spec.M, "N": spec.N, "K": spec.K, "nout": spec.n_out,
        "half": spec.N // 2, "warps": warps, "ch": ch, "nch": nch, "kg": kg, "tiles": spec.tiles,
        "t": ctype(spec.dtype), "tc": spec.dtype in S.HALFS, "bias": e.bias, "act": Ident(e.activation),
        "residual": e.residual, "round_x": _round_fn(spec.dtype), "norm": spec.norm, "eps": float_lit(spec.eps),
        "weight_offset": float_lit(spec.weight_offset), "glu": Ident(spec.glu) if spec.glu else None,
        "glu_swap": spec.glu_swap, "argmax": spec.argmax, "group": 4 if spec.glu else 8,
        # the norm's statistic from the fragments: one k group holds all of x's rows in registers
        # (up to 8 rows: with 16, those registers spill)
        "fast_norm": spec.norm and spec.dtype in S.HALFS and kg == 1 and spec.M <= 8,
    }
    if spec.argmax:
        ctx.update(seed_t=ctype(spec.seed_dtype), ctr_t=ctype(spec.counter_dtype))
    params = ("x", "W") + (("g",) if spec.norm else ()) + _epi_params(e) + ("C",) \
        + (("seed", "counter", "temperature", "part") if spec.argmax else ())
    return Rendered("gemv.cu.jinja", ctx, (spec.grid, 1, 1), (32 * warps, 1, 1), params)
