"""Builder of the per-head RMSNorm -> RoPE -> (cache) kernel: one ``HeadRopeSpec``, or several in
one launch (``HeadRopeGroupSpec``: the q and k heads of one QKV product)."""

from __future__ import annotations

import dataclasses

from fusec.codegen import specs as S
from fusec.codegen.kernels import Rendered, builder, cdiv, idx_type, kernel_name
from fusec.codegen.render import ctype, float_lit
from fusec.codegen.spec_base import SMS

_WARPS = 4  # rows per block: small blocks, since decode has few rows (B x heads)


@dataclasses.dataclass(frozen=True)
class HeadRopeGroupSpec:
    """Several ``HeadRopeSpec`` parts in one launch: the grid covers part 0's rows (b, h, s), then
    part 1's, ...; each part has its own heads, x view, norm (weight, eps) and output (a cache or
    not), all share B, S, D, the dtype, cos/sin (one tensor, ``cs_strides``) and the positions.
    The parts named in ``copies`` (each writing a cache) also write their rotated rows to a
    contiguous [B, H, S, D] output (prefill: attention reads K besides the cache).
    ``fixed_pos`` >= 0: every batch row starts at that cache row (a one-row batch's literal
    positions), and there is no ``pos`` param.
    Params: x0, [w0], x1, [w1], ..., cos, sin, [pos], out0, out1, ..., [res_i for i in copies]."""

    parts: tuple[S.HeadRopeSpec, ...]
    copies: tuple[int, ...] = ()
    fixed_pos: int = -1
    rpw: int = 1  # head rows a warp (consecutive positions; kernel selection's rows_per_warp), dividing S

    def __post_init__(self) -> None:
        S._req(len(self.parts) >= 1 and all(isinstance(p, S.HeadRopeSpec) for p in self.parts),
               "a head_rope group needs HeadRopeSpec parts")
        p0 = self.parts[0]
        for i, p in enumerate(self.parts[1:], 1):
            S._req((p.B, p.S, p.D, p.dtype, p.cs_strides, p.cs_dtype) == (p0.B, p0.S, p0.D, p0.dtype, p0.cs_strides, p0.cs_dtype),
                   f"head_rope group part {i} differs from part 0 in B, S, D, dtype or cos/sin layout")
        S._req(len({p.pos_dtype for p in self.parts if p.cache_len}) <= 1, "head_rope group parts share one positions dtype")
        S._req(list(self.copies) == sorted(set(self.copies)) and all(
            isinstance(i, int) and 0 <= i < len(self.parts) and self.parts[i].cache_len for i in self.copies),
            f"head_rope group copies {self.copies} must name distinct parts that write a cache, in order")
        S._req(isinstance(self.fixed_pos, int) and self.fixed_pos >= -1, f"fixed_pos must be an int >= -1, got {self.fixed_pos!r}")
        S._req(self.rpw in (1, 2, 4) and p0.S % self.rpw == 0,
               f"rpw must be 1, 2 or 4 and divide S, got {self.rpw}")


def rows_per_warp(s: int, rows: int) -> int:
    """Kernel selection's head rows a warp (``HeadRopeGroupSpec.rpw``: consecutive positions): the most of 4, 2, 1
    that divides the positions S and leaves at least 4 blocks an SM. FUSEC_HEAD_ROPE_RPW forces a count where it
    divides S (else 1). A warp a row kept one row's loads (256 bytes at D = 128) in flight a warp: the 2,048-token
    Qwen3-0.6B prefill's kernel moved ~38 MB in 21 us (1.8 TB/s, H200); 4 rows took it to 12 us."""
    from fusec import knobs

    forced = knobs.forced_count("FUSEC_HEAD_ROPE_RPW")
    if forced is not None:
        return forced if s % forced == 0 else 1
    return next(r for r in (4, 2, 1) if s % r == 0 and (cdiv(rows // r, _WARPS) >= 4 * SMS or r == 1))


def _parts_of(spec: S.HeadRopeSpec | HeadRopeGroupSpec) -> tuple[S.HeadRopeSpec, ...]:
    return spec.parts if isinstance(spec, HeadRopeGroupSpec) else (spec,)


def _render(spec: S.HeadRopeSpec | HeadRopeGroupSpec) -> Rendered:
    parts = _parts_of(spec)
    copies = spec.copies if isinstance(spec, HeadRopeGroupSpec) else ()
    fixed = spec.fixed_pos if isinstance(spec, HeadRopeGroupSpec) else -1
    p0 = parts[0]
    rows = [p.B * p.H * p.S for p in parts]
    extent = sum(rows) + p0.D + (p0.B - 1) * p0.cs_strides[0] + (p0.S - 1) * p0.cs_strides[1]
    for p in parts:
        t_rows = p.cache_len if p.cache_len else p.S
        extent = max(extent, sum((n - 1) * st for n, st in zip((p.B, p.H, p.S), p.x_strides)) + p.D,
                     sum((n - 1) * st for n, st in zip((p.B, p.H, t_rows), p.out_strides)) + p.D)
    extent = max([extent] + [rows[i] * p0.D for i in copies])  # the contiguous copies
    caches = [p for p in parts if p.cache_len]
    rpw = spec.rpw if isinstance(spec, HeadRopeGroupSpec) else 1
    ctx = {"name": kernel_name("headrope", spec), "t": ctype(p0.dtype), "cs_t": ctype(p0.cs_dtype),
           "pos_t": ctype(caches[0].pos_dtype if caches else p0.pos_dtype), "any_cache": bool(caches) and fixed < 0,
           "fixed_pos": fixed,
           "per_lane": p0.D // 32, "half_k": p0.D // 64, "D": p0.D, "S": p0.S, "cs": p0.cs_strides, "rpw": rpw,
           "warps": _WARPS, "block": 32 * _WARPS, "idx_t": idx_type(extent), "copies": list(copies),
           "parts": [{"H": p.H, "rows": r, "xs": p.x_strides, "os": p.out_strides, "norm": p.norm,
                      "w_t": ctype(p.w_dtype or p.dtype), "eps": float_lit(p.eps),
                      "weight_offset": float_lit(p.weight_offset), "cache": p.cache_len > 0,
                      "cache_len": p.cache_len, "dual": i in copies, "rotate": p.rotate} for i, (p, r) in enumerate(zip(parts, rows))]}
    params = tuple(n for i, p in enumerate(parts) for n in (f"x{i}",) + ((f"w{i}",) if p.norm else ())) \
        + ("cos", "sin") + (("pos",) if caches and fixed < 0 else ()) + tuple(f"out{i}" for i in range(len(parts))) \
        + tuple(f"dual{i}" for i in copies)
    return Rendered("head_rope.cu.jinja", ctx, (cdiv(sum(rows) // rpw, _WARPS), 1, 1), (32 * _WARPS, 1, 1), params)


builder(S.HeadRopeSpec)(_render)
builder(HeadRopeGroupSpec)(_render)
