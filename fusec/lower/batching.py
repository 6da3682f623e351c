"""Layout plans for the lowerings of broadcast matrix products and of reductions over
non-adjacent axes: pure index arithmetic, no Context, so the CPU tests check it directly.

Matrix products. cuBLAS's strided-batched GEMM reads product ``i`` of an operand at
``base + i * stride``: one stride per operand over one flat batch index. A broadcast product
(``[B, M, K] @ [K, N]``, ``[1, M, K] @ [B, K, N]``, 1-D operands, ``[H, 1, M, K] @ [B, H, K, N]``)
is planned as:

1. batch axes along which B does not vary but A does, at the end of the batch, fold into M (A's and
   C's rows are contiguous across them): ``[B, M, K] @ [K, N]`` is one ``[B*M, K] @ [K, N]``;
2. the remaining batch axes split into outer axes (one cuBLAS call per outer index, with each
   operand's element offset) and inner axes (one strided-batched call), the inner ones chosen as
   the longest suffix along which each operand varies on every axis (stride: its matrix size) or
   on none (stride 0);
3. past ``MAX_CALLS`` calls, an operand that varies along some of the remaining axes but not all
   is first copied broadcast to all of them (scratch), and one call covers the batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

MAX_CALLS = 16  # cuBLAS calls for one product before a broadcast operand is materialized instead


@dataclasses.dataclass(frozen=True)
class GemmBatchPlan:
    m: int  # rows of each product (M times the batch axes folded into it)
    batch: int  # products per call
    strides: tuple[int, int, int]  # elements between consecutive products of A, B, C in one call
    calls: tuple[tuple[int, int, int], ...]  # element offsets of A, B, C for each call
    expand_a: tuple[int, ...] | None  # batch shape A is first copied broadcast to (None: read as stored)
    expand_b: tuple[int, ...] | None


def _contig(shape: tuple[int, ...], unit: int) -> list[int]:
    out, acc = [0] * len(shape), unit
    for i in range(len(shape) - 1, -1, -1):
        out[i] = acc
        acc *= shape[i]
    return out


def gemm_batches(batch_a: tuple[int, ...], batch_b: tuple[int, ...], m: int, k: int, n: int,
                 max_calls: int = MAX_CALLS) -> GemmBatchPlan:
    """The plan for ``A [*batch_a, m, k] @ B [*batch_b, k, n]`` (B may be stored [.., n, k]: the
    matrix sizes are the same), both contiguous, into a contiguous ``C [*broadcast, m, n]``."""
    nd = max(len(batch_a), len(batch_b))
    ba = (1,) * (nd - len(batch_a)) + tuple(batch_a)
    bb = (1,) * (nd - len(batch_b)) + tuple(batch_b)
    full = tuple(int(d) for d in np.broadcast_shapes(ba, bb))
    axes = [i for i in range(nd) if full[i] != 1]
    while axes and bb[axes[-1]] == 1:  # step 1: fold into M (A varies there: the full extent is > 1)
        m *= full[axes.pop()]
    mk, kn, mn = m * k, k * n, m * n  # matrix sizes (A's and C's with the folded axes)
    a_var = [ba[i] != 1 for i in axes]
    b_var = [bb[i] != 1 for i in axes]

    def split(av: list[bool], bv: list[bool]) -> int:
        for j in range(len(axes) + 1):
            if len(set(av[j:])) <= 1 and len(set(bv[j:])) <= 1:
                return j
        return len(axes)

    j = split(a_var, b_var)
    expand_a = expand_b = None
    if math.prod(full[i] for i in axes[:j]) > max_calls:  # step 3: materialize the mixed operand(s)
        if len(set(a_var)) > 1:
            expand_a = tuple(full[i] if i in axes else ba[i] for i in range(nd))
            ba, a_var = expand_a, [True] * len(axes)
        if len(set(b_var)) > 1:
            expand_b = tuple(full[i] if i in axes else bb[i] for i in range(nd))
            bb, b_var = expand_b, [True] * len(axes)
        j = 0
    # element strides of each operand along the remaining axes (0 where it does not vary)
    sa = [st if v else 0 for st, v in zip(_axis_strides(ba, axes, mk), a_var)]
    sb = [st if v else 0 for st, v in zip(_axis_strides(bb, axes, kn), b_var)]
    sc = _contig(tuple(full[i] for i in axes), mn)
    inner = axes[j:]
    batch = math.prod(full[i] for i in inner)
    strides = (sa[-1], sb[-1], mn) if inner else (0, 0, mn)  # one product per call: strides unused
    calls = []
    for idx in itertools.product(*[range(full[i]) for i in axes[:j]]):
        calls.append(tuple(sum(t * s[q] for q, t in enumerate(idx)) for s in (sa, sb, sc)))
    return GemmBatchPlan(m, batch, strides, tuple(calls), expand_a, expand_b)  # type: ignore[arg-type]


def _axis_strides(shape: tuple[int, ...], axes: list[int], mat: int) -> list[int]:
    """Element stride of each of ``axes`` in a contiguous [*shape, matrix] operand whose matrix
    (with every axis after the last of ``axes`` folded into it) holds ``mat`` elements."""
    if not axes:
        return []
    unit = mat // math.prod(shape[axes[-1] + 1:])  # the axes folded into the matrix follow the last one
    cs = _contig(tuple(shape), unit)
    return [cs[i] for i in axes]


def reduce_transpose(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[tuple[int, ...] | None, int, int, int]:
    """How a row-reduce kernel ([outer, cols, inner] rows) computes a reduction of ``shape`` over
    ``axes``: (perm, outer, cols, inner), with ``perm`` None when the reduced axes are adjacent once
    extent-1 axes are ignored (the kernel reads the input as stored), else the transpose (kept
    axes first, reduced axes last, inner 1) to copy the input through first."""
    red = [i for i in axes if shape[i] != 1]
    if not red:
        return None, math.prod(shape), 1, 1
    lo, hi = min(red), max(red)
    if all(i in red or shape[i] == 1 for i in range(lo, hi + 1)):
        return None, math.prod(shape[:lo]), math.prod(shape[lo:hi + 1]), math.prod(shape[hi + 1:])
    kept = [i for i in range(len(shape)) if i not in red]
    perm = tuple(kept + red)
    return perm, math.prod(shape[i] for i in kept), math.prod(shape[i] for i in red), 1
