"""Numpy definitions of the reference's indexing, integer and padding ops (slice, the gathers,
scatter_nd, trilu, mod, bit_shift, argmax/argmin, topk, pad, empty-safe reduce_max/reduce_min, softmax),
each as the ONNX operator spec defines it; ``fusec.reference.IMPL`` maps the ops to them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fusec import ops as O
from fusec.errors import InputError


def _extreme(dt: np.dtype, low: bool) -> Any:
    """The identity of max (``low``) or of min over ``dt``: what ONNX gives for an empty reduction
    (-inf/+inf where the type has them, else the type's lowest/highest value; False/True for bool)."""
    if dt == np.bool_:
        return not low
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return info.min if low else info.max
    return -np.inf if low else np.inf


def reduce_max(a: O.ReduceAttrs, x: np.ndarray) -> np.ndarray:
    return np.max(x, axis=a.axes, keepdims=a.keepdims, initial=_extreme(x.dtype, True))


def reduce_min(a: O.ReduceAttrs, x: np.ndarray) -> np.ndarray:
    return np.min(x, axis=a.axes, keepdims=a.keepdims, initial=_extreme(x.dtype, False))


def _half_up(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) if x.dtype == np.float16 or x.dtype.name == "bfloat16" else x


def mod(a: O.ModAttrs, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``fmod``: the remainder takes the dividend's sign (C fmod); else the divisor's (Python %).
    An integer remainder by zero is 0 (numpy's convention; ONNX leaves it undefined)."""
    dt = x.dtype
    xu, yu = _half_up(x), _half_up(y)
    out = np.fmod(xu, yu) if a.fmod else np.mod(xu, yu)
    return np.asarray(out).astype(dt, copy=False)


def bit_shift(a: O.BitShiftAttrs, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """ONNX BitShift: arithmetic right shift for signed types, left shifts discard the bits moved
    past the top; an amount < 0 or >= the bit width gives the sign fill (-1 right-shifting a
    negative x, else 0)."""
    x, y = np.broadcast_arrays(x, y)
    bits = x.dtype.itemsize * 8
    valid = (y >= 0) & (y < bits)
    amount = np.where(valid, y, 0).astype(np.uint64)
    if a.left:
        unsigned = np.dtype(f"u{x.dtype.itemsize}")
        shifted = np.left_shift(x.view(unsigned).astype(np.uint64), amount).astype(unsigned).view(x.dtype)
        return np.where(valid, shifted, np.zeros((), x.dtype))
    shifted = np.right_shift(x, amount.astype(x.dtype))
    fill = np.where(x < 0, -1, 0).astype(x.dtype) if x.dtype.kind == "i" else np.zeros(x.shape, x.dtype)
    return np.where(valid, shifted, fill)


def arg(fn: Callable[..., np.ndarray], a: O.ArgAttrs, x: np.ndarray) -> np.ndarray:
    """ARGMAX/ARGMIN: the first extremum's index, or the last one's with ``select_last_index``."""
    if a.select_last_index:
        n = x.shape[a.axis]
        idx = n - 1 - fn(np.flip(x, a.axis), axis=a.axis, keepdims=a.keepdims)
    else:
        idx = fn(x, axis=a.axis, keepdims=a.keepdims)
    return np.asarray(idx, dtype=np.int64)


def topk(a: O.TopKAttrs, x: np.ndarray) -> np.ndarray:
    """Indices of the k largest (smallest) along the axis, from the extremum on; among equal
    values the lower index comes first."""
    if not a.largest:
        order = np.argsort(x, axis=a.axis, kind="stable")
    else:
        # ascending stable sort of the reversed axis, reversed again: descending values with
        # equal values in ascending index order
        n = x.shape[a.axis]
        rev = np.argsort(np.flip(x, a.axis), axis=a.axis, kind="stable")
        order = n - 1 - np.flip(rev, a.axis)
    return np.take(order, np.arange(a.k), axis=a.axis).astype(np.int64)


def pad(a: O.PadAttrs, x: np.ndarray, value: np.ndarray | None = None) -> np.ndarray:
    """Negative pads crop first; the positive ones then pad in ``a.mode`` (numpy's np.pad modes
    of the same names: reflect excludes the edge, edge repeats it, wrap is periodic)."""
    rank = x.ndim
    begins, ends = a.pads[:rank], a.pads[rank:]
    crop = tuple(slice(-min(b, 0), x.shape[i] + min(e, 0)) for i, (b, e) in enumerate(zip(begins, ends)))
    x = x[crop]
    width = [(max(b, 0), max(e, 0)) for b, e in zip(begins, ends)]
    if a.mode == "constant":
        fill = np.zeros((), x.dtype) if value is None else np.asarray(value).reshape(())
        return np.pad(x, width, mode="constant", constant_values=fill)
    return np.pad(x, width, mode=a.mode)


def slice_(a: O.SliceAttrs, x: np.ndarray) -> np.ndarray:
    idx: list[Any] = [slice(None)] * x.ndim
    for ax, s, e, st in zip(a.axes, a.starts, a.ends, a.steps):
        # attrs are normalized to range() semantics; a negative end means "before index 0"
        idx[ax] = slice(s, e if e >= 0 else None, st)
    return x[tuple(idx)]


def _checked_index(idx: np.ndarray, dim: int, what: str) -> np.ndarray:
    if idx.size and (idx.min() < -dim or idx.max() >= dim):
        raise InputError(f"{what}: index out of range [{-dim}, {dim}) (min {idx.min()}, max {idx.max()})")
    return np.where(idx < 0, idx + dim, idx)


def gather(a: O.AxisAttrs, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return np.take(x, _checked_index(idx, x.shape[a.axis], "gather"), axis=a.axis)


def gather_elements(a: O.AxisAttrs, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return np.take_along_axis(x, _checked_index(idx, x.shape[a.axis], "gather_elements"), axis=a.axis)


def gather_nd(a: O.GatherNDAttrs, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    b = a.batch_dims
    k = idx.shape[-1]
    bshape = x.shape[:b]
    nb = int(np.prod(bshape, dtype=np.int64))
    xb = x.reshape((nb,) + x.shape[b:])
    ib = idx.reshape((nb, -1, k))
    out = []
    for i in range(nb):
        cols = tuple(_checked_index(ib[i, :, j], x.shape[b + j], "gather_nd") for j in range(k))
        out.append(xb[i][cols])
    res = np.stack(out)
    return res.reshape(idx.shape[:-1] + x.shape[b + k:])


def scatter_nd(a: Any, x: np.ndarray, idx: np.ndarray, upd: np.ndarray) -> np.ndarray:
    out = x.copy()
    k = idx.shape[-1]
    flat_idx = idx.reshape(-1, k)
    flat_upd = upd.reshape((flat_idx.shape[0],) + x.shape[k:])
    for i in range(flat_idx.shape[0]):
        key = tuple(int(_checked_index(flat_idx[i, j:j + 1], x.shape[j], "scatter_nd")[0]) for j in range(k))
        out[key] = flat_upd[i]
    return out


def trilu(a: O.TriluAttrs, x: np.ndarray) -> np.ndarray:
    return np.triu(x, a.k) if a.upper else np.tril(x, a.k)


# ---- 3xTF32 (passes/split_tf32.py) -----------------------------------------------------------
# A tf32 tensor-core product reads only the top 10 explicit mantissa bits of each fp32 operand
# (PyTorch's numerical-accuracy notes; the PTX mma .tf32 operands): the reference assumes the low
# 13 bits are dropped (truncation, the worse of truncation and rounding). ``tf32_hi`` rounds to
# nearest-even onto 10 bits, so it has no low bits and is read exactly under either conversion.
_TF32_LOW = np.uint32(0x1FFF)


def tf32_truncate(x: np.ndarray) -> np.ndarray:
    """What a tf32 tensor core reads of fp32 ``x``: the low 13 mantissa bits cleared."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return (bits & ~_TF32_LOW).view(np.float32)


def tf32_hi(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to nearest-even on 10 explicit mantissa bits (inf/NaN kept; a finite value
    that would round past the largest float is truncated instead, so hi stays finite)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    finite = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    up = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & ~_TF32_LOW
    up_finite = (up & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    out = np.where(finite & up_finite, up, np.where(finite, bits & ~_TF32_LOW, bits))
    return out.astype(np.uint32).view(np.float32)


def tf32_split(a: Any, x: np.ndarray) -> np.ndarray:
    """[.., K] -> [lo, mid, hi] along the last axis: lo = x - hi (exact in fp32), mid = hi; where x
    is not finite, lo = mid = 0 (mid meets lo(W): inf * lo(W) would add NaN), so x meets hi(W) only."""
    x = np.asarray(x, dtype=np.float32)
    hi = tf32_hi(x)
    finite = np.isfinite(x)
    with np.errstate(invalid="ignore"):
        lo = np.where(finite, x - hi, np.float32(0)).astype(np.float32)
    return np.concatenate([lo, np.where(finite, hi, np.float32(0)).astype(np.float32), hi], axis=-1)


def matmul_tf32(trans_b: bool, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """An fp32 product on tf32 tensor cores: both operands truncated to tf32, products exact in
    fp32 (11 x 11 significant bits), accumulated in fp32."""
    if trans_b:
        y = np.swapaxes(y, -1, -2)
    return np.matmul(tf32_truncate(x), tf32_truncate(y)).astype(np.float32, copy=False)


def wide(x: np.ndarray) -> np.dtype:
    """The dtype a high-level op computes ``x`` in: fp64 stays fp64 (gradient checks), else fp32."""
    return np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)


def softmax(a: O.AxisAttrs, x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=a.axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)  # an all -inf row gives NaN, as in onnxruntime and torch
    e = np.exp(x - m)
    return e / np.sum(e, axis=a.axis, keepdims=True)
