"""The fused MLP's kernel spec (``MlpSpec``) and its tiling (``mlp_tiles``), shared by the
capability query (``fusec.lower.mlp.plan``: a body whose sizes no tiling covers is declined) and
the builder (``fusec.codegen.build_mlp``), so the two cannot disagree.

out = epilogue(hidden(x @ W1) @ W2) for x [M, K], W1 [K, F] (or [F, K]: ``w1_nk``), W2 [F, N]
(or [N, F]: ``w2_nk``), in one launch. ``hidden`` and ``epilogue`` are elementwise expressions
(``fusec.codegen.elementwise``) over operands: the product (kind ``acc``: the fp32 accumulator,
rounded to the storage dtype as the unfused graph stores the product), a per-column vector
(``col``: a bias), a tensor of the result's shape (``full``: a residual), or one element
(``scalar``). Each fp16/bf16 step rounds as the reference stores it. The hidden expression's
value is the second product's A operand, so it has the storage dtype.
"""

from __future__ import annotations

import dataclasses

from fusec.codegen.elementwise import Expr, dtype_of
from fusec.codegen.spec_base import FLOATS, HALFS, SMS, _pos, _req
from fusec.dtypes import DType

OPERAND_KINDS = ("acc", "col", "full", "scalar")

# The most dynamic shared memory one block may use on every arch fusec targets (sm_86, sm_89 and
# sm_120 allow 99 KiB): the spec does not know the arch it is compiled for.
MLP_SMEM = 101376
MLP_BK = 64  # k step of the first product (x's columns, W1's rows)
MLP_WARPS = 8
MLP_MAX_ACC = 64  # fp32 accumulator registers per thread for the output tile
_FLOP_RATE = 3.0e12  # mma.sync flop/s one SM sustains (rough): steers the tiling only
_BYTE_RATE = 100e9  # L2 -> SM bytes/s (rough)


@dataclasses.dataclass(frozen=True)
class MlpOperand:
    dtype: DType
    kind: str

    def __post_init__(self) -> None:
        _req(self.kind in OPERAND_KINDS, f"mlp operand kind must be one of {OPERAND_KINDS}, got {self.kind!r}")
        _req(self.dtype in FLOATS, "mlp operands are float")


@dataclasses.dataclass(frozen=True)
class MlpTiles:
    """A block owns ``bm`` rows and ``bn`` output columns; it computes the hidden activation of its
    rows ``bf`` columns at a time (first product over K in steps of ``MLP_BK``), and adds each
    chunk's share of the output tile (second product in steps of ``bk2`` hidden columns). Weight
    tiles stream through ``stages`` cp.async buffers; the block's rows of x stay in shared memory."""

    bm: int
    bn: int
    bf: int
    bk2: int
    stages: int
    warps_m: int
    warps_n: int
    smem: int  # dynamic shared memory bytes
    estimate_s: float  # the rough time the choice was made on


def _tile_elems(rows: int, cols: int) -> int:
    return rows * (cols + 8)  # +8 halfs per row: ldmatrix rows land on distinct bank groups


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def mlp_tiles(m: int, k: int, f: int, n: int, w1_nk: bool, w2_nk: bool) -> MlpTiles | None:
    """The tiling with the smallest rough time estimate, or None when the block's rows of x do not
    fit in shared memory with any tiling (K too large)."""
    kp = _cdiv(k, MLP_BK) * MLP_BK
    best: MlpTiles | None = None
    for bm, wm, wn, bf in ((16, 1, 8, 128), (32, 2, 4, 64), (64, 2, 4, 64)):
        unit = 8 * wn
        seen: set[int] = set()
        for slices in range(1, 17):
            bn = _cdiv(_cdiv(n, slices), unit) * unit
            if bn in seen:
                continue
            seen.add(bn)
            if (bm // (16 * wm)) * (bn // unit) * 4 > MLP_MAX_ACC:
                continue
            w1 = _tile_elems(bf, MLP_BK) if w1_nk else _tile_elems(MLP_BK, bf)
            bk2 = bf
            while bk2 > 16 and (_tile_elems(bn, bk2) if w2_nk else _tile_elems(bk2, bn)) > max(w1, 8192):
                bk2 //= 2
            stage = max(w1, _tile_elems(bn, bk2) if w2_nk else _tile_elems(bk2, bn))
            fixed = _tile_elems(bm, kp) + _tile_elems(bm, bf)
            stages = next((s for s in (3, 2) if 2 * (fixed + s * stage) <= MLP_SMEM), 0)
            if not stages:
                continue
            fp = _cdiv(f, bf) * bf
            blocks = _cdiv(m, bm) * _cdiv(n, bn)
            per_block = max(2.0 * bm * (kp * fp + fp * bn) / _FLOP_RATE, 2.0 * (kp * fp + fp * bn) / _BYTE_RATE)
            est = _cdiv(blocks, SMS) * per_block
            if best is None or est < best.estimate_s:
                best = MlpTiles(bm, bn, bf, bk2, stages, wm, wn, 2 * (fixed + stages * stage), est)
    return best


@dataclasses.dataclass(frozen=True)
class MlpSpec:
    """out[M, N] = epilogue(hidden(x @ W1) @ W2) in one launch (see the module doc).

    ``hidden`` is an expression over ``hidden_operands`` (exactly one of kind ``acc``: x @ W1),
    ``epilogue`` over ``out_operands`` (exactly one ``acc``: the second product); ``out_dtype`` is
    the epilogue's dtype. ``x_vec``: x starts 16-byte aligned (its rows are copied 16 bytes at a
    time; else element by element). Params: x, W1, W2, the hidden operands that are not ``acc``
    (h1, h2, ...), the epilogue's (e1, e2, ...), out."""

    M: int
    K: int
    F: int
    N: int
    dtype: DType
    hidden: Expr
    hidden_operands: tuple[MlpOperand, ...]
    epilogue: Expr
    out_operands: tuple[MlpOperand, ...]
    out_dtype: DType
    w1_nk: bool = False
    w2_nk: bool = False
    x_vec: bool = True

    def __post_init__(self) -> None:
        _pos(("M", self.M), ("K", self.K), ("F", self.F), ("N", self.N))
        _req(self.dtype in HALFS, "the fused MLP runs fp16/bf16 products on tensor cores")
        for what, v in (("K", self.K), ("F", self.F), ("N", self.N)):
            _req(v % 8 == 0, f"the fused MLP copies weights 16 bytes at a time: {what} = {v} is not a multiple of 8")
        for name, expr, ops in (("hidden", self.hidden, self.hidden_operands), ("epilogue", self.epilogue, self.out_operands)):
            _req(sum(o.kind == "acc" for o in ops) == 1, f"the {name} expression reads its product exactly once")
            _req(all(o.dtype == self.dtype for o in ops if o.kind == "acc"), f"the {name} product has the storage dtype")
            dtype_of(expr, [o.dtype for o in ops])  # raises on an expression over other operands
        _req(dtype_of(self.hidden, [o.dtype for o in self.hidden_operands]) == self.dtype,
             "the hidden activation is the second product's operand: it has the storage dtype")
        _req(dtype_of(self.epilogue, [o.dtype for o in self.out_operands]) == self.out_dtype,
             "out_dtype differs from the epilogue's dtype")
        _req(self.out_dtype in FLOATS, "the fused MLP's output is float")
        _req(self.tiles is not None, f"the fused MLP keeps a block's rows of x in shared memory: K = {self.K} "
             f"does not fit ({MLP_SMEM} bytes)")

    @property
    def tiles(self) -> MlpTiles | None:
        return mlp_tiles(self.M, self.K, self.F, self.N, self.w1_nk, self.w2_nk)
