"""Strided views: how layout ops (reshape, transpose, slice, expand) compose into strides, so a
kernel can read or write through them instead of a copy kernel running before or after it.

A ``View`` is (shape, strides, offset) in elements over some contiguous buffer. ``apply`` maps a
view through one layout op; ``reshape`` is numpy's no-copy reshape rule (it fails, returning
None, exactly when the reshaped tensor is not a strided view of the same memory).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fusec.codegen.specs import contiguous_strides
from fusec.ir import Node
from fusec.ops import Op


@dataclasses.dataclass(frozen=True)
class View:
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0

    @staticmethod
    def contiguous(shape: tuple[int, ...]) -> View:
        return View(tuple(shape), contiguous_strides(tuple(shape)), 0)


def reshape(v: View, shape: tuple[int, ...]) -> View | None:
    """numpy's _attempt_nocopy_reshape: strides for ``shape`` over the same memory, or None."""
    old = [(d, s) for d, s in zip(v.shape, v.strides) if d != 1]
    new_shape = list(shape)
    if int(np.prod(v.shape, dtype=np.int64)) != int(np.prod(shape, dtype=np.int64)):
        return None
    if any(d == 0 for d in shape):
        return View(tuple(shape), tuple(0 for _ in shape), v.offset)
    new_strides = [0] * len(new_shape)
    oi, ni = 0, 0
    while ni < len(new_shape) and oi < len(old):
        # skip size-1 new dims (stride irrelevant)
        if new_shape[ni] == 1:
            new_strides[ni] = 0
            ni += 1
            continue
        op, np_ = old[oi][0], new_shape[ni]
        oj, nj = oi + 1, ni + 1
        while op != np_:
            if np_ < op:
                while nj < len(new_shape) and new_shape[nj] == 1:
                    nj += 1
                np_ *= new_shape[nj]
                nj += 1
            else:
                op *= old[oj][0]
                oj += 1
        for k in range(oi, oj - 1):  # the old run must be contiguous within itself
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return None
        new_strides[nj - 1] = old[oj - 1][1]
        for k in range(nj - 1, ni, -1):
            new_strides[k - 1] = new_strides[k] * new_shape[k] if new_shape[k] != 1 else new_strides[k]
        oi, ni = oj, nj
    for k in range(ni, len(new_shape)):
        new_strides[k] = 0  # trailing size-1 dims
    return View(tuple(shape), tuple(new_strides), v.offset)


def transpose(v: View, perm: tuple[int, ...]) -> View:
    return View(tuple(v.shape[p] for p in perm), tuple(v.strides[p] for p in perm), v.offset)


def broadcast_to(v: View, shape: tuple[int, ...]) -> View | None:
    pad = len(shape) - len(v.shape)
    if pad < 0:
        return None
    vs, st = (1,) * pad + v.shape, (0,) * pad + v.strides
    if any(a not in (1, b) for a, b in zip(vs, shape)):
        return None
    return View(tuple(shape), tuple(0 if a == 1 and b != 1 else s for a, b, s in zip(vs, shape, st)), v.offset)


def apply(v: View, node: Node) -> View | None:
    """The view of ``node``'s output, given the view of its first input; None if not a view op."""
    a = node.attrs
    if node.op == Op.RESHAPE:
        return reshape(v, node.output.shape)
    if node.op == Op.TRANSPOSE:
        return transpose(v, a.perm)
    if node.op == Op.EXPAND:
        return broadcast_to(v, node.output.shape)
    if node.op == Op.SLICE:
        shape, strides, off = list(v.shape), list(v.strides), v.offset
        for ax, s, e, st in zip(a.axes, a.starts, a.ends, a.steps):
            if st < 1:
                return None
            n = len(range(s, e, st))
            off += s * strides[ax] if n else 0
            shape[ax], strides[ax] = n, strides[ax] * st
        return View(tuple(shape), tuple(strides), off)
    return None


def inverse(v: View, node: Node) -> View | None:
    """Given the view of ``node``'s output inside some buffer, the view of its input there
    (the write side: a kernel producing the input writes straight into the output's place)."""
    if node.op == Op.RESHAPE:
        return reshape(v, node.inputs[0].shape)
    if node.op == Op.TRANSPOSE:
        return transpose(v, tuple(int(i) for i in np.argsort(node.attrs.perm)))
    return None
