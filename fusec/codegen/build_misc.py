"""Builders for the memory-bound kernels: elementwise, row reductions, cumsum, embedding, rope, copy."""

from __future__ import annotations

import math

from fusec.codegen import copyspecs as C
from fusec.codegen import specs as S
from fusec.codegen.elementwise import emit_all
from fusec.codegen.kernels import Rendered, builder, cdiv, idx_type, kernel_name
from fusec.codegen.render import Ident, compute_ctype, ctype, float_lit
from fusec.codegen.spec_base import SMS
from fusec.dtypes import DType

_MAX_GRID = 1 << 20  # grid-stride loops cover the rest


def _round_fn(dt: DType) -> Ident | None:
    return {DType.F16: Ident("fc_round_f16"), DType.BF16: Ident("fc_round_bf16")}.get(dt)


def _lowest(dt: DType) -> Ident | str:
    from fusec.codegen.render import CCode

    if dt.is_float:
        return CCode("(-__int_as_float(0x7f800000))")
    return CCode("(-9223372036854775807LL - 1)")


@builder(S.ElementwiseSpec)
def _elementwise(spec: S.ElementwiseSpec) -> Rendered:
    n = math.prod(spec.shape)
    rank = len(spec.shape)
    contig = S.contiguous_strides(spec.shape)
    inputs = []
    for op in spec.inputs:
        if op.strides == contig:
            mode = "flat"
        elif all(s == 0 for s in op.strides):
            mode = "scalar"
        else:
            mode = "strided"
        inputs.append({
            "ctype": ctype(op.dtype), "compute": compute_ctype(op.dtype), "mode": Ident(mode),
            "strides": op.strides, "dims": [d for d in range(rank) if op.strides[d] != 0],
            "vector": spec.vec > 1 and op.strides[-1] == 1,
        })
    lines, results = emit_all([spec.expr, *(e for e, _ in spec.more)],
                              [(Ident(f"x{i}"), op.dtype) for i, op in enumerate(spec.inputs)])
    max_off = max([n] + [sum((d - 1) * s for d, s in zip(spec.shape, op.strides)) for op in spec.inputs])
    block = 256
    groups = n // spec.vec
    name = kernel_name("ew", spec)
    ctx = {
        "name": name, "block": block, "vec": spec.vec, "n_groups": groups, "shape": spec.shape,
        "dims_rev": list(reversed(range(rank))), "need_coords": any(x["mode"] == "strided" for x in inputs),
        "inputs": inputs, "lines": lines, "idx_t": idx_type(max_off + spec.vec),
        "outs": [{"ctype": ctype(dt), "result": r} for (r, _), dt in
                 zip(results, [spec.out_dtype, *(dt for _, dt in spec.more)])],
    }
    params = tuple(f"in{i}" for i in range(len(inputs))) + tuple(f"out{j}" for j in range(len(ctx["outs"])))
    return Rendered("elementwise.cu.jinja", ctx, (min(cdiv(groups, block), _MAX_GRID), 1, 1), (block, 1, 1), params)


def _row_geometry(nvec: int) -> tuple[int, int]:
    """(threads, items per thread): about two vector accesses per thread in flight."""
    if nvec < 128:
        block = max(32, cdiv(nvec, 32) * 32)
    else:
        block = min(1024, max(64, cdiv(cdiv(nvec, 2), 32) * 32))
    return block, cdiv(nvec, block)


WARP_ROWS = 4  # rows a block of the warp-per-row form


def warp_rows(nvec: int, rows: int, inner: int) -> bool:
    """Whether rows of ``nvec`` vectors take a warp each (WARP_ROWS a block) instead of a block each: contiguous rows
    of at most 8 vectors a lane, enough of them that every SM gets a block. BERT-base's LayerNorm (4,096 rows of 768
    halfs) took 5.7 us a launch with a block of 96 threads a row: 2.2 TB/s, its barriers between reductions."""
    return inner == 1 and nvec <= 8 * 32 and rows >= WARP_ROWS * SMS


@builder(S.RowReduceSpec)
def _row_reduce(spec: S.RowReduceSpec) -> Rendered:
    k = spec.kind
    vec = 1
    if spec.inner == 1:
        widths = [spec.dtype.itemsize] + ([spec.w_dtype.itemsize] if spec.w_dtype else [])
        vec = 16 // max(widths)
        while vec > 1 and spec.cols % vec:
            vec //= 2
    nvec = spec.cols // vec
    rpb = WARP_ROWS if warp_rows(nvec, spec.rows, spec.inner) else 1
    block, items = (32 * rpb, cdiv(nvec, 32)) if rpb > 1 else _row_geometry(nvec)
    cached = items <= 16
    is_norm = k.endswith("norm")
    out_dt = spec.w_dtype if k.endswith("rmsnorm") else spec.dtype
    params = ["x"] + (["res"] if k.startswith("add_") else []) + (["gamma"] if is_norm else [])
    params += (["beta"] if spec.has_bias else []) + (["mask"] if spec.mask_dtype else [])
    params += (["sum_out"] if k.startswith("add_") else []) + ["out"]
    ctx = {
        "name": kernel_name("row", spec), "kind": Ident(k), "cols": spec.cols, "inner": spec.inner,
        "vec": vec, "items": items, "block": block, "cached": cached, "rpb": rpb, "rows": spec.rows,
        "x_t": ctype(spec.dtype), "out_t": ctype(out_dt), "w_t": ctype(spec.w_dtype) if spec.w_dtype else None,
        "acc_t": compute_ctype(spec.dtype) if spec.dtype.is_float else ctype(DType.I64),
        "has_bias": spec.has_bias, "eps": float_lit(spec.eps, "eps"), "offset": float_lit(spec.weight_offset),
        "scale": float_lit(spec.scale, "scale") if spec.scale is not None else None,
        "mask_t": ctype(spec.mask_dtype) if spec.mask_dtype else None,
        "rows_shape": spec.rows_shape, "rows_dims_rev": list(reversed(range(len(spec.rows_shape)))),
        "mask_row_strides": spec.mask_row_strides, "mask_col_stride": spec.mask_col_stride,
        "round_x": _round_fn(spec.dtype), "lowest": _lowest(spec.dtype),
    }
    return Rendered("row_reduce.cu.jinja", ctx, (cdiv(spec.rows, rpb), 1, 1), (block, 1, 1), tuple(params))


@builder(S.CumsumSpec)
def _cumsum(spec: S.CumsumSpec) -> Rendered:
    lines = spec.outer * spec.inner
    ctx = {"name": kernel_name("cumsum", spec), "t": ctype(spec.dtype), "acc_t": compute_ctype(spec.dtype),
           "lines": lines, "n": spec.n, "inner": spec.inner, "exclusive": spec.exclusive,
           "reverse": spec.reverse, "round_x": _round_fn(spec.dtype)}
    return Rendered("cumsum.cu.jinja", ctx, (cdiv(lines, 128), 1, 1), (128, 1, 1), ("x", "out"))


@builder(S.EmbeddingSpec)
def _embedding(spec: S.EmbeddingSpec) -> Rendered:
    vec = 16 // spec.dtype.itemsize
    while spec.hidden % vec:
        vec //= 2
    block = min(256, max(32, cdiv(cdiv(spec.hidden, vec), 32) * 32))
    ctx = {"name": kernel_name("emb", spec), "t": ctype(spec.dtype), "id_t": ctype(spec.id_dtype),
           "pid_t": ctype(spec.pos_id_dtype), "hidden": spec.hidden, "vocab": spec.vocab,
           "pos_vocab": spec.pos_vocab, "vec": vec, "block": block}
    params = ("ids", "table") + (("pos_ids", "pos_table") if spec.pos_vocab else ()) + ("out",)
    return Rendered("embedding.cu.jinja", ctx, (spec.tokens, 1, 1), (block, 1, 1), params)


@builder(S.RopeSpec)
def _rope(spec: S.RopeSpec) -> Rendered:
    half = spec.rotary_dim // 2
    j = spec.D - half
    total = spec.B * spec.H * spec.S * j
    extent = max(total, sum((n - 1) * s for n, s in zip((spec.B, spec.H, spec.S), spec.x_strides)) + spec.D,
                 sum((n - 1) * s for n, s in zip((spec.B, spec.H, spec.S), spec.out_strides)) + spec.D)
    ctx = {"name": kernel_name("rope", spec), "t": ctype(spec.dtype), "cs_t": ctype(spec.cs_dtype or spec.dtype),
           "half": half, "j_count": j, "total": total, "S": spec.S, "H": spec.H, "xs": spec.x_strides,
           "os": spec.out_strides, "cs": spec.cs_strides, "block": 256, "idx_t": idx_type(extent)}
    return Rendered("rope.cu.jinja", ctx, (min(cdiv(total, 256), _MAX_GRID), 1, 1), (256, 1, 1),
                    ("x", "cos", "sin", "out"))


@builder(C.CopySpec)
def _copy(spec: C.CopySpec) -> Rendered:
    r = len(spec.shape)
    index = None
    if spec.index is not None:
        im = spec.index
        index = {"ctype": ctype(im.dtype), "strides": im.strides, "comp_stride": im.comp_stride,
                 "dims": im.dims, "axis_strides": im.axis_strides, "comps": list(range(len(im.dims)))}
    trilu = None
    if spec.trilu is not None:
        up, k, rd, cd = spec.trilu
        trilu = {"upper": bool(up), "k": int(k), "row_dim": rd, "col_dim": cd}
    total = spec.numel
    flat, threads = C.flat_ctx(spec, 256)  # the fast path of a contiguous output, or None
    ctx = {"name": kernel_name("copy", spec), "t": ctype(spec.dtype), "block": 256, "total": total, "flat": flat,
           "idx_t": idx_type(total), "shape": spec.shape, "dims_rev": list(reversed(range(r))),
           "src_strides": spec.src_strides, "dst_strides": spec.dst_strides,
           "src_offset": spec.src_offset, "dst_offset": spec.dst_offset,
           "src_mod": spec.src_mod or (0,) * r, "index": index, "scatter": spec.scatter, "trilu": trilu}
    params = ("src",) + (("index",) if index else ()) + ("dst",)
    return Rendered("copy.cu.jinja", ctx, (max(1, min(cdiv(threads, 256), _MAX_GRID)), 1, 1), (256, 1, 1), params)
