"""GPU lowering of ``Op.TF32_SPLIT`` (3xTF32's A operand, passes/split_tf32.py): one memory-bound
kernel (templates/tf32_split.cu.jinja) reading x [rows, K] once and writing lo | hi | hi [rows, 3K],
16-byte accesses where K is a multiple of 4 and both operands are 16-byte aligned."""

from __future__ import annotations

import dataclasses
import math

from fusec.codegen.kernels import Rendered, builder, cdiv, idx_type, kernel_name
from fusec.dtypes import DType
from fusec.ir import Node
from fusec.lower import Context, LoweringError

_BLOCK = 256
_MAX_GRID = 1 << 16  # a grid-stride loop covers the rest


@dataclasses.dataclass(frozen=True)
class Tf32SplitSpec:
    """out[r, :] = lo(x[r]) | hi(x[r]) | hi(x[r]) for x [rows, k] fp32; params: x, out."""

    rows: int
    k: int
    vec: int = 4

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.k <= 0:
            raise ValueError(f"tf32_split needs rows, k > 0 (got {self.rows}, {self.k})")
        if self.vec not in (1, 4) or self.k % self.vec:
            raise ValueError(f"tf32_split vector width {self.vec} must be 1 or 4 and divide k={self.k}")


@builder(Tf32SplitSpec)
def _build(spec: Tf32SplitSpec) -> Rendered:
    vectors = spec.rows * spec.k // spec.vec
    ctx = {"name": kernel_name("tf32split", spec), "k": spec.k, "vec": spec.vec, "block": _BLOCK,
           "vectors": vectors, "idx_t": idx_type(3 * spec.rows * spec.k)}
    return Rendered("tf32_split.cu.jinja", ctx, (min(cdiv(vectors, _BLOCK), _MAX_GRID), 1, 1), (_BLOCK, 1, 1),
                    ("x", "out"))


def lower_split(ctx: Context, node: Node, label: str) -> None:
    x, out = node.inputs[0], node.output
    if x.dtype != DType.F32 or not x.shape:
        raise LoweringError(f"{label}: tf32_split of {x.dtype.value}{list(x.shape)} (node {node.name!r}) has no "
                            f"GPU lowering; it takes fp32 of rank >= 1")
    k = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    if rows == 0 or k == 0:
        return
    vec = 4 if k % 4 == 0 and ctx.aligned(x, out) else 1
    ctx.kernel(Tf32SplitSpec(rows, k, vec), [x, out], label)
