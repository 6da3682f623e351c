"""Builders for fusec's own GEMM and GEMV templates (the A/B alternatives to cuBLAS)."""

from __future__ import annotations

from fusec.codegen import specs as S
from fusec.codegen.kernels import Rendered, builder, cdiv, kernel_name
from fusec.codegen.render import Ident, ctype, float_lit
from fusec.codegen.spec_base import SMS
from fusec.codegen.specs import gemv_geometry  # the block shape (the spec validates with it)
from fusec.dtypes import DType


def _round_fn(dt: DType) -> Ident | None:
    return {DType.F16: Ident("fc_round_f16"), DType.BF16: Ident("fc_round_bf16")}.get(dt)


def _epi_params(e: S.Epilogue) -> tuple[str, ...]:
    return (("bias",) if e.bias else ()) + (("residual",) if e.residual else ())


def stream_bn(n: int) -> int:
    """The stream form's columns a block: 128 where there are at least 32 such tiles, else 64 (more blocks)."""
    return 128 if n >= 32 * 128 else 64


def stream_splits(m: int, n: int, k: int, cluster: bool) -> int:
    """The stream form's K split (``GemmSpec.splits``) where clusters exist (sm_90): the largest power of two up to 8
    that leaves each block at least 512 of K (8 slices) and at most two blocks an SM; 1 without clusters. Measured
    alone (H200, benchmarks/gemm_stream_bench.py, RESULTS.md, twenty-second session), it picked the fastest split or
    one within 0.4 us of it at all eight of Qwen3-0.6B's (M 128) and Llama-1B's (M 32) prefill products: shares of 256
    had lost to 512 (the o product 9.8 us against 8.7), 128 blocks of 1,024 won over 64 of 2,048 (Llama's down: 15.8
    against 21.6)."""
    tiles, splits = cdiv(n, stream_bn(n)), 1
    while (cluster and splits < 8 and tiles * splits * 2 <= 2 * SMS and k % (S.GEMM_STREAM_BK * splits * 2) == 0
           and k // (splits * 2) >= 512):
        splits *= 2
    return splits


def _gemm_stream(spec: S.GemmSpec, ctx: dict) -> Rendered:
    bm, bn, bk = min(S.GEMM_STREAM_MAX_M, cdiv(spec.M, 32) * 32), stream_bn(spec.N), S.GEMM_STREAM_BK
    kt = spec.K // (spec.splits * bk)
    # two blocks an SM (a ring within ~113 KB): at 143 KB (4 stages of 128 x 128) one fit, and 30 clusters of 4 were
    # active at once for 32 (Nsight Compute, H200): a second wave
    stages = min(3 if bn == 128 and bm == 128 else 4, max(2, kt))
    ring = stages * (bm * (bk + 8) + bk * (bn + 8)) * 2
    partials = bm * (bn + 4) * 4  # the accumulators' way to whole-row stores (gemm_rows_out.jinja)
    ctx.update(BM=bm, BN=bn, stages=stages, ks=spec.splits, threads=256)
    grid = (cdiv(spec.N, bn) * spec.splits, 1, 1)
    return Rendered("gemm.cu.jinja", ctx, grid, (256, 1, 1), ("A", "B") + _epi_params(spec.epilogue) + ("C",),
                    shared_mem=max(ring, partials))


# the ring's cap where a block has its SM to itself. Alone at Qwen3-0.6B's and Llama-1B's prefill products (H200,
# benchmarks/gemm_stream_bench.py --max-stages 8,4,3, RESULTS.md twenty-fourth session) 8 stages were faster than 4 and
# 3, or within 0.35 us of 4, at every measured tiling that ``wgmma_tiling`` allows; they lost 2.2-4.5 us only where 128
# blocks in clusters of 4 took two waves at one block an SM (``WGMMA_WAVE`` keeps the rule off those)
WGMMA_MAX_STAGES = 8

# The wgmma form's tiling (``wgmma_tiling``) estimates a block's time from these, fitted to the form alone at Qwen3-0.6B's
# (M 128) and Llama-1B's (M 32) prefill products on an H200 (RESULTS.md, twenty-fourth session): us a 64-wide K slice by
# (BM, BN) with its SM's ring to itself (two blocks an SM, on the shallow ring: WGMMA_SHARED times that each), the
# split's reduction by KS (twice for 128-column tiles), and each SM's share of the weight stream.
WGMMA_SLICE_US = {128: {32: 0.16, 64: 0.25, 128: 0.5}, 64: {32: 0.195, 64: 0.23, 128: 0.3}}
WGMMA_SHARED = 1.4
WGMMA_SPLIT_US = {1: 0.0, 2: 1.0, 4: 1.0, 8: 2.0}
WGMMA_SM_GBPS = 26.5  # copy bandwidth (~3.5 TB/s) over 132 SMs
# The most blocks of a split that run in one wave at one block an SM: a cluster's blocks share a GPC, and 30 clusters of
# 4 were active at once (Nsight Compute, H200, twenty-second session); 128 blocks in clusters of 4 ran in two waves
# (Qwen3's o at BN 32: 8.95 us against 6.41 for 64 blocks). Twice as many run at two blocks an SM.
WGMMA_WAVE = {1: SMS, 2: 128, 4: 120, 8: 128}


def wgmma_fits(m: int, n: int, k: int) -> bool:
    """A tiling of the wgmma form runs in one wave (``wgmma_tiling``'s candidates): where it was measured. More columns
    (a vocabulary's logits at every row) would run in waves, which nothing measured."""
    return _wgmma_best(m, n, k) is not None


def wgmma_tiling(m: int, n: int, k: int) -> tuple[int, int]:
    """The wgmma form's (columns a block, K split) for an [m, k] x [k, n] product (m <= 128): of the tilings whose
    blocks run in one wave (``WGMMA_WAVE``, one or two blocks an SM) with at least 512 of K a block where K is split,
    the one whose SM is estimated done first: its blocks' K slices at ``WGMMA_SLICE_US`` or their share of the weight
    at ``WGMMA_SM_GBPS``, whichever is longer, plus the split's reduction. Alone on an H200 it picks the fastest
    tiling measured (BN 32, 64, 128 by split 1-8, in three calls) at each of the eight Qwen3-0.6B and Llama-1B prefill
    products; the rule before (``stream_bn``'s columns, ``stream_splits``) had Qwen3's QKV at 9.14 us against 6.18 now
    (BN 32, unsplit) and its gate/up at 9.55 against 7.61 (BN 64, unsplit); cuBLAS took 5.43-5.58 and 6.11-6.15
    (RESULTS.md, twenty-fourth session)."""
    best = _wgmma_best(m, n, k)
    return (128, 1) if best is None else best  # none in one wave: the widest, in waves


def _wgmma_best(m: int, n: int, k: int) -> tuple[int, int] | None:
    bm = 64 if m <= 64 else 128
    best: tuple[float, int, int] | None = None
    for bn in (32, 64, 128):
        for ks in (1, 2, 4, 8):
            blocks = cdiv(n, bn) * ks
            if k % (S.GEMM_STREAM_BK * ks) or (ks > 1 and k // ks < 512):
                continue
            wave = WGMMA_WAVE[ks]
            per_sm = 1 if blocks <= wave else 2 if blocks <= 2 * wave else 0
            if not per_sm:
                continue
            slices = k // (S.GEMM_STREAM_BK * ks)
            slice_us = slices * WGMMA_SLICE_US[bm][bn] * (1 if per_sm == 1 else 2 * WGMMA_SHARED)
            weight_us = per_sm * bn * (k // ks) * 2 / (WGMMA_SM_GBPS * 1e3)  # its SM's weight bytes at its share
            t = max(slice_us, weight_us) + WGMMA_SPLIT_US[ks] * max(1, bn // 64)
            if best is None or t < best[0]:
                best = (t, bn, ks)
    return None if best is None else (best[1], best[2])


def _gemm_wgmma(spec: S.GemmSpec, ctx: dict) -> Rendered:
    bm, bn = (64 if spec.M <= 64 else 128), spec.bn or wgmma_tiling(spec.M, spec.N, spec.K)[0]
    kt = spec.K // (spec.splits * S.GEMM_STREAM_BK)
    stage = (bm + bn) * S.GEMM_STREAM_BK * 2
    # at least 3 stages: slices STAGES - 2 ahead of the MMAs, which run on over one more (gemm_wgmma.jinja)
    # a gated product's block takes BN / 2 rows of each half: its column tiles are over F = N / 2
    tiles = cdiv(spec.N // 2, bn // 2) if spec.glu else cdiv(spec.N, bn)
    if tiles * spec.splits <= SMS:  # one block an SM: the ring takes its shared memory (more copies in flight)
        stages = min(max(3, kt + 2), (_SMEM_PER_SM - 8 * 1024) // stage, WGMMA_MAX_STAGES)
    else:  # two blocks an SM, as the stream form
        stages = 3 if bm + bn == 256 else 4
    partials = bm * (bn + 4) * 4  # the accumulators' way to whole-row stores
    ctx.update(BM=bm, BN=bn, wn=bn if bm == 128 else bn // 2, stages=stages, ks=spec.splits, threads=256,
               mma_t=Ident("bf16" if spec.dtype == DType.BF16 else "f16"), l2ef=spec.l2_evict_first)
    grid = (tiles * spec.splits, 1, 1)
    return Rendered("gemm.cu.jinja", ctx, grid, (256, 1, 1), ("A", "B") + _epi_params(spec.epilogue) + ("C",),
                    shared_mem=max(stages * stage, partials) + 1024)  # + the slack that aligns the ring to 1,024


@builder(S.GemmSpec)
def _gemm(spec: S.GemmSpec) -> Rendered:
    tc = spec.dtype in S.HALFS
    out_dt = spec.out_dtype or spec.dtype
    if tc:
        # big tiles only when they still fill the machine; small problems want more blocks
        big = cdiv(spec.M, 128) * cdiv(spec.N, 128) * spec.batch >= SMS
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
        "round_x": _round_fn(out_dt), "stream": spec.stream, "wgmma": spec.wgmma,
        "glu": Ident(spec.glu) if spec.glu else None, "glu_swap": spec.glu_swap,
    }
    if spec.wgmma:
        return _gemm_wgmma(spec, ctx)
    if spec.stream:
        return _gemm_stream(spec, ctx)
    grid = (cdiv(spec.N, bn), cdiv(spec.M, bm), spec.batch)
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"gemm grid {grid} exceeds the y/z launch limits")
    return Rendered("gemm.cu.jinja", ctx, grid, (threads, 1, 1), ("A", "B") + _epi_params(spec.epilogue) + ("C",))


_SMEM_PER_SM = 228 * 1024  # sm_80 164 KB, sm_90 228 KB: the larger; a ring that does not fit runs fewer blocks


def gemv_ring_bytes(K: int, dtype: DType, stages: int, spread: int = 1) -> int:
    """Shared memory of the ring: [stages][8 rows][16-byte pieces of a k group + 1 of padding]."""
    return stages * 8 * (S.gemv_group(K, dtype, spread) * dtype.itemsize // 16 + 1) * 16


def gemv_blocks_per_sm(K: int, dtype: DType, stages: int, spread: int = 1, xn_bytes: int = 0) -> int:
    """The ring form's resident blocks per SM: as many as their rings (and x's normalized rows,
    ``xn_bytes``: ``gemv_xn_bytes``) fit in shared memory, with at least 128 registers a thread (160
    for fp32's per-row sums at any spread), 80 at spread 2 and 64 at spread 4 (a lane holding 2 and 1
    chunks; ptxas used 79 and 52 for Qwen3's qkv, no spills). The kernel's launch bounds budget its
    registers for that many (without a count ptxas budgets for more blocks, and spills)."""
    warps, _, _, _ = gemv_geometry(K, dtype, spread)
    floor = ({1: 128, 2: 80, 4: 64}[spread]) if dtype in S.HALFS else 160
    return max(1, min(_SMEM_PER_SM // (gemv_ring_bytes(K, dtype, stages, spread) + xn_bytes + 8 * 1024),
                      65536 // (32 * warps * floor)))


_BLOCK_SMEM = 160 * 1024  # what one block's ring and x's rows may take on every arch (sm_80 allows 163 KB a block)


def gemv_coop_norm(M: int, K: int, dtype: DType, norm: bool, stages: int, spread: int = 1) -> bool:
    """Whether the skinny product's norm prologue normalizes x once in the block, into shared memory
    (gemv.cu.jinja's ``coop_norm``), rather than in the lanes' fragments (5-8 rows) or tile by tile.
    At 1-4 rows the fragments' row lanes are mostly idle: Qwen3-0.6B's batch-3 and 4 steps took 0.641
    and 0.669 ms against 0.752 and 0.761 with the fragments, while batch 8 lost (0.837 against 0.761;
    H200, in turns). At 9-16 rows the fragments would spill (the rows' statistic from registers takes
    at most 8), and normalizing each tile's fragments again took the 16-token prefill 1.365 ms against
    1.030, batch 16 1.644 ms a step against 1.270. Needs one k group (x's rows whole in the block) and
    room for them beside the ring. ``FUSEC_GEMV_COOP_NORM``: all, at 5-8 rows too; 1-2, at those only
    (the rule before the twenty-eighth session)."""
    from fusec import knobs

    rows = {"auto": M <= 4 or M > 8, "all": True, "1-2": M <= 2}[knobs.get("FUSEC_GEMV_COOP_NORM")]
    if not (norm and dtype in S.HALFS and gemv_geometry(K, dtype, spread)[2] == 1 and rows):
        return False
    xn = M * K * dtype.itemsize
    if gemv_ring_bytes(K, dtype, stages, spread) + xn > _BLOCK_SMEM:
        return False
    # past 2 rows (dynamic shared memory): not where it leaves one block an SM. The Llama-1B shape's batch-4 step
    # (K 2048: a 99 KB ring, 1 block an SM with x's 16 KB, 2 without) took 0.949 ms against 0.874.
    return M <= 2 or gemv_blocks_per_sm(K, dtype, stages, spread, xn) >= 2


def gemv_xn_bytes(M: int, K: int, dtype: DType, coop_norm: bool) -> int:
    """Dynamic shared memory of x's normalized rows (after the ring) where the block normalizes x
    once (``coop_norm``) at 3-16 rows; else 0. At 1-2 rows they are a static array of at most
    8 KB, as the decode step's products measured with (the 8 KB ``gemv_blocks_per_sm`` leaves)."""
    return M * K * dtype.itemsize if M > 2 and coop_norm else 0


def gemv_prewait(coop_norm: bool, stages: int) -> int:
    """Ring stages a skinny product issues before its PDL wait (``GemvSpec.prewait``; 0: all S - 1): one where the
    block normalizes x first (``coop_norm``): x, loaded after the wait, then arrives ahead of the rest of the
    weights, issued once it has. One stage everywhere took Qwen3-0.6B batch 1 0.577 ms a step against 0.588 (H200,
    in turns, eleventh session); its trace showed gate/up ending 1 us sooner and down (no norm, two k groups) 0.7 us
    later: so the norm products only. FUSEC_GEMV_COOP_PREWAIT=all: every product issues all S - 1 (the A/B at 9-16
    rows, where x is 16-32 KB a block)."""
    from fusec import knobs

    one = coop_norm and stages > 2 and knobs.get("FUSEC_GEMV_COOP_PREWAIT") == "one"
    return 1 if one else 0


GEMV_STAGES = 3


def gemv_form(N: int, K: int, dtype: DType, glu: bool = False, M: int = 1, norm: bool = False) -> dict[str, int]:
    """The form of the skinny product decode plans use (``GemvSpec``'s stages and tiles_per_block):
    the shared-memory ring of 3 stages, a block taking up to 4 tiles, as many as spread the tiles
    over one wave of resident blocks (132 SMs). Measured on an H200 (benchmarks/RESULTS.md, fifth
    session; each product alone, PDL, weights cycled past L2) against the register form, at M = 1:
    Llama-1B's LM head 123 us against 176 (cuBLAS 126), gate/up 18.2 against 22.4, Qwen3-0.6B's
    qkv 3.3 against 3.8; only Qwen3's o_proj was slower (2.58 against 2.46 us). M = 8 was measured
    without the norm prologue (x re-read per tile); there the ring was slower on two of ten shapes,
    by up to 1 us. The same form serves every M <= 16.

    ``spread`` (``GemvSpec.spread``): 2 from M = 8 on, where blocks of twice the warps still fit 2 to an
    SM. Qwen3-0.6B batch 8 took 0.928 ms a step with this rule, 0.987 with spread 1 everywhere, 0.933
    with 2 everywhere (H200, the plans timed in turns in one process). At batch 1 spread 2 changed
    nothing (0.769 against 0.766) and the Llama-1B shape lost (its K = 2048 blocks of 16 warps fit one
    to an SM), so M < 8 keeps 1. ``FUSEC_GEMV_SPREAD`` forces a spread (0: this rule).

    ``bulk`` (TMA bulk copies fill the ring) up to 4 rows, where K is a multiple of the k group. In
    turns on an H200 (eleventh session), Qwen3-0.6B took 0.604 ms a step at batch 1 against 0.655 with
    cp.async (the Llama-1B shape 0.802 against 0.845), 0.661 against 0.685 at batch 2, 0.781 against
    0.808 at 4; batch 8 lost (0.832 against 0.791). ``FUSEC_GEMV_BULK`` forces it on or off.

    ``l2_evict_first``: the ring's copies carry an L2 evict-first policy. A step reads each weight once, and
    without the policy those bytes push out of L2 what it reads again: the activations and norm weights a
    kernel waits for after its PDL wait, the cache rows, the kernels' code. Qwen3-0.6B on an H200 (plans in
    turns, thirty-second session): batch 1 0.547 ms a step against 0.565, batch 8 0.725 against 0.722, the
    same bits. ``FUSEC_GEMV_L2_EVICT_FIRST=0`` turns it off."""
    from fusec import knobs

    if knobs.get("FUSEC_GEMV_FORM") == "register":  # one block a tile; its norm as the rule says at no ring
        coop = {"coop_norm": True} if gemv_coop_norm(M, K, dtype, norm, 0) else {}
        return {"stages": 0, "tiles_per_block": 1} | coop
    spread = int(knobs.get("FUSEC_GEMV_SPREAD"))
    if spread == 0:
        spread = 2 if M >= 8 and gemv_blocks_per_sm(K, dtype, GEMV_STAGES, 2) >= 2 else 1
    if gemv_geometry(K, dtype, spread)[0] > 32:
        spread = 1
    tiles = cdiv(N // 2, 4) if glu else cdiv(N, 8)
    coop = gemv_coop_norm(M, K, dtype, norm, GEMV_STAGES, spread)
    slots = SMS * gemv_blocks_per_sm(K, dtype, GEMV_STAGES, spread, gemv_xn_bytes(M, K, dtype, coop))
    form: dict[str, int] = {"stages": GEMV_STAGES, "tiles_per_block": max(1, min(4, cdiv(tiles, slots)))}
    if spread != 1:
        form["spread"] = spread
    if coop:
        form["coop_norm"] = True
    if prewait := gemv_prewait(coop, GEMV_STAGES):
        form["prewait"] = prewait
    if knobs.get("FUSEC_GEMV_L2_EVICT_FIRST"):
        form["l2_evict_first"] = True
    bulk = knobs.get("FUSEC_GEMV_BULK")
    if (bulk == "1" or (bulk == "auto" and M <= 4)) and K % S.gemv_group(K, dtype, spread) == 0:
        form["bulk"] = True
    return form


@builder(S.GemvSpec)
def _gemv(spec: S.GemvSpec) -> Rendered:
    warps, ch, kg, nch = gemv_geometry(spec.K, spec.dtype, spec.spread)
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
        # the block normalizes x once into shared memory (kernel selection's record; the rule: gemv_coop_norm)
        "coop_norm": spec.coop_norm,
        "XPT": cdiv(spec.K // 8, 32 * warps),
        "stages": spec.stages, "bulk": spec.bulk, "l2ef": spec.l2_evict_first,
    }
    ctx["prewait"] = spec.prewait or (spec.stages - 1 if spec.stages else 0)  # kernel selection's record
    if spec.argmax:
        ctx.update(seed_t=ctype(spec.seed_dtype), ctr_t=ctype(spec.counter_dtype))
    params = ("x", "W") + (("g",) if spec.norm else ()) + _epi_params(e) + ("C",) \
        + (("seed", "counter", "temperature", "part") if spec.argmax else ())
    ring = gemv_ring_bytes(spec.K, spec.dtype, spec.stages, spec.spread) if spec.stages else 0
    xn = gemv_xn_bytes(spec.M, spec.K, spec.dtype, spec.coop_norm)
    ctx["xn_dyn"] = xn > 0
    ctx["min_blocks"] = gemv_blocks_per_sm(spec.K, spec.dtype, spec.stages, spec.spread, xn) if spec.stages else 0
    return Rendered("gemv.cu.jinja", ctx, (spec.grid, 1, 1), (32 * warps, 1, 1), params, shared_mem=ring + xn)
