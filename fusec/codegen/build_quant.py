"""Builders of the kernels over packed quantized weights (templates/qgemv*.cu.jinja, templates/qgemm_tc.cu.jinja,
templates/qdequant.cu.jinja; the format's arithmetic in templates/quant.cuh)."""

from __future__ import annotations

from typing import Any

from fusec.codegen.build_gemm import _epi_params, _round_fn
from fusec.codegen.kernels import Rendered, builder, cdiv, kernel_name
from fusec.codegen.render import Ident, ctype, float_lit
from fusec.codegen.specs_quant import QDequantSpec, QGemmSpec, QGemvSpec
from fusec.dtypes import DType

_UNROLL_CHUNKS = 8  # packed chunks a lane loads per round, over all its rows (registers)


def packed_params(fmt_name: str) -> tuple[str, ...]:
    """The kernel's pointer parameters for a format's packed operands (``fusec.quant`` order)."""
    from fusec.quant import FORMATS

    f = FORMATS[fmt_name]
    out = ["codes"] + (["high"] if f.high_words else []) + ["scale"]
    out += (["sub"] if f.sub_scale is not None else []) + (["zero"] if f.zero is None else [])
    out += {"none": [], "min": ["minv"], "kmin": ["minv", "mins"]}[f.offset]
    return tuple(out)


def _format_ctx(fmt_name: str, group: int, scale_dtype: DType) -> dict[str, Any]:
    from fusec.quant import FORMATS

    f = FORMATS[fmt_name]
    return {"bits": f.bits, "signed": int(f.signed), "group": group, "sb": f.super_block or group,
            "zero": -1 if f.zero is None else f.zero,
            "sub": {None: 0, DType.U8: 1, DType.I8: 2}[f.sub_scale],
            "off": {"none": 0, "min": 1, "kmin": 2}[f.offset], "st": ctype(scale_dtype)}


def _row_ctx(spec: QGemvSpec) -> dict[str, Any]:
    """What the FMA and dp4a forms share: sizes, the storage type, the format, the norm prologue and the
    epilogue (qgemv_epilogue.jinja)."""
    return {"name": kernel_name("qgemv", spec), "M": spec.M, "N": spec.N, "K": spec.K, "R": spec.rows,
            "t": ctype(spec.dtype), "bias": spec.epilogue.bias, "act": Ident(spec.epilogue.activation),
            "residual": spec.epilogue.residual, "round_x": _round_fn(spec.dtype),
            "norm": spec.norm, "eps": float_lit(spec.eps), "weight_offset": float_lit(spec.weight_offset),
            "glu": Ident(spec.glu) if spec.glu else None, "glu_swap": spec.glu_swap, "half": spec.N // 2,
            "argmax": spec.argmax,
            **_format_ctx(spec.fmt, spec.group, spec.scale_dtype)}


def _row_params(spec: QGemvSpec) -> tuple[str, ...]:
    sib = tuple(f"{p}_{i}" for i, sb in enumerate(spec.siblings, 1) for p in packed_params(sb.fmt))
    return ("x",) + packed_params(spec.fmt) + sib + (("g",) if spec.norm else ()) + _epi_params(spec.epilogue) \
        + ("C",) + tuple(f"out_{i}" for i in range(1, len(spec.siblings) + 1)) \
        + (("seed", "counter", "temperature", "part") if spec.argmax else ())


@builder(QGemvSpec)
def _qgemv(spec: QGemvSpec) -> Rendered:
    if spec.tc:
        return _qgemv_tc(spec)
    if spec.dp4a:
        return _qgemv_dp4a(spec)
    nch = spec.K // 32
    # chunks per lane per round: enough 16-byte loads in flight, but the unrolled body (chunks x 4
    # steps x M rows x 8 FMAs) stays small enough for ptxas (M = 16 with 8 chunks took ~2 minutes)
    unroll = max(1, min(_UNROLL_CHUNKS // spec.rows, 32 // spec.M, cdiv(nch, 32)))
    ctx = {**_row_ctx(spec), "U": unroll, "fold": spec.fold}
    blocks = cdiv(spec.N // 2, 4) if spec.glu else cdiv(spec.N, 4 * spec.rows)  # 4 warps a block
    return Rendered("qgemv.cu.jinja", ctx, (blocks, 1, 1), (128, 1, 1), _row_params(spec))


def dp4a_unroll(k: int, rows: int, chunks: int) -> int:
    """The dp4a form's chunks a lane loads a round from each of a task's ``rows`` rows (of ``chunks`` over them), at
    most a row's chunks over the warp's lanes."""
    return max(1, min(chunks // rows, cdiv(k // 32, 32)))


def _qgemv_dp4a(spec: QGemvSpec) -> Rendered:
    ctx = {**_row_ctx(spec), "W": spec.warps, "BPS": spec.blocks, "norm_early": spec.norm_early,
           "bf16": spec.dtype == DType.BF16, "cluster": spec.cluster, "parts": spec.parts}
    if spec.argmax:
        ctx.update(seed_t=ctype(spec.seed_dtype), ctr_t=ctype(spec.counter_dtype))
    # the segments: the product, then each sibling (the same x, another weight and format), each in its own range of
    # blocks (QGemvSpec.segment_blocks: one wave at most, ``spec.blocks`` an SM, whose registers the launch bounds
    # give each thread), each block taking its segment's tasks in turn: a block writes x's digits once for all of its
    # tasks (on sm_90 ``spec.cluster`` blocks split that: the grid is whole clusters)
    products = [(spec.N, spec.fmt, spec.group, spec.scale_dtype, spec.rows, spec.chunks)]
    products += [(s.N, s.fmt, s.group, s.scale_dtype, s.rows, s.chunks) for s in spec.siblings]
    segs, base = [], 0
    for i, ((n, fmt, group, sdt, rows, chunks), ntask, nb) in enumerate(zip(products, spec.segment_tasks,
                                                                             spec.segment_blocks)):
        segs.append({"i": i, "N": n, "R": rows, "U": dp4a_unroll(spec.K, rows, chunks), "ntask": ntask, "base": base,
                     "nb": nb, **_format_ctx(fmt, group, sdt)})
        base += nb
    ctx["segs"] = segs
    return Rendered("qgemv_dp4a.cu.jinja", ctx, (spec.grid, 1, 1), (32 * spec.warps, 1, 1), _row_params(spec))


def qgemv_tc_geometry(K: int, group: int, warps: int, fmt: str, passes: int = 1, m: int = 8) -> dict[str, int]:
    """The tensor-core form's shared memory for ``fmt`` (a ``fusec.quant`` format): chunks per warp (a contiguous
    range), the codes' row stride (bytes: whole 128-byte lines + 16, so that 8 rows' reads fall in different banks; a
    chunk's codes are 16 bytes, 32 at 8 bits), the scale table's floats a group (``tv``: s and o - s (BIAS + z), or s
    alone where the format is ``scale_only``) and row stride (floats; a lane reads a chunk's entries of a row as one
    float or float2 each: an odd stride, or = 2 mod 4 for 8-byte reads, for the same reason), the high words' row
    stride (words: ``hb`` a chunk, = 4 mod 8) and the bytes (``m`` rows of x: the warps' partial sums reuse them,
    16 weight rows by 8 x rows a tile of x)."""
    from fusec.quant import FORMATS

    f = FORMATS[fmt]
    hb, bits = f.high_words, f.bits
    gpc = 2 if group < 32 else 1
    tv = 1 if f.scale_only else 2
    cb = 32 if bits == 8 else 16
    cpw = cdiv(K // 32, warps * passes)  # a run's chunks: a warp takes ``passes`` runs
    rsb = cdiv(cpw * cb, 128) * 128 + 16
    width = tv * cpw * gpc
    srs = width + (1 if width % 2 == 0 else 2) if tv * gpc == 1 else width + (2 if width % 4 == 0 else 4)
    # = 4 mod 8 words: rows 16-byte aligned (the 16-byte copies) and 8 rows' reads of one word in 8 different banks
    hrs = cpw * hb + (4 - cpw * hb) % 8 if hb else 0
    xt = cdiv(m, 8)  # x's tiles of 8 rows (the mma's n)
    smem = max(warps * 16 * (rsb + 4 * srs + 4 * hrs), warps * 16 * 8 * xt * 4)  # the partial sums reuse it at the end
    return {"cpw": cpw, "rsb": rsb, "srs": srs, "hrs": hrs, "gpc": gpc, "tv": tv, "cb": cb, "smem": smem}


def _qgemv_tc(spec: QGemvSpec) -> Rendered:
    from fusec.quant import FORMATS

    fp16 = spec.dtype == DType.F16
    f = FORMATS[spec.fmt]
    hb = f.high_words
    geo = qgemv_tc_geometry(spec.K, spec.group, spec.warps, spec.fmt, spec.passes, spec.M)
    cps = cdiv(geo["cpw"], spec.stages)  # chunks a stage of a run
    flip = 0x00800080 if f.bits == 8 and f.signed else 0  # signed 8-bit codes read as u = q + 128: bit 7 flipped
    if f.bits < 8:  # MAGIC | q = BIAS + q exactly: fp16 1024 (10 mantissa bits), bf16 128 (7)
        mask, magic, magic_hi, bias = 0x000F000F, 0x64006400 if fp16 else 0x43004300, 0, 1024.0 if fp16 else 128.0
    elif fp16:  # 1024 + u: 8 bits fit fp16's 10
        mask, magic, magic_hi, bias = 0x00FF00FF, 0x64006400 ^ flip, 0, 1024.0
    else:  # bf16: (128 + the low 7 bits) + (128 + 128 * bit 7) = 256 + u
        mask, magic, magic_hi, bias = 0x007F007F, 0x43004300, 0x43004300 ^ flip, 256.0
    ctx = {"name": kernel_name("qgemv", spec), "M": spec.M, "xt": cdiv(spec.M, 8), "N": spec.N, "K": spec.K,
           "warps": spec.warps, "passes": spec.passes, "stages": spec.stages, "cps": cps,
           # the high words in 16-byte copies where every row's, run's and stage's range starts on 16 bytes
           "hb16": bool(hb) and (spec.K // 32 * hb) % 4 == 0 and (geo["cpw"] * hb) % 4 == 0 and (cps * hb) % 4 == 0,
           "cpw": geo["cpw"], "rsb": geo["rsb"], "srs": geo["srs"], "gpc": geo["gpc"], "hb": hb, "hrs": geo["hrs"],
           # a scale-only format's table is s alone: the loop adds s * (dot + ZB * sum(x))
           "tv": geo["tv"], "zero_bias": float_lit(-(bias + f.zero + (128 if f.bits == 8 and f.signed else 0)))
           if f.scale_only else None,
           "batch": 8 // geo["gpc"],  # scale pairs whose loads are in flight together (registers: 3 floats a group)
           # 4 and 8 warps: 64 registers a thread, so that 1024 threads fit an SM (a 1B model's gate/up in one wave
           # of blocks); two tiles of x (M > 8): 80 (at 64 5- to 8-bit codes spilled with half the chunks unrolled,
           # ptxas -v; 64 for 4-bit codes alone, which did not, lost: the 7B Q4_K_M step at batch 16 4.773 ms against
           # 4.429, the 1B's at batch 9 0.891 against 0.873, at 16 1.006 against 1.021; H200, forty-fifth session, in
           # turns); 16 warps (few blocks): 128
           "min_blocks": 1 if spec.warps == 16 else (32 if spec.M <= 8 else 24) // spec.warps,
           "cb": geo["cb"], "code_mask": mask, "magic": magic, "magic_hi": magic_hi, "hi8": bool(magic_hi),
           "bias_value": float_lit(bias), "one": 0x3C003C00 if fp16 else 0x3F803F80,  # ONE: 1.0 twice
           "t": ctype(spec.dtype), "bias": spec.epilogue.bias, "act": Ident(spec.epilogue.activation),
           "residual": spec.epilogue.residual, "round_x": _round_fn(spec.dtype),
           "glu": Ident(spec.glu) if spec.glu else None, "glu_swap": spec.glu_swap, "half": spec.N // 2,
           **_format_ctx(spec.fmt, spec.group, spec.scale_dtype)}
    # a gated block: 8 outputs (8 weight rows of each half); else 16 weight rows
    blocks = cdiv(spec.N // 2, 8) if spec.glu else cdiv(spec.N, 16)
    return Rendered("qgemv_tc.cu.jinja", ctx, (blocks, 1, 1), (32 * spec.warps, 1, 1),
                    ("x",) + packed_params(spec.fmt) + _epi_params(spec.epilogue) + ("C",), shared_mem=geo["smem"])


@builder(QDequantSpec)
def _qdequant(spec: QDequantSpec) -> Rendered:
    rows = spec.ids or spec.rows or spec.N
    ctx = {"name": kernel_name("qdequant", spec), "K": spec.K, "N": spec.N, "rows": rows, "row0": spec.row0,
           "ids": spec.ids > 0, "id_t": ctype(spec.id_dtype), "t": ctype(spec.dtype),
           **_format_ctx(spec.fmt, spec.group, spec.scale_dtype)}
    return Rendered("qdequant.cu.jinja", ctx, (cdiv(rows * (spec.K // 32), 256), 1, 1), (256, 1, 1),
                    (("ids",) if spec.ids else ()) + packed_params(spec.fmt) + ("out",))


@builder(QGemmSpec)
def _qgemm(spec: QGemmSpec) -> Rendered:
    from fusec.quant import FORMATS

    ctx = {"name": kernel_name("qgemm", spec), "M": spec.M, "N": spec.N, "K": spec.K, "rw": spec.rw, "kw": spec.kw,
           "mt": spec.mt, "min_blocks": spec.blocks, "depth": spec.depth, "ks": spec.ks,
           "hb": bool(FORMATS[spec.fmt].high_words), "t": ctype(spec.dtype),
           "bias": spec.epilogue.bias, "act": Ident(spec.epilogue.activation), "residual": spec.epilogue.residual,
           "round_x": _round_fn(spec.dtype), **_format_ctx(spec.fmt, spec.group, spec.scale_dtype)}
    grid = (cdiv(spec.N, 16 * spec.rw), cdiv(spec.M, 8 * spec.mt), spec.ks)
    return Rendered("qgemm_tc.cu.jinja", ctx, grid, (32 * spec.rw * spec.kw, 1, 1),
                    ("x",) + packed_params(spec.fmt) + _epi_params(spec.epilogue) + ("C",), shared_mem=spec.smem)
