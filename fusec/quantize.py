"""fusec's own weight quantizer: round-to-nearest (RTN), no calibration data.

- ``int8``: per output channel (one scale per row n of W [N, K]), symmetric:
  s = max|W[n]| / 127 rounded to fp16, q = clip(round(W / s), -127, 127)  (format ``int8``, group K);
- ``int4``: per group of ``group`` (32 or 128) consecutive k, asymmetric min/max:
  s = (max - min) / 15 rounded to fp16, zero = clip(round(-min / s), 0, 15),
  q = clip(round(W / s) + zero, 0, 15)  (format ``uint4``: codes and u8 zero points).

Scales are rounded to fp16 before the codes are computed, so the codes are the nearest for the
scale the kernels actually read. Rounding is half to even (numpy). ``quantize_weight`` takes W as
[N, K] (nn.Linear's [out, in]), in any float dtype; rows are independent, so large weights are
quantized a part of their rows per thread (``fusec.bulk.in_parts``).
"""

from __future__ import annotations

import numpy as np

from fusec.bulk import derived, in_parts
from fusec.dtypes import DType
from fusec.quant import CHUNK, FORMATS, QWeight, operand_types, pack_codes

METHODS = {"int8": "per-channel symmetric int8 (RTN)", "int4": "group-wise asymmetric int4 with zero points (RTN)"}
_FORMAT = {"int8": "int8", "int4": "uint4"}  # the packed format each method writes
INT4_GROUPS = (32, 128)


def _packed_as(method: str, k: int, group: int) -> tuple[str, int]:
    """(format, group) of what ``method`` writes for rows of K: int8's one scale a row is a group of K."""
    return _FORMAT[method], (k if method == "int8" else group)


def why_not(method: str, k: int, group: int) -> str | None:
    """Why a [N, K] weight cannot be quantized with ``method`` (None: it can)."""
    if k % CHUNK:
        return f"K={k} is not a multiple of {CHUNK}"
    if method == "int4" and k % group:
        return f"K={k} is not a multiple of the int4 group {group}"
    return None


def _safe(s: np.ndarray) -> np.ndarray:
    """fp16 scales, with 1 where a row/group is constant (its codes are then all the zero point)."""
    s16 = s.astype(np.float16)
    return np.where((s16 == 0) | ~np.isfinite(s16), np.float16(1), s16)


def quantize_weight(w: np.ndarray, method: str, group: int = 128, what: str = "weight") -> QWeight:
    """W [N, K] (float) -> its packed RTN form (see the module docstring). ValueError naming
    ``what`` for a shape the method cannot take or for non-finite weights."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r} (expected one of {', '.join(METHODS)})")
    if method == "int4" and group not in INT4_GROUPS:
        raise ValueError(f"int4 group size must be one of {INT4_GROUPS}, got {group}")
    n, k = w.shape
    reason = why_not(method, k, group)
    if reason is not None:
        raise ValueError(f"{what}: {reason}")
    if method == "int8":
        out = (np.empty((n, k), np.int8), np.empty((n, 1), np.float16))
    else:
        out = (np.empty((n, k // 2), np.uint8), np.empty((n, k // group), np.float16),
               np.empty((n, k // group), np.uint8))

    def rows(start: int, stop: int) -> None:  # rows are quantized independently: a part of them per thread
        r = np.asarray(w[start:stop], dtype=np.float32)
        if not np.isfinite(r).all():
            raise ValueError(f"{what}: holds NaN or infinite values; it cannot be quantized")
        if method == "int8":
            s = _safe(np.abs(r).max(axis=1, keepdims=True) / np.float32(127))
            out[0][start:stop] = np.clip(np.rint(r / s.astype(np.float32)), -127, 127)
            out[1][start:stop] = s
            return
        g = r.reshape(stop - start, k // group, group)
        lo = np.minimum(g.min(axis=-1), 0)  # zero is representable exactly (zero point in [0, 15])
        hi = np.maximum(g.max(axis=-1), 0)
        s = _safe((hi - lo) / np.float32(15))
        s32 = s.astype(np.float32)
        zero = np.clip(np.rint(-lo / s32), 0, 15).astype(np.uint8)
        q = np.clip(np.rint(g / s32[:, :, None]) + zero[:, :, None], 0, 15).astype(np.uint8)
        out[0][start:stop] = pack_codes(q.reshape(stop - start, k), 4)[0]
        out[1][start:stop], out[2][start:stop] = s, zero

    in_parts(rows, n, 1, n * k)
    fmt, g = _packed_as(method, k, group)
    return QWeight(fmt, n, k, g, out)


def quantize_shared(w: np.ndarray, method: str, group: int = 128, what: str = "weight") -> QWeight:
    """``quantize_weight(w, ...)``, made once for every graph that holds the same weight array while
    ``fusec.bulk.sharing_derived`` lasts: a generation plan's prefill and decode entries (and the reference backend's
    graphs) pack each weight once. Before, every entry quantized every weight again: half of a 7B int4 plan's
    compile time. The packed arrays are held until the scope ends (the merged products' stacked copies besides them:
    at most the packed bytes again while a plan compiles)."""
    n, k = w.shape
    fmt, g = _packed_as(method, k, group)
    made: list[QWeight] = []

    def part(i: int) -> np.ndarray:
        if not made:
            made.append(quantize_weight(w, method, group, what))
        return made[0].arrays[i]

    count = len(operand_types(FORMATS[fmt], n, k, g, DType.F16))
    # kept for the scope: merge_gemms stacks the packed q/k/v and gate/up into new arrays, and the next entry's
    # quantize pass asks for these again
    return QWeight(fmt, n, k, g, tuple(derived("quantize", [w], (method, group, i), lambda i=i: part(i), keep=True)
                                       for i in range(count)))
