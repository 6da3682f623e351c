"""Whole-weight array conversions done a cache-sized block at a time (compile speed, issue 13).

Each function returns exactly the bytes of its plain numpy expression (named in its docstring);
it only avoids the full-size temporaries of that expression (each a fresh allocation whose pages
the kernel must fault in and zero: for a 0.6B-parameter model, seconds) and walks memory in
blocks that stay in cache, a part of the array per thread. Small arrays take the plain expression.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

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
    lo, hi = np.float32(-limit), np.float32(limit)

    def part(start: int, stop: int) -> None:
        tmp = np.empty(_BLOCK, np.float32)
        for i in range(start, stop, _BLOCK):
            n = min(_BLOCK, stop - i)
            np.clip(src[i:i + n], lo, hi, out=tmp[:n])
            out[i:i + n] = tmp[:n]  # the same cast as astype (round to nearest even)

    _in_parts(part, src.size, _BLOCK, src.size)
    return out.reshape(a.shape)


def transposed(a: np.ndarray, perm: Sequence[int]) -> np.ndarray:
    """``np.ascontiguousarray(np.transpose(a, perm))``; a 2-D swap is copied in row tiles."""
    if a.ndim != 2 or tuple(perm) != (1, 0) or a.size < _MIN:
        return np.ascontiguousarray(np.transpose(a, perm))
    rows, cols = a.shape
    out = np.empty((cols, rows), a.dtype)

    def part(start: int, stop: int) -> None:
        for i in range(start, stop, _TILE):
            out[:, i:min(i + _TILE, stop)] = a[i:min(i + _TILE, stop)].T

    _in_parts(part, rows, _TILE, a.size)
    return out


def threads() -> int:
    """Worker threads of these copies: ``$FUSEC_BULK_THREADS``, else the CPU count (at most 16)."""
    env = os.environ.get("FUSEC_BULK_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else max(1, min(16, os.cpu_count() or 1))


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _in_parts(fn: Callable[[int, int], None], n: int, unit: int, elements: int) -> None:
    """``fn(start, stop)`` over ``range(n)`` cut into one part per thread (part bounds are multiples
    of ``unit``; numpy's copies and casts release the GIL, so the parts run in parallel). Parts
    hold at least a quarter of ``_MIN`` of the array's ``elements``."""
    global _POOL
    k = min(threads(), max(1, elements * 4 // _MIN), -(-n // unit))
    if k == 1:
        fn(0, n)
        return
    step = -(-n // k // unit) * unit
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < k:  # noqa: SLF001
            _POOL = ThreadPoolExecutor(max_workers=k, thread_name_prefix="fusec-bulk")
        pool = _POOL
    for f in [pool.submit(fn, s, min(s + step, n)) for s in range(0, n, step)]:
        f.result()


def _after_fork_in_child() -> None:
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
