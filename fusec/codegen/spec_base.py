"""What every kernel spec checks on construction (``fusec.codegen.specs``, ``specs_decode``):
allow-listed float dtypes, ints that are ints, positive sizes, finite soft-caps, and the
contiguous strides of a shape. A failed check is a ValueError with the message given."""

from __future__ import annotations

import math

from fusec.dtypes import DType

FLOATS = (DType.F32, DType.F16, DType.BF16)
HALFS = (DType.F16, DType.BF16)
# The SMs the kernels' geometry is planned for (grids sized to whole waves, blocks a split aims for): an H100 or H200
# SXM. A plan runs on any GPU of its arch; with fewer SMs its one-wave grids take more than one.
SMS = 132


def _req(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _ints(xs: tuple[int, ...], what: str, lo: int | None = None) -> None:
    for x in xs:
        _req(isinstance(x, int) and not isinstance(x, bool), f"{what}: {x!r} is not an int")
        _req(lo is None or x >= lo, f"{what}: {x} < {lo}")


def _pos(*pairs: tuple[str, int]) -> None:
    for what, v in pairs:
        _req(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{what} must be a positive int, got {v!r}")


def _softcap_ok(cap: float) -> bool:
    return isinstance(cap, (int, float)) and not isinstance(cap, bool) and math.isfinite(cap) and cap >= 0


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))
