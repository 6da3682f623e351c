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


_SMEM_PER_SM = 228 * 1024  # sm_80 164 KB, sm_90 228 KB: the larger; a ring that does not fit runs fewer blocks


gemv_geometry = S.gemv_geometry  # the block shape (fusec.codegen.specs: the spec validates with it)


def gemv_ring_bytes(K: int, dtype: DType, stages: int) -> int:
    """Shared memory of the ring: [stages][8 rows][16-byte pieces of a k group + 1 of padding]."""
    warps, ch, _, _ = gemv_geometry(K, dtype)
    return stages * 8 * (warps * ch * 64 * dtype.itemsize // 16 + 1) * 16


def gemv_blocks_per_sm(K: int, dtype: DType, stages: int) -> int:
    """The ring form's resident blocks per SM: as many as their rings fit in shared memory, with at
    least 128 registers a thread (160 for fp32's per-row sums). The kernel's launch bounds budget
    its registers for that many (without a count ptxas budgets for more blocks, and spills)."""
    warps, _, _, _ = gemv_geometry(K, dtype)
    floor = 128 if dtype in S.HALFS else 160
    return max(1, min(_SMEM_PER_SM // (gemv_ring_bytes(K, dtype, stages) + 8 * 1024), 65536 // (32 * warps * floor)))


GEMV_STAGES = 3
_REGS_PER_SM = 65536
_REG_FLOOR = 128  # registers a thread of the tensor-core form is budgeted (gemv_blocks_per_sm)


def gemv_resident_form(N: int, K: int, dtype: DType, share: float) -> dict[str, int] | None:
    """The resident form where the product's whole weights fit in ``share`` of the GPU's shared memory
    (132 SMs): each block loads all of its tiles into shared memory before its PDL wait, while the
    kernel before it still runs, in the fewest blocks (at most 4 stages each) whose registers and
    shared memory stay within ``share`` of the machine's, so that the kernel after it can be
    resident beside it and load its own weights the same way. None where it does not fit (the LM
    head, Llama-1B's MLP): those stream through the 3-stage ring.

    Why: in a decode step the ring's products ran at 1.3 TB/s, a third of the copy bandwidth
    (H200, Qwen3-0.6B batch 1): each filled the machine with blocks of 3 stages it did not use (a
    block with one tile uses one), so the next product's blocks could not become resident, and
    its weights were loaded only as this one's blocks exited."""
    warps, _, kg, _ = gemv_geometry(K, dtype)
    tiles = cdiv(N, 8)  # a gated unit has the same tiles (4 rows of each half)
    stage = gemv_ring_bytes(K, dtype, 1)
    threads = 32 * warps
    regs = threads * (_REG_FLOOR if dtype in S.HALFS else 160)
    if share <= 0 or tiles * kg * stage > share * _SMS * _SMEM_PER_SM:
        return None
    for tpb in range(1, S.GEMV_MAX_STAGES // kg + 1):
        blocks = cdiv(tiles, tpb)
        smem = tpb * kg * stage + 32 * warps * 16 + 1024  # the ring, the partial sums, the block's reserve
        if blocks * regs <= share * _SMS * _REGS_PER_SM and blocks * smem <= share * _SMS * _SMEM_PER_SM:
            return {"stages": tpb * kg, "tiles_per_block": tpb}
    return None


def gemv_form(N: int, K: int, dtype: DType, glu: bool = False) -> dict[str, int]:
    """The form of the skinny product decode plans use (``GemvSpec``'s stages and tiles_per_block).

    A product whose weights fit in half the GPU's shared memory (``FUSEC_GEMV_RESIDENT``: the share)
    takes the resident form (``gemv_resident_form``). Larger ones stream through the shared-memory
    ring of 3 stages, a block taking up to 4 tiles, as many as spread the tiles over one wave of
    resident blocks (132 SMs). Measured on an H200 (benchmarks/RESULTS.md, fifth session; each
    product alone, PDL, weights cycled past L2) against the register form, at M = 1: Llama-1B's LM
    head 123 us against 176 (cuBLAS 126), gate/up 18.2 against 22.4. The same form serves every
    M <= 16."""
    from fusec import knobs

    if knobs.get("FUSEC_GEMV_FORM") == "register":
        return {"stages": 0, "tiles_per_block": 1}
    share = knobs.get("FUSEC_GEMV_RESIDENT")
    if not 0 <= share <= 1:
        from fusec.errors import InputError

        raise InputError(f"environment variable FUSEC_GEMV_RESIDENT={share} must be a share from 0 to 1")
    resident = gemv_resident_form(N, K, dtype, share)
    if resident is not None:
        return resident
    tiles = cdiv(N // 2, 4) if glu else cdiv(N, 8)
    slots = _SMS * gemv_blocks_per_sm(K, dtype, GEMV_STAGES)
    return {"stages": GEMV_STAGES, "tiles_per_block": max(1, min(4, cdiv(tiles, slots)))}


@builder(S.GemvSpec)
def _gemv(spec: S.GemvSpec) -> Rendered:
    warps, ch, kg, nch = gemv_geometry(spec.K, spec.dtype)
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
        "stages": spec.stages,
        # stages loaded before the PDL wait: the whole stream where the ring holds it, else S - 1
        "pre": spec.stages if spec.resident else max(spec.stages - 1, 0),
    }
    if spec.argmax:
        ctx.update(seed_t=ctype(spec.seed_dtype), ctr_t=ctype(spec.counter_dtype))
    params = ("x", "W") + (("g",) if spec.norm else ()) + _epi_params(e) + ("C",) \
        + (("seed", "counter", "temperature", "part") if spec.argmax else ())
    ring = gemv_ring_bytes(spec.K, spec.dtype, spec.stages)
    if spec.resident:  # registers as the rule budgets them (its blocks share the SMs with the next kernel's)
        ctx["min_blocks"] = max(1, _REGS_PER_SM // (32 * warps * (_REG_FLOOR if spec.dtype in S.HALFS else 160)))
    else:
        ctx["min_blocks"] = gemv_blocks_per_sm(spec.K, spec.dtype, spec.stages) if spec.stages else 0
    return Rendered("gemv.cu.jinja", ctx, (spec.grid, 1, 1), (32 * warps, 1, 1), params, shared_mem=ring)
