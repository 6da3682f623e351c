"""Whole-weight array conversions done a cache-sized block at a time (compile speed, issue 13).

Each function returns exactly the bytes of its plain numpy expression (named in its docstring);
it only avoids the full-size temporaries of that expression (each a fresh allocation whose pages
the kernel must fault in and zero: for a 0.6B-parameter model, seconds) and walks memory in
blocks that stay in cache, a part of the array per thread. Small arrays take the plain expression.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
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

    in_parts(part, src.size, _BLOCK, src.size)
    return out.reshape(a.shape)


def to_storage(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a`` as a tensor of the half-precision storage ``dtype`` (fp16/bf16): clipped to that
    dtype's finite range, then rounded to nearest even (``cast_clipped``). HF models add
    ``finfo(float32).min`` as a mask value, which fp16 would turn into -inf; a fully masked row
    would then produce NaN. The precision pass converts constants with it, and weights stored
    narrow while a model is built (``fusec.models.weights.StoredWeights``) are the same bytes."""
    import ml_dtypes

    limit = float(ml_dtypes.finfo(dtype).max)  # the target's own max: fp32's max rounds up to inf in bf16
    return cast_clipped(np.asarray(a), dtype, limit)


def transposed(a: np.ndarray, perm: Sequence[int]) -> np.ndarray:
    """``np.ascontiguousarray(np.transpose(a, perm))``; a 2-D swap is copied in row tiles."""
    if a.ndim != 2 or tuple(perm) != (1, 0) or a.size < _MIN:
        return np.ascontiguousarray(np.transpose(a, perm))
    rows, cols = a.shape
    out = np.empty((cols, rows), a.dtype)

    def part(start: int, stop: int) -> None:
        for i in range(start, stop, _TILE):
            out[:, i:min(i + _TILE, stop)] = a[i:min(i + _TILE, stop)].T

    in_parts(part, rows, _TILE, a.size)
    return out


def threads() -> int:
    """Worker threads of these copies: ``$FUSEC_BULK_THREADS``, else the CPU count (at most 16)."""
    from fusec import knobs

    n = knobs.get("FUSEC_BULK_THREADS")
    return n if n > 0 else max(1, min(16, os.cpu_count() or 1))


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def in_parts(fn: Callable[[int, int], None], n: int, unit: int, elements: int) -> None:
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


# derived(): (kind, sources, params) -> (weak references to the sources' owners, a weak reference
# to the derived array), filled only inside sharing_derived() (its depth in _SCOPES) and emptied
# when the last one ends. Weak both ways: an array is shared while some graph holds it, and one
# that only a pass's intermediate graph held (a transposed copy merged away) is not kept alive.
_DERIVED: dict[tuple[object, ...], tuple[list[weakref.ref[np.ndarray]], weakref.ref[np.ndarray]]] = {}
_DERIVED_LOCK = threading.RLock()  # re-entered: dropping an entry can end a source of another (forget)
_SCOPES = [0]
_KEPT: list[np.ndarray] = []  # derived(keep=True) arrays, held until the last scope ends


@contextlib.contextmanager
def sharing_derived() -> Iterator[None]:
    """While this lasts, ``derived`` hands out one array per derivation (see there); compiling the
    entries of one plan and preparing the reference backend's graphs run inside it."""
    with _DERIVED_LOCK:
        _SCOPES[0] += 1
    try:
        yield
    finally:
        with _DERIVED_LOCK:
            _SCOPES[0] -= 1
            if not _SCOPES[0]:
                _DERIVED.clear()
                _KEPT.clear()


def derived(kind: str, sources: Sequence[np.ndarray], params: Hashable, make: Callable[[], np.ndarray],
            keep: bool = False) -> np.ndarray:
    """``make()``, made once per (``kind``, the ``sources`` arrays by identity, ``params``) while
    ``sharing_derived`` lasts and the sources live (outside it, ``make()`` each time). The prefill
    and decode graphs of a generation plan (and of the reference backend) hold the same weight
    arrays, and the passes run on each graph in turn: a constant a pass derives from them (a merged
    product's concatenated weights, a transposed or padded copy, a weight in the storage dtype) is
    made once and shared, not once per graph (for qwen3-0.6b, 0.6 GB). ``keep``: held until the
    scope ends even where no graph holds it any more, for what costs more to make again than to
    keep (a packed weight that a later pass merges into a bigger one). Derived arrays are never
    written to, like every constant."""
    if not _SCOPES[0]:
        return make()
    # a source is known by the array owning its memory (graphs hold views of one weight) and where
    # in it the source lies; the owner's weak reference keeps its id from being reused meanwhile
    owners = [_owner(s) for s in sources]
    key = (kind, tuple((id(o), _layout(s)) for o, s in zip(owners, sources)), params)
    with _DERIVED_LOCK:
        hit = _DERIVED.get(key)
        if hit is not None and all(r() is o for r, o in zip(hit[0], owners)):
            out = hit[1]()
            if out is not None:
                return out
    out = make()

    def forget(ref: weakref.ref[np.ndarray]) -> None:  # a source died: its id may be reused
        with _DERIVED_LOCK:
            entry = _DERIVED.get(key)
            if entry is not None and any(r is ref for r in entry[0]):
                del _DERIVED[key]

    with _DERIVED_LOCK:
        _DERIVED[key] = ([weakref.ref(o, forget) for o in owners], weakref.ref(out))
        if keep:
            _KEPT.append(out)
    return out


def concat_rows(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``np.concatenate(arrays, axis=0)``, or a read-only view when the arrays already lie one
    after another in one owner's memory (C-contiguous, same dtype and trailing shape): a loader
    that packs a merge group's weights into one buffer (models/gguf.py) makes the merged product
    cost no second copy of them."""
    a0 = arrays[0]
    if len(arrays) > 1 and all(a.flags.c_contiguous and a.dtype == a0.dtype and a.shape[1:] == a0.shape[1:]
                               and _owner(a) is _owner(a0) for a in arrays):
        ptr = a0.__array_interface__["data"][0]
        for a in arrays:
            if a.__array_interface__["data"][0] != ptr:
                break
            ptr += a.nbytes
        else:
            rows = sum(a.shape[0] for a in arrays)
            return np.lib.stride_tricks.as_strided(a0, (rows,) + a0.shape[1:], a0.strides, writeable=False)
    return np.concatenate(arrays, axis=0)


def _owner(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _layout(a: np.ndarray) -> tuple[object, ...]:
    return (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)
