"""The quantized GEMV's form (``QGemvSpec``'s fields) once ``fusec.lower.quant.choose`` has given a product over a
packed weight to the GEMV: integer dot products over x written as two 8-bit digits per value (dp4a, up to 3 rows of
fp16/bf16 x, and up to 8 where the tensor-core form does not take the product), tensor cores for 4- to 8-bit codes
at 3-16 rows (warps a block, runs a warp), or FMAs in fp32 (rows per warp, fold). ``gemv_form`` is the one rule;
the measurements behind each of its choices are in its docstring and benchmarks/RESULTS.md."""

from __future__ import annotations

from typing import Any

from fusec.quant import FORMATS

# from this many rows of x the dp4a form takes one weight row (or 4 of one chunk) a task and no gated unit (two rows a
# task spilled, ptxas -v); ``skinny.qfits`` then leaves a gated unit apart
DP4A_WIDE_M = 4


def tc_smem_max() -> int:
    """Bytes of the tensor-core form's copy of a block's rows (a run's, where it takes runs): FUSEC_QGEMV_TC_RUN_KB,
    100 KB by default, within sm_80's 163 KB a block. Measured: a block copies its run before its PDL wait, while the
    kernel before it still runs. The 1B Q4_K_M step at batch 8 took 0.777-0.779 ms with its downs (K = 8192) in one
    run each (Q4_K 104 KB, Q6_K 141 KB; the limit was 144 KB), 0.771-0.773 with the Q6_K down in two, 0.766 with both
    in two (H200, forty-third session, calls 4-5, in turns). It binds only at 16 warps: at 4 and 8 a warp's TC_MAX_CPW
    chunks take at most ~76 KB."""
    from fusec import knobs

    return int(knobs.get("FUSEC_QGEMV_TC_RUN_KB")) << 10


# chunks a warp copies at 4 and 8 warps (64 registers a thread): ptxas -v spilled from 24 chunks of 6-bit codes, 32 of
# 4-bit (tests/test_quant_kernels.py checks the rule's forms); 16 warps have 128 registers, and shared memory bounds them
TC_MAX_CPW = 16
# fewer rows of x: the dp4a form where it fits, else the FMA form. From 3 rows the tensor-core form takes what the dp4a
# form does not (it takes 1-3 rows first): at 3 rows Llama-1B's downs (K = 8192, x's digits too large for the dp4a
# form) took 8.97 (Q4_K), 13.51 (Q6_K) and 11.30 us (Q8_0) on tensor cores against the FMA form's 16.30, 19.75 and
# 13.65 (alone, H200, twenty-fifth session, quant_bench --variants). At 1 row the FMA form was faster on every shape.
TC_MIN_M = 3
# At 4 rows of x, 8-bit products with at least this many weight rows keep the dp4a form: alone, Llama-1B's Q8_0
# gate/up (16384 rows) took 14.26 us on it against 18.45 on tensor cores, its LM head (128,256) 75.6 against 95.7,
# while its qkv (3072) and o (2048) were faster on tensor cores (6.32 against 6.78, 4.92 against 6.38); at 8 rows the
# tensor cores won all (gate/up 18.52 against 22.60, LM head 105.4 against 120.0; H200, twenty-fifth session).
DP4A_OVER_TC_N = 8192


def _tc_fits_smem(k: int, group: int, warps: int, fmt: str, passes: int = 1) -> bool:
    from fusec.codegen.build_quant import qgemv_tc_geometry

    geo = qgemv_tc_geometry(k, group, warps, fmt, passes)
    return geo["smem"] <= tc_smem_max() and (warps == 16 or geo["cpw"] <= TC_MAX_CPW)


def gemv_form(m: int, n: int, k: int, fmt: str, group: int, dtype: Any, norm: bool = False,
              glu: bool = False, siblings: bool = False) -> dict[str, object]:
    """The quantized GEMV's form at M = ``m`` for an [n, k] weight (QGemvSpec's fields); ``norm``,
    ``glu``: the product takes an RMSNorm prologue, a gated epilogue; ``siblings``: it shares its launch with products
    of the same x in other formats (``dp4a_heavy``).

    The dp4a form (``dp4a``) where it fits (``specs_quant.dp4a_fits``: fp16/bf16 x, M <= 8, x written
    in shared memory) up to 3 rows of x, and up to 8 where the tensor-core form does not take the product: x as
    two 8-bit digits per value (per 32 values), integer dot products. Measured on an H200
    (benchmarks/RESULTS.md, twelfth session), Llama-1B's shapes in Q4_K, Q6_K and Q8_0: at M = 1 it took
    0.55-0.97x the FMA form's time (gate/up Q4_K 8.6 us against 13.4, the LM head in Q6_K 68 against
    119), and at M = 2 and 4 less than the FMA and tensor-core forms on every shape (x as one int8
    digit). With two digits, as now (call 5): gate/up Q4_K 9.6 us against the FMA form's 13.3, the LM
    head in Q6_K 69 against 120, down Q4_K 8.2 against 9.8; Q8_0's small products lost 0.2-0.3 us to
    the FMA form (qkv 4.7 against 4.5) and its gate/up won 3.8. 8 warps a block; two weight rows a
    task (for a gated unit rows j and F + j), but one from K = 4096 (down: 8.2 us against 8.8). 2
    blocks an SM: alone, 3 were faster at one row of x and two weight rows a task (the LM head in Q4_K
    42 us against 47), but in the decode step 2 were 2% faster (thirteenth session: the Q4_K_M Llama-1B
    shape 0.561 ms a step against 0.573, Q8_0 0.560 against 0.571; 1 block, 0.684 and 0.637).
    FUSEC_QGEMV_DP4A_BLOCKS overrides it.

    At one row of x a lane loads 8 chunks a round over its rows: two weight rows a task below K = 8192, else one;
    but 4 chunks where 8 spill beside the norm prologue's x (``dp4a_heavy``). In the 7B Q4_K_M decode step:
    1.928 ms against 2.090 with 4 chunks (H200, fourteenth session, 8 everywhere; the Llama-1B shape 0.558 against
    0.560). FUSEC_QGEMV_DP4A_CHUNKS=4 gives 4. Sixteen chunks (4 rows a task at K = 4096: fusec's int4 and Q4_0
    compile without spills there, at 128 registers; every other format spilled) lost in the 7B int4 step: 1.786 ms
    against 1.310, the qkv 8.32 -> 14.21 us, gate/up 15.47 -> 22.69, down (two rounds of 8 chunks, not three of 4)
    9.34 -> 9.92 (H200, forty-fourth session, in turns, the same tokens): half the round trips, but slower ones.
    At 2-3 rows of x, 4 chunks a round. One block of 16 warps an SM instead of two of 8 (each SM writing x's digits
    once) was no faster (1.916 against 1.928 ms at 8 chunks; Llama-1B 0.557 against 0.558) and is gone.
    A lane takes at most K / 1024 of a row's chunks a round, so at K = 2048 (Llama-1B's gate/up and LM head) 8
    chunks over two rows are 4. Such products take 4 rows a task (two gated pairs) where every warp still gets a
    task: the Llama-1B Q4_K_M step 0.502 ms against 0.514 with two (H200, fifteenth session, both with the add
    rounding below). FUSEC_QGEMV_DP4A_FILL=0 gives two. Long rows (one a task) take two a task at half the chunks
    each where a warp then makes fewer round trips (its tasks times a task's rounds): the 7B downs (K = 11008, 344
    chunks) one task of three rounds instead of two of two. The 7B Q4_K_M step took 1.722 ms against 1.749 (H200,
    eighteenth session, the same bits); in the block trace the Q4_K down took 9.79 us after the wait against 11.23,
    the Q6_K one 12.18 against 13.38. FUSEC_QGEMV_DP4A_FILL=0 gives one row there too.
    On sm_90 the dp4a form at 4-8 rows of x, and at one row without the norm, runs in clusters of 2 blocks that take
    turns writing x's digits (``_dp4a_cluster``). A two-stage ring of shared memory for 4- to 6-bit codes (cp.async
    a round ahead, two rounds in flight) lost in the decode step (7B Q4_K_M 1.824 ms against 1.719, Llama-1B 0.532
    against 0.478; H200, nineteenth session): issuing two rounds of copies before the PDL wait made the wait pass up
    to 3 us late.
    Prefetching a warp's later weights into L2 after the wait, for x's phase to hide, lost too, and more bytes lost more
    (the 7B int4 step, H200, thirty-sixth session, in turns: none 1.396 ms; 8 KB a warp 1.541, 64 KB 1.619 as TMA bulk
    prefetches once x's first loads were issued; 8 KB as per-line prefetches right after the wait 1.593 against 1.401):
    every product slowed, the down (its first task's later rounds only) 10.66 -> 11.68 us.
    Each round's loads issued a round ahead into a second set of registers (the next task's first round at a task's
    last; all after the PDL wait) lost as well: the 7B int4 step 1.395 ms against 1.312 at 8 chunks (int4 compiled
    without spills there, 124-128 registers), 1.541 at 4; qkv 8.29 -> 9.15 us, gate/up 15.47 -> 16.25, down 9.38 ->
    10.18, LM head 22.13 -> 23.15 (H200, forty-sixth session, in turns, the same tokens; its GPU bit tests passed): a
    warp's loads in flight are not what the form waits for.

    From 4 rows (up to 8, ``specs_quant.DP4A_MAX_M``) the dp4a form takes the products the tensor-core form does
    not (8-bit codes; a gated product too, with the gated unit apart: two rows a task spilled there, ptxas -v, sm_80
    and sm_90; the 1B Q8_0 step at batch 8 took 1.697 ms against 2.696 with the FMA form's gated unit), 4 weight rows a
    task with one chunk a round each, so each read of x's digits from shared memory serves 4 rows. Measured in the
    decode step (H200): Llama-1B Q8_0 at batch 8 2.737 ms against the FMA form's 3.210 with one row a task and 2
    chunks (fourteenth session), and 4 rows a task 2.668 against 2.714 at batch 8, 1.388 against 1.402 at batch 4
    (fifteenth session). The estimate that led there (a lane reads 76 bytes of shared memory a chunk and row of x,
    ~18x the weight bytes at 8 rows, a cap of ~1.8 TB/s) was wrong as the bound: a quarter of that traffic gave
    1-2%. Zero-point operands keep one row (uint8 spilled), and so do codes of fewer than 8 bits, which reach this
    form only under FUSEC_QGEMV_FORM=dp4a: at 4 rows a task every one of them spilled (ptxas -v, sm_90: Q4_K 424 bytes
    at 4 rows of x, 2,452 at 8; fusec's int4 92 and 872), and alone at 8 rows of x that form took Llama-1B's Q4_K
    gate/up 92.4 us and its LM head 640, against 32.5 and 209 with one row a task (H200, forty-fourth session,
    quant_bench --variants); one row and 2 chunks compile without spills in every format.
    FUSEC_QGEMV_DP4A_WIDE_ROWS=1 gives one row everywhere.
    Where the tensor-core form applies it stays (Q4_K_M: 1.177 ms against the dp4a form's 1.898).

    x's digits are one 16-bit integer a value, xq = rint(x * 32767 / max|x|), as a signed high and an unsigned low byte
    (``fusec.quant.dp4a_blocks``): one FMA, byte permutes and an add, ~5 instructions a value, where base 254's two
    signed digits took ~15. In turns against base 254 (H200, thirty-seventh session; that form is gone since): the 7B
    int4 step 1.309 ms against 1.361 (down 9.41 us against 9.98, qkv 8.26 against 8.61, gate/up 15.46 against
    15.78, o 2.82 against 3.14), the 7B Q4_K_M step 1.592 against 1.648, Llama-1B Q4_K_M 0.449 against 0.458, its
    Q8_0 0.513 against 0.524; at batch 8 (the tensor-core form) the same. In clusters each block's addresses of x's
    arrays are mapped once a thread (the 7B int4 step then 1.306 against 1.359).
    A warp takes tasks block-major (task t: warp t % 8 of block t / 8, then t plus the grid's warps), so a last partial
    round runs on the first blocks' SMs: the 7B gate/up's sixth round, 448 tasks, on 56 SMs at 8 warps each. Handing
    them out warp-major instead (a warp's first task warp * blocks + block) lost: the 7B int4 step 1.346 ms against
    1.306 (gate/up 16.45 us against 15.39), Llama-1B Q4_K_M 0.460 against 0.450 (H200, thirty-eighth session, the
    same tokens); a partial round costs one round trip wherever it runs. Fewer rounds by one block of 17 warps an SM
    (96 registers a thread; the 7B gate/up 5 rounds, not 6) lost too: gate/up 17.15 us against 15.49, the step 1.357
    ms against 1.309 (H200, thirty-ninth session): two blocks an SM overlap one block's x phase with the other's loads.
    Blocks of a cluster splitting K (each block a slice of x's digits, partial sums combined over distributed shared
    memory after a cluster barrier) lost more: the o product 7.47 us against 2.85, down 14.72 against 9.34 at a split
    of 4 (the step 1.576 ms), Llama-1B Q4_K_M 0.455-0.521 ms against 0.450 at splits of 2-4 (same call).
    Every block writes all of x's digits. They are rounded by an add of 1.5 * 2^23, and a bf16 norm prologue's
    two roundings a value are done two values at a time (one F2FP, not two F2F): rintf and a float-to-int
    conversion were 4 conversions a value on a quarter-rate pipe (~2 us an SM in the down product, K = 8192, two
    blocks). The same digits and bits; measured in the decode steps (H200, fifteenth session): Llama-1B Q4_K_M
    0.514 ms against 0.534, 7B 1.859 against 1.908, Q8_0 batch 8 2.714 against 2.749. The rintf form is gone.

    With the norm prologue and x one batch of a thread's 8-value pieces (M K <= 8192), the norm's weights load
    before the PDL wait, beside the first round's weights, so the x phase after the wait has one round trip to
    memory fewer: Llama-1B Q4_K_M 0.490 ms a step against 0.504, 7B 1.780 against 1.857 (H200, fifteenth
    session, the same bits). FUSEC_QGEMV_DP4A_NORM_EARLY=0 loads them after the wait.

    The tensor-core form (``tc``) from M = TC_MIN_M where it fits (``specs_quant.tc_fits``:
    4- to 8-bit codes, M <= 16 (two tiles of 8 rows of x past 8: each chunk's weights decoded once for both; half
    the chunks unrolled, and 80 registers a thread at 4 and 8 warps: at 64 they spilled 8-184 bytes, ptxas -v,
    sm_80 and sm_90), fp16/bf16; its copy of the block's rows within ``tc_smem_max()``, at most
    TC_MAX_CPW chunks a warp below 16 warps); it has no norm prologue, so fusion leaves the norm out of it
    (``fusec.lower.skinny.qfits``), and takes its gated epilogue unless FUSEC_QGEMV_TC_GATE=0. A norm prologue was
    built and lost (x * g into the mma, 1 / rms from a Gram mma's diagonal in the epilogue: no RMSNorm launch left;
    the 1B Q4_K_M step at batch 8 0.848-0.852 ms against 0.817-0.819 with the norm apart, 0.888 with the norm weight
    in shared memory (7 blocks an SM, not 8); H200, forty-first session, commits 3643faa, a712eee, d2c8747): the normed
    products grew more (the gate/up 12.7 -> 16.4 us) than the norms' launches had cost on the critical path.
    Blocks of 2 or 4 16-row tiles (each warp summing them all with x's fragments loaded once: at 8 rows of x a
    block of one tile reads all of x from L2, 32 KB at K = 2048, more than its weights) lost too: 0.884 and 1.039 ms
    against 0.790 (the gate/up 12.5 -> 14.4 us, the LM head 116 -> 172: half the warps an SM; H200, forty-second
    session, commit d0c62fe).
    Warps a block of 16 rows: 4 where two blocks an SM run (132 SMs), 8 from 160 blocks, else 16 (fewer
    blocks, more loads in flight each); at least 8 for 8-bit codes (``_tc_min_warps``); more where the
    copy would not fit. At 4 rows the dp4a form keeps 8-bit products of at least DP4A_OVER_TC_N weight
    rows. Measured on an H200 (sixth session): at M = 8 the rule's form takes 0.33-0.78x the FMA form's
    time.

    Otherwise the FMA form: rows per warp 2 (they share each activation load; past M = 8 the
    accumulators of two rows spill, ptxas -v sm_90, so 1); at M = 1 each 8 weights' partial dot is
    scaled once (fold: 2-9% faster on Llama-1B's shapes on the H100, neutral at M = 8).
    ``FUSEC_QGEMV_FORM=tc`` leaves out the dp4a form, ``dp4a`` the tensor-core form, ``fma`` gives the FMA form
    everywhere.
    benchmarks/quant_bench.py --variants times the forms."""
    from fusec import knobs
    from fusec.codegen.build_quant import dp4a_unroll
    from fusec.codegen.spec_base import SMS
    from fusec.codegen.specs_quant import dp4a_fits, dp4a_tasks, tc_fits

    choice = knobs.get("FUSEC_QGEMV_FORM")
    tc = passes = 0  # the tensor-core form's warps a block of 16 rows and runs a warp, where it takes the product
    if tc_fits(m, fmt, dtype) and m >= TC_MIN_M and choice in ("auto", "tc"):
        blocks = -(-n // 16)
        warps = max(4 if blocks >= 2 * SMS else 8 if blocks >= 160 else 16, _tc_min_warps(fmt))
        while warps < 16 and not _tc_fits_smem(k, group, warps, fmt):
            warps *= 2
        # where a block's copy of its 16 rows is over tc_smem_max() at 16 warps (Llama-1B's downs at K = 8192: Q6_K 141
        # KB, Q4_K 104 KB), each warp copies and sums its chunks in runs, in turn (before, such products took the FMA
        # form: at 8 rows of x the 1B Q6_K down took 39.6 us, the Q4_K down on tensor cores 12.1, H200, sixteenth
        # session)
        runs = int(knobs.get("FUSEC_QGEMV_TC_RUNS"))
        passes = next((p for p in range(1, runs + 1) if _tc_fits_smem(k, group, warps, fmt, p)), 0)
        tc = warps if passes else 0
    wide = m >= DP4A_WIDE_M
    # a gated product at 4-8 rows that the tensor-core form does not take (FUSEC_QGEMV_FORM=dp4a; before the
    # twenty-fifth session, 8-bit codes) takes the dp4a form anyway, without its gated unit (``skinny.qfits`` then
    # leaves the SwiGLU apart), not the FMA form with it: the 1B Q8_0 decode step at batch 8 took 1.697 ms against
    # 2.696 (H200, sixteenth session; Nsight Compute had that FMA gate/up at 91.5 us, 0.39 TB/s).
    # FUSEC_QGEMV_WIDE_GATE=fma gives the FMA form with the gated unit.
    gate_apart = wide and glu and not tc and knobs.get("FUSEC_QGEMV_WIDE_GATE") == "dp4a"
    many = m == DP4A_WIDE_M and FORMATS[fmt].bits == 8 and n >= DP4A_OVER_TC_N  # the dp4a form over tensor cores
    if choice in ("auto", "dp4a") and dp4a_fits(m, k, norm, dtype) and (not wide or not (glu or tc) or gate_apart
                                                                        or many):
        if wide:  # 4 rows a task, one chunk each: x's digits read from shared memory once for 4 rows (8-bit codes
            # with a constant zero point only: zero-point operands spilled 8-32 bytes at 8 rows, shorter codes more)
            four = (knobs.get("FUSEC_QGEMV_DP4A_WIDE_ROWS") == "4" and FORMATS[fmt].zero is not None
                    and FORMATS[fmt].bits == 8)
            rows, chunks = (4, 4) if four else (1, 2)
        else:
            chosen = knobs.get("FUSEC_QGEMV_DP4A_CHUNKS")
            chunks = (int(chosen) if chosen != "auto" else 4 if dp4a_heavy(fmt, k, norm, siblings) else 8) if m == 1 \
                else 4
            rows = 2 if glu or k < 1024 * chunks else 1
        blocks = int(knobs.get("FUSEC_QGEMV_DP4A_BLOCKS")) or 2
        warps = blocks * 8 * SMS

        def rounds(r: int) -> int:  # a warp's serial round trips: its tasks times a task's rounds of loads
            return -(-dp4a_tasks(n, r, glu) // warps) * -(-(k // 32) // (32 * dp4a_unroll(k, r, chunks)))
        # a lane takes at most K / 1024 of a row's chunks a round: short rows fill the round with 4 rows a task (two
        # gated pairs) where every warp still gets a task (not a gated unit beside the norm over 6-bit codes: 12 bytes
        # spilled, ptxas sm_80)
        fill = 0 if wide or (norm and glu and FORMATS[fmt].bits == 6) else min(4, chunks // max(1, k // 1024))
        if (knobs.get("FUSEC_QGEMV_DP4A_FILL") and m == 1 and fill > rows
                and dp4a_tasks(n, fill, glu) >= warps):
            rows = fill
        # long rows whose last round is mostly empty (the 7B downs, K = 11008: 344 chunks, rounds of 256 and 88, two
        # tasks a warp, 4 round trips) take two rows a task at half the chunks each where that makes fewer round trips
        # (3: one task of 128 + 128 + 88)
        if knobs.get("FUSEC_QGEMV_DP4A_FILL") and not wide and rows == 1 and rounds(2) < rounds(1):
            rows = 2
        return {"rows": rows, "fold": False, "dp4a": True, "warps": 8, "blocks": blocks, "chunks": chunks,
                "norm_early": norm and bool(knobs.get("FUSEC_QGEMV_DP4A_NORM_EARLY")),
                **({"cluster": cl} if (cl := _dp4a_cluster(wide, m == 1 and not norm, glu)) > 1 else {})}
    form: dict[str, object] = {"rows": 2 if m <= 8 or tc else 1, "fold": m == 1}  # (the tensor-core form's unused)
    if tc:
        form.update(tc=True, warps=tc, **({"passes": passes} if passes > 1 else {}))
        if (stages := int(knobs.get("FUSEC_QGEMV_TC_STAGES"))) > 1:
            from fusec.codegen.build_quant import qgemv_tc_geometry

            # no more stages than a run's chunks
            form["stages"] = min(stages, qgemv_tc_geometry(k, group, tc, fmt, passes)["cpw"])
    return form


def dp4a_heavy(fmt: str, k: int, norm: bool, siblings: bool = False) -> bool:
    """Whether the dp4a form at one row of x loads 4 chunks a round instead of 8 (``gemv_form``): where 8 spill
    beside the norm prologue's x, which a thread holds in registers, ceil(K / 2048) 8-value pieces of it (8 warps).
    ptxas -v through NVRTC, sm_80 and sm_90, with and without a gated unit, K = 3072 to 16384:
    - Q6_K from K = 4096 (2 pieces; 12 bytes with a gated unit; 6-bit codes stay at 4 there, as the plans were
      measured, fourteenth session);
    - 8-bit codes and Q5_K from 3 pieces (K > 4096: 60-96 bytes at K = 4352-6144, 156-204 for fusec's uint8;
      Llama-2-13B's d 5120 spilled in Q8_0, Q5_K and int8 until the forty-fourth session, whose rule began at K = 8192;
      its Q8_0 step took 3.932 ms with 4 against 3.994 with 8, H200, in turns, the same bits);
    - Q4_K from 4 pieces (K > 6144: 84-132 bytes at K = 6656 and 7168, 48-64 at 8192), and from 3 beside
      ``siblings`` (a Q4_K_M qkv with its v in Q6_K or Q8_0 in one launch: 80 bytes at K = 5120 and 6144, none with 4
      chunks; Llama-2-13B's shape, forty-fourth session);
    - never fusec's int4 and uint4, Q4_0/1 or Q5_0/1 (one scale a group), at any of those K.
    Past 4 pieces x is read twice, not held: the rule keeps 4 there for the formats above (Q6_K and uint8 spilled
    76-544 bytes with 8 at K = 12288 and 16384). Before the thirty-fifth session every zero-point format (fusec's uint4
    and uint8) took 4 from K = 4096: the int4 7B shape's products with the norm ran at half the loads in flight.
    tests/test_quant_kernels.py compiles the rule's forms at these K."""
    f = FORMATS[fmt]
    if not norm or k < 4096:
        return False
    if f.bits == 6:
        return True
    pieces = -(-k // 2048)  # x's 8-value pieces a thread holds
    if f.bits == 8 or (f.super_block > 0 and (f.bits == 5 or siblings)):
        return pieces >= 3
    return f.super_block > 0 and pieces >= 4


def _tc_min_warps(fmt: str) -> int:
    """The tensor-core form's fewest warps a block of 16 rows: 8 for 8-bit codes (twice the code bytes a chunk), else
    4. Alone at 4 and 8 rows of x, Llama-1B's Q8_0 gate/up took 18.45 and 18.52 us on 8 warps against 20.12 and 20.07
    on the 4 the block count gave, its LM head 95.7 and 105.4 against 107.5 and 124.2 (H200, twenty-fifth session,
    quant_bench --variants). FUSEC_QGEMV_TC_MIN_WARPS sets it."""
    from fusec import knobs

    choice = knobs.get("FUSEC_QGEMV_TC_MIN_WARPS")
    return (8 if FORMATS[fmt].bits == 8 else 4) if choice == "auto" else int(choice)


def _dp4a_cluster(wide: bool, plain_one: bool, glu: bool) -> int:
    """The dp4a form's blocks a cluster (sm_90; the kernel has none elsewhere): 2 at 4-8 rows of x (``wide``), where x's
    digits are 4-8 times the work, and at one row without the norm prologue (``plain_one``), else 1; with
    FUSEC_QGEMV_DP4A_CLUSTER=gated, 2 also for a gated product with the norm at one row (the gate/up). Measured on an
    H200, decode steps in turns, the same bits: the Llama-1B Q8_0 step at batch 8 took 1.592 ms with 2 against 1.686
    with 1 (eighteenth session); 4 lost everywhere (2.384, 0.604, 1.820): the block trace had clusters of 4 placed 3-4
    blocks an SM on 124 SMs, their blocks starting up to 14 us late. At one row of x 2 on every product gave nothing
    there (7B Q4_K_M 1.722 against 1.717, Llama-1B Q4_K_M 0.491 against 0.479). In the 7B int4 step (thirty-sixth
    session) 2 on every one-row product took 1.372 ms against 1.398 with 1; per product the down took 9.79 us
    against 10.72 (K 11,008: the longest x phase), o 3.20 against 3.42, while among the products with the norm qkv
    lost (8.99 against 8.59) and gate/up and the LM head gained 0.5-0.7. The rule (2 for o and down only) against 1,
    in turns: the 7B int4 step 1.380 ms against 1.401 (down 10.18 us against 10.69, o 3.14 against 3.29), the
    Llama-1B Q4_K_M step 0.462 against 0.466, 7B Q4_K_M 1.671 against 1.673, the same tokens and bits. With x's
    byte digits (thirty-seventh session) ``gated`` (2 for the gate/up too) took the gate/up 15.14 us against 15.49, but
    the 7B int4 step 1.313 ms against 1.309 with the rule, in turns, the same tokens: not taken.
    FUSEC_QGEMV_DP4A_CLUSTER sets it."""
    from fusec import knobs

    choice = knobs.get("FUSEC_QGEMV_DP4A_CLUSTER")
    if choice in ("auto", "gated"):
        return 2 if wide or plain_one or (choice == "gated" and glu) else 1
    return int(choice)
