"""TOPK's kernel spec and builder (templates/topk.cu.jinja): int64 indices of the k best elements
of each row of ``x`` viewed as [outer, cols, inner], best first, ties by the lower index."""

from __future__ import annotations

import dataclasses

from fusec.codegen.kernels import Rendered, builder, cdiv, kernel_name
from fusec.codegen.render import compute_ctype, ctype
from fusec.dtypes import DType

MAX_K = 32  # each thread keeps a sorted list of k candidates in registers
_INT32_MAX = 2**31 - 1


def _req(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True)
class TopKSpec:
    """Params: x, out. ``out`` is int64 [outer, k, inner]. ``largest``: the k largest (a NaN ranks
    above every number, as in the reference's argsort), else the k smallest (NaN ranks last)."""

    outer: int
    cols: int
    inner: int
    k: int
    dtype: DType
    largest: bool = True

    def __post_init__(self) -> None:
        for what, v in (("outer", self.outer), ("cols", self.cols), ("inner", self.inner), ("k", self.k)):
            _req(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"topk: {what} must be an int >= 1")
        _req(self.k <= min(self.cols, MAX_K), f"topk: k must be <= min(cols, {MAX_K}), got {self.k}")
        _req(self.cols <= _INT32_MAX, "topk: the axis must have fewer than 2**31 elements")
        _req(self.dtype.is_float or self.dtype in (DType.I64, DType.I32), f"topk: no kernel for {self.dtype}")


def topk_block(cols: int) -> int:
    """Threads per row: a warp for short rows, up to 256 for long ones."""
    return min(256, max(32, cdiv(cdiv(cols, 8), 32) * 32))


@builder(TopKSpec)
def _topk(spec: TopKSpec) -> Rendered:
    block = topk_block(spec.cols)
    rows = spec.outer * spec.inner
    ctx = {"name": kernel_name("topk", spec), "x_t": ctype(spec.dtype), "v_t": compute_ctype(spec.dtype),
           "is_float": spec.dtype.is_float, "largest": spec.largest, "cols": spec.cols, "inner": spec.inner,
           "k": spec.k, "block": block}
    return Rendered("topk.cu.jinja", ctx, (rows, 1, 1), (block, 1, 1), ("x", "out"))
