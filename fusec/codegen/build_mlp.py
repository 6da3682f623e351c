"""Builder for the fused MLP template (``MlpSpec``: a whole Linear -> activation -> Linear in one
launch). The tiling is ``specs_mlp.mlp_tiles``'s, the one the capability query checked."""

from __future__ import annotations

from typing import Any

from fusec.codegen import specs_mlp as SM
from fusec.codegen.elementwise import Expr, emit
from fusec.codegen.kernels import Rendered, builder, cdiv, kernel_name
from fusec.codegen.render import Ident, compute_ctype, ctype
from fusec.dtypes import DType


def _operands(ops: tuple[SM.MlpOperand, ...], expr: Expr, prefix: str) -> tuple[list[dict[str, Any]], list[Any], Ident]:
    """Template records of an expression's operands (the product's has no parameter), and the
    expression's statements and result variable."""
    recs: list[dict[str, Any]] = []
    n = 0
    for i, o in enumerate(ops):
        param = None
        if o.kind != "acc":
            n += 1
            param = Ident(f"{prefix}{n}")
        recs.append({"kind": Ident(o.kind), "ctype": ctype(o.dtype), "compute": compute_ctype(o.dtype),
                     "param": param, "var": Ident(f"{prefix}a{i}")})
    lines, result, _ = emit(expr, [(r["var"], o.dtype) for r, o in zip(recs, ops)], prefix=f"{prefix}v")
    return recs, lines, result


@builder(SM.MlpSpec)
def _mlp(spec: SM.MlpSpec) -> Rendered:
    tiles = spec.tiles
    if tiles is None:  # the spec refuses this on construction
        raise ValueError("no tiling fits the fused MLP")
    threads = 32 * tiles.warps_m * tiles.warps_n
    hidden_ops, hidden_lines, hidden_result = _operands(spec.hidden_operands, spec.hidden, "h")
    out_ops, out_lines, out_result = _operands(spec.out_operands, spec.epilogue, "e")
    w1 = SM._tile_elems(tiles.bf, SM.MLP_BK) if spec.w1_nk else SM._tile_elems(SM.MLP_BK, tiles.bf)
    w2 = SM._tile_elems(tiles.bn, tiles.bk2) if spec.w2_nk else SM._tile_elems(tiles.bk2, tiles.bn)
    ctx = {
        "name": kernel_name("mlp", spec), "M": spec.M, "K": spec.K, "F": spec.F, "N": spec.N,
        "t": ctype(spec.dtype), "out_t": ctype(spec.out_dtype), "threads": threads,
        "BM": tiles.bm, "BN": tiles.bn, "BF": tiles.bf, "BK": SM.MLP_BK, "BK2": tiles.bk2, "S": tiles.stages,
        "WN": tiles.warps_n, "MT": tiles.bm // (16 * tiles.warps_m), "NT1": tiles.bf // (8 * tiles.warps_n),
        "NT2": tiles.bn // (8 * tiles.warps_n), "KP": cdiv(spec.K, SM.MLP_BK) * SM.MLP_BK, "stage": max(w1, w2),
        "w1_nk": spec.w1_nk, "w2_nk": spec.w2_nk, "x_vec": spec.x_vec,
        "round_x": Ident("fc_round_f16" if spec.dtype == DType.F16 else "fc_round_bf16"),
        "hidden_ops": hidden_ops, "hidden_lines": hidden_lines, "hidden_result": hidden_result,
        "out_ops": out_ops, "out_lines": out_lines, "out_result": out_result,
    }
    grid = (cdiv(spec.N, tiles.bn), cdiv(spec.M, tiles.bm), 1)
    if grid[1] > 65535:
        raise ValueError(f"fused MLP grid {grid} exceeds the y launch limit")
    params = ("x", "W1", "W2") + tuple(str(r["param"]) for r in hidden_ops + out_ops if r["param"]) + ("out",)
    return Rendered("mlp.cu.jinja", ctx, grid, (threads, 1, 1), params, tiles.smem)
