"""The rules for QMATMUL (a product over a packed quantized weight, ``fusec.quant``): which kernel, in which form.

Kernel selection (passes/select_kernels.py) applies these rules and records them on the node; the lowering
(``fusec.lower.quant_emit``) emits what the record says. ``choose``: rows of activations M <= 8, and up to 16 on
tensor cores (``qgemv_takes``: decode steps, small batches) run fusec's quantized GEMV (``QGemvSpec``: the weight
decoded in registers, 16-byte loads of its codes, fp32 accumulation, the bias/activation/residual epilogue fused);
larger M (prefill, larger batches) takes the paths below. The GEMV's form (dp4a, tensor cores or FMAs) is
``fusec.lower.qgemv_form.gemv_form``'s.

Past the GEMV's rows (prefill) the product is dequantized in the tile of a tensor-core GEMM (``QGemmSpec``,
templates/qgemm_tc.cu.jinja: no scratch, the epilogue fused) where ``tile_wins``, else dequantized into scratch for
cuBLAS. Both are a kernel choice point (``fusec.lower.choices``): an A/B measures the other way per shape, and
FUSEC_QGEMM forces one everywhere.
"""

from __future__ import annotations

from typing import Any


def qgemv_max_rows() -> int:
    """The most rows of x the quantized GEMV takes (FUSEC_QGEMV_MAX_ROWS, 0 to QGEMV_MAX_M; 16 by default), past 8 in
    its tensor-core form only (``qgemv_takes``); a product it does not take runs a prefill's path (``choose``).
    Measured (H200, forty-fifth session, decode_step.py --ab FUSEC_QGEMV_MAX_ROWS=8, in turns): the Llama-1B Q4_K_M
    step took 0.876 ms at batch 9 against 1.566 on the prefill's paths, 0.920 against 1.580 at 12, 1.023 against 1.598
    at 16; Q8_0 at 16 1.026 against 1.622; the 7B Q4_K_M at 16 4.457 against 7.642 (the bf16 1B plan at 16: 1.991).
    Before (to the forty-fourth session) only the FMA form took 9-16 rows: 6.020 ms at 16. Fewer than 8 sends small
    batches to the prefill's paths, slower at 8 rows (sixteenth session: 1B Q8_0 2.862 ms a step against 2.702,
    Q4_K_M 2.830 against 1.175)."""
    from fusec import knobs

    return int(knobs.get("FUSEC_QGEMV_MAX_ROWS"))  # 0 to QGEMV_MAX_M (the knob's bounds)


GEMV_FORMS_M = 8  # rows of x up to which the quantized GEMV takes a product in any of its forms (``qgemv_takes``)


def qgemv_takes(m: int, n: int, k: int, fmt: str, group: int, dtype: Any) -> bool:
    """Whether the quantized GEMV takes a product of ``m`` rows of x over an [n, k] weight: up to GEMV_FORMS_M rows in
    whichever form ``gemv_form`` picks; past them, up to ``qgemv_max_rows``, only in its tensor-core form (two tiles of
    8 rows of x; where it does not fit, such as fp32 x, only the FMA form was left, 3.8x slower in the Llama-1B Q4_K_M
    step at batch 16 than the prefill's paths, forty-fourth session)."""
    from fusec.lower.qgemv_form import gemv_form

    if m > qgemv_max_rows():
        return False
    return m <= GEMV_FORMS_M or bool(gemv_form(m, n, k, fmt, group, dtype).get("tc"))


def choose(m: int, n: int, k: int, fmt: str, group: int, dtype: Any, clusters: bool = False) -> str:
    """"qgemv" (dequantize in registers) where it takes the product (``qgemv_takes``); else "qgemm" (dequantize in the
    tile of a tensor-core GEMM) where it applies (fp16/bf16 x, K a multiple of 64) and ``tile_wins``, else
    "dequant_gemm" (dequantize to scratch, then cuBLAS). FUSEC_QGEMM=tile or scratch takes one of them wherever it
    applies. ``clusters``: the target has thread block clusters (sm_90+)."""
    from fusec import knobs

    if qgemv_takes(m, n, k, fmt, group, dtype):
        return "qgemv"
    choice = knobs.get("FUSEC_QGEMM")
    tile = (tile_applies(m, n, k, fmt, group, dtype)
            and (choice == "tile" or (choice == "auto" and tile_wins(m, n, k, clusters))))
    return "qgemm" if tile else "dequant_gemm"


def tile_applies(m: int, n: int, k: int, fmt: str, group: int, dtype: Any) -> bool:
    """Whether a prefill's product may take the dequantize-in-tile GEMM: the quantized GEMV does not take it
    (``qgemv_takes``), fp16/bf16 x (the mma's types), K a multiple of 64 (its k tiles)."""
    from fusec.dtypes import DType

    return dtype in (DType.F16, DType.BF16) and k % 64 == 0 and not qgemv_takes(m, n, k, fmt, group, dtype)


TILE_MAX_ROWS = 32  # the most rows of x the rule gives the dequantize-in-tile GEMM


def tile_wins(m: int, n: int, k: int, clusters: bool = False) -> bool:
    """Where the dequantize-in-tile GEMM beat dequantize-to-scratch + cuBLAS, alone on an H200 (benchmarks/RESULTS.md,
    thirty-fourth session, qgemm_bench.py, Q4_K and Q8_0): at up to 32 rows of x, products with at least 64 weight
    rows an SM (Llama-1B's gate/up, 16384 x 2048: 30.6 us in clusters of 2 and 34.8 without, against 43.2 in Q4_K).
    Its warps are bound by the latency of their own instructions (Nsight Compute at Llama-1B's qkv: 0.26 warps issued
    a cycle of a scheduler, 1.5 active, 5.8 cycles an instruction), so a product that does not fill the GPU with
    blocks of 64 weight rows lost whichever way K was split: qkv 13.2 us at best against 10.8, o 9.3 against 9.6
    (even), down 29.7 against 23.0; at 128 rows it lost on every shape (1.6-5x)."""
    from fusec.codegen.spec_base import SMS

    return m <= TILE_MAX_ROWS and n >= 64 * SMS


QGEMM_SMEM_MAX = 100 << 10  # the tiling's shared memory: two blocks an SM
WARPS_SM = 8  # the warps an SM the dequantize-in-tile GEMM's launch bounds budget registers for


def qgemm_tiling(m: int, n: int, k: int, clusters: bool = False) -> dict[str, int]:
    """The dequantize-in-tile GEMM's block (``QGemmSpec``'s mt, rw, kw, blocks, ks): all of x's rows in one block up
    to 64 (8 mt of them, so each weight is dequantized once; 128 rows a block took ~220 registers a thread, ptxas -v).
    With clusters (sm_90), where blocks of 64 weight rows number at least an SM's: 4 warps over the 64 rows sharing each
    x tile, and K split over clusters of 2 where that gives two blocks an SM (Llama-1B's gate/up at 32 rows: 30.6 us
    against 34.8 without clusters, H200; clusters of 4 and 8 for the narrower products lost: qkv 22.1 us at 8 against
    13.2). Else 4 warps, as many over weight rows (rw) as keep two blocks an SM, the rest over K (kw) within
    QGEMM_SMEM_MAX. Registers are budgeted for WARPS_SM warps an SM (``blocks``). FUSEC_QGEMM_TILE=mt,rw,kw[,ks[,blocks]]
    sets it."""
    from fusec import knobs
    from fusec.codegen.spec_base import SMS
    from fusec.codegen.specs_quant import qgemm_smem

    forced = knobs.get("FUSEC_QGEMM_TILE")
    if forced:
        vals = forced.split(",")
        if len(vals) not in (3, 4, 5) or not all(v.strip().isdigit() for v in vals):
            from fusec.errors import InputError

            raise InputError(f"environment variable FUSEC_QGEMM_TILE={forced!r} is not mt,rw,kw[,ks[,blocks]] "
                             "(integers)")
        mt, rw, kw, *rest = (int(v) for v in vals)
        ks = rest[0] if rest else 1
        forced_tiling = {"mt": mt, "rw": rw, "kw": kw, "ks": ks,
                         "blocks": rest[1] if len(rest) > 1 else max(1, WARPS_SM // max(1, rw * kw))}
        from fusec.codegen.specs_quant import QGemmSpec
        from fusec.dtypes import DType

        try:  # the spec's own checks, on this product's shape
            QGemmSpec(m, n, k, "q8_0", 32, DType.BF16, **forced_tiling)
        except ValueError as e:
            from fusec.errors import InputError

            raise InputError(f"environment variable FUSEC_QGEMM_TILE={forced!r}: {e}") from None
        return forced_tiling
    mt = min(8, -(-m // 8))
    ys = -(-m // (8 * mt))
    base = -(-n // 64) * ys  # blocks of 64 weight rows
    if clusters and base >= SMS and k // 64 >= 4:
        return {"mt": mt, "rw": 4, "kw": 1, "ks": 1 if base >= 2 * SMS else 2, "blocks": max(1, WARPS_SM // 4)}

    for rw, kw in ((4, 1), (2, 2), (1, 4)):
        if -(-n // (16 * rw)) * ys >= 2 * SMS or rw == 1:
            while kw > 1 and qgemm_smem(mt, rw, kw) > QGEMM_SMEM_MAX:
                kw //= 2
            kw = min(kw, max(1, k // 64))
            return {"mt": mt, "rw": rw, "kw": kw, "ks": 1, "blocks": max(1, WARPS_SM // (rw * kw))}
    raise AssertionError("unreachable: rw = 1 returns")
