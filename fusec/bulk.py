"""Whole-weight array conversions done a cache-sized block at a time (compile speed, issue 13).

Each function returns exactly the bytes of its plain numpy expression (named in its docstring);
it only avoids the full-size temporaries of that expression (each a fresh allocation whose pages
the kernel must fault in and zero: for a 0.6B-parameter model, seconds) and walks memory in
blocks that stay in cache. Small arrays take the plain expression.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_BLOCK = 1 << 16  # elements per block of a conversion
_MIN = 1 << 20  # arrays smaller than this take the plain expression
_TILE = 256  # rows of a transposed block


def cast_clipped(a: np.ndarray, dtype: np.dtype, limit: float) -> np.ndarray:
    """``np.ascontiguousarray(np.clip(a, -limit, limit).astype(dtype)).reshape(a.shape)``."""
    if a.dtype != np.float32 or a.size < _MIN:
        return np.ascontiguousarray(np.clip(a, -limit, limit).astype(dtype)).reshape(a.shape)
    src = np.ascontiguousarray(a).reshape(-1)
    out = np.empty(src.shape, dtype)
    tmp = np.empty(_BLOCK, np.float32)
    lo, hi = np.float32(-limit), np.float32(limit)
    for i in range(0, src.size, _BLOCK):
        n = min(_BLOCK, src.size - i)
        np.clip(src[i:i + n], lo, hi, out=tmp[:n])
        out[i:i + n] = tmp[:n]  # the same cast as astype (round to nearest even)
    return out.reshape(a.shape)


def transposed(a: np.ndarray, perm: Sequence[int]) -> np.ndarray:
    """``np.ascontiguousarray(np.transpose(a, perm))``; a 2-D swap is copied in row tiles."""
    if a.ndim != 2 or tuple(perm) != (1, 0) or a.size < _MIN:
        return np.ascontiguousarray(np.transpose(a, perm))
    rows, cols = a.shape
    out = np.empty((cols, rows), a.dtype)
    for i in range(0, rows, _TILE):
        out[:, i:i + _TILE] = a[i:i + _TILE].T
    return out
