"""Builder for the attention template (one launch for all batches and heads)."""

from __future__ import annotations

from fusec.codegen import specs as S
from fusec.codegen.kernels import Rendered, builder, cdiv, kernel_name
from fusec.codegen.render import Ident, ctype, float_lit


@builder(S.AttentionSpec)
def _attention(spec: S.AttentionSpec) -> Rendered:
    tc = spec.dtype in S.HALFS
    qs, ks, vs, os_ = spec.strides()
    ctx = {
        "name": kernel_name("attn", spec), "tc": tc, "D": spec.D, "S": spec.S, "T": spec.T,
        "group": spec.Hq // spec.Hkv, "t": ctype(spec.dtype), "scale": float_lit(spec.scale, "scale"),
        "causal": spec.causal, "mask": Ident(spec.mask),
        "mask_t": ctype(spec.mask_dtype) if spec.mask_dtype else None, "ms": spec.mask_strides,
        "qs": qs, "ks": ks, "vs": vs, "os": os_,
    }
    rows_per_block = 64 if tc else 4
    grid = (cdiv(spec.S, rows_per_block), spec.Hq, spec.B)
    _req_grid(grid)
    params = ("q", "k", "v") + (("mask",) if spec.mask != "none" else ()) + ("out",)
    return Rendered("attention.cu.jinja", ctx, grid, (128, 1, 1), params)


def _req_grid(grid: tuple[int, int, int]) -> None:
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"attention grid {grid} exceeds the y/z launch limits")
