"""Builder of the per-head RMSNorm -> RoPE -> (cache) kernel (``HeadRopeSpec``)."""

from __future__ import annotations

from fusec.codegen import specs as S
from fusec.codegen.kernels import Rendered, builder, cdiv, idx_type, kernel_name
from fusec.codegen.render import ctype, float_lit

_WARPS = 4  # rows per block: small blocks, since decode has few rows (B x heads)


@builder(S.HeadRopeSpec)
def _head_rope(spec: S.HeadRopeSpec) -> Rendered:
    rows = spec.B * spec.H * spec.S
    t_rows = spec.cache_len if spec.cache_len else spec.S
    extent = max(sum((n - 1) * st for n, st in zip((spec.B, spec.H, spec.S), spec.x_strides)),
                 sum((n - 1) * st for n, st in zip((spec.B, spec.H, t_rows), spec.out_strides)),
                 (spec.B - 1) * spec.cs_strides[0] + (spec.S - 1) * spec.cs_strides[1]) + spec.D + rows
    ctx = {"name": kernel_name("headrope", spec), "t": ctype(spec.dtype), "cs_t": ctype(spec.cs_dtype),
           "w_t": ctype(spec.w_dtype or spec.dtype), "pos_t": ctype(spec.pos_dtype), "norm": spec.norm,
           "cache": spec.cache_len > 0, "cache_len": spec.cache_len, "per_lane": spec.D // 32,
           "half_k": spec.D // 64, "D": spec.D, "S": spec.S, "H": spec.H, "rows": rows, "xs": spec.x_strides,
           "os": spec.out_strides, "cs": spec.cs_strides, "eps": float_lit(spec.eps),
           "weight_offset": float_lit(spec.weight_offset), "warps": _WARPS, "block": 32 * _WARPS,
           "idx_t": idx_type(extent)}
    params = ("x",) + (("w",) if spec.norm else ()) + ("cos", "sin") + (("pos",) if spec.cache_len else ()) + ("out",)
    return Rendered("head_rope.cu.jinja", ctx, (cdiv(rows, _WARPS), 1, 1), (32 * _WARPS, 1, 1), params)
