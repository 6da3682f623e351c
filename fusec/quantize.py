"""fusec's own weight quantizer: round-to-nearest (RTN), no calibration data.

- ``int8``: per output channel (one scale per row n of W [N, K]), symmetric:
  s = max|W[n]| / 127 rounded to fp16, q = clip(round(W / s), -127, 127)  (format ``int8``, group K);
- ``int4``: per group of ``group`` (32 or 128) consecutive k, asymmetric min/max:
  s = (max - min) / 15 rounded to fp16, zero = clip(round(-min / s), 0, 15),
  q = clip(round(W / s) + zero, 0, 15)  (format ``uint4``: codes and u8 zero points).

Scales are rounded to fp16 before the codes are computed, so the codes are the nearest for the
scale the kernels actually read. Rounding is half to even (numpy). ``quantize_weight`` takes W as
[N, K] (nn.Linear's [out, in]).
"""

from __future__ import annotations

import numpy as np

from fusec.quant import CHUNK, QWeight, pack_codes

METHODS = {"int8": "per-channel symmetric int8 (RTN)", "int4": "group-wise asymmetric int4 with zero points (RTN)"}
INT4_GROUPS = (32, 128)


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
    w = np.asarray(w, dtype=np.float32)
    if not np.isfinite(w).all():
        raise ValueError(f"{what}: holds NaN or infinite values; it cannot be quantized")
    if method == "int8":
        s = _safe(np.abs(w).max(axis=1, keepdims=True) / np.float32(127))
        q = np.clip(np.rint(w / s.astype(np.float32)), -127, 127).astype(np.int8)
        return QWeight("int8", n, k, k, pack_codes(q, 8) + (np.ascontiguousarray(s),))
    g = w.reshape(n, k // group, group)
    lo = np.minimum(g.min(axis=-1), 0)  # zero is representable exactly (zero point in [0, 15])
    hi = np.maximum(g.max(axis=-1), 0)
    s = _safe((hi - lo) / np.float32(15))
    s32 = s.astype(np.float32)
    zero = np.clip(np.rint(-lo / s32), 0, 15).astype(np.uint8)
    q = np.clip(np.rint(g / s32[:, :, None]) + zero[:, :, None], 0, 15).astype(np.uint8).reshape(n, k)
    return QWeight("uint4", n, k, group, pack_codes(q, 4) + (np.ascontiguousarray(s), np.ascontiguousarray(zero)))
