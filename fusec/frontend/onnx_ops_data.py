"""ONNX op handlers, part 2: data movement and shape ops.

Ops whose result is a shape (Shape, Size, Range, ConstantOfShape, Constant) always produce import-
time constants: shapes are static. Ops whose *attributes* come from inputs (Reshape's shape,
Slice's starts, Expand's shape, ...) need those inputs to be constants; ``cx.const`` says so in a
ModelError otherwise. Attribute values are normalized here as the IR's attrs records require.
"""

from __future__ import annotations

import math

import numpy as np

from fusec.frontend.emit import Const, Sym
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.ops import Op


def _prod(xs: tuple[int, ...] | list[int]) -> int:
    return int(math.prod(xs))


def reshape(cx: NodeCtx, x: Sym, shape: tuple[int, ...], final: bool = True, name: str | None = None) -> Sym:
    if tuple(x.shape) == tuple(shape):
        return x  # a no-op reshape is an alias, not a node
    return cx.emit(Op.RESHAPE, x, final=final, name=name, shape=tuple(int(d) for d in shape))


@handler("Transpose")
def _transpose(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    rank = len(x.shape)
    perm = cx.attr("perm")
    perm = tuple(range(rank))[::-1] if perm is None else tuple(cx.axis(int(p), rank, "perm entry") for p in perm)
    if perm == tuple(range(rank)):
        return [x]
    return [cx.emit(Op.TRANSPOSE, x, final=True, perm=perm)]


@handler("Reshape")
def _reshape(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    target = cx.ints(1) or []
    allowzero = bool(cx.attr("allowzero", 0))
    out: list[int] = []
    for i, d in enumerate(target):
        if d == 0 and not allowzero:
            if i >= len(x.shape):
                raise cx.fail(f"shape {target}: 0 at position {i} copies a dim the input {list(x.shape)} lacks")
            out.append(x.shape[i])
        else:
            out.append(d)
    if out.count(-1) > 1 or any(d < -1 for d in out):
        raise cx.fail(f"invalid Reshape target {target}")
    if -1 in out:
        known = _prod([d for d in out if d != -1])
        total = _prod(x.shape)
        if known == 0 or total % known:
            raise cx.fail(f"cannot reshape {list(x.shape)} to {target}")
        out[out.index(-1)] = total // known
    if _prod(out) != _prod(x.shape):
        raise cx.fail(f"cannot reshape {list(x.shape)} to {target}")
    return [reshape(cx, x, tuple(out))]


@handler("Flatten")
def _flatten(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    rank = len(x.shape)
    axis = int(cx.attr("axis", 1))
    if not -rank <= axis <= rank:
        raise cx.fail(f"axis {axis} out of range for rank {rank}")
    axis = axis + rank if axis < 0 else axis
    return [reshape(cx, x, (_prod(x.shape[:axis]), _prod(x.shape[axis:])))]


@handler("Squeeze")
def _squeeze(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    rank = len(x.shape)
    axes = cx.ints(1)
    if axes is None:
        drop = {i for i, d in enumerate(x.shape) if d == 1}
    else:
        drop = {cx.axis(a, rank) for a in axes}
        if any(x.shape[a] != 1 for a in drop):
            raise cx.fail(f"cannot squeeze axes {axes} of shape {list(x.shape)}")
    return [reshape(cx, x, tuple(d for i, d in enumerate(x.shape) if i not in drop))]


@handler("Unsqueeze")
def _unsqueeze(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    axes = cx.ints(1) or []
    rank = len(x.shape) + len(axes)
    ins = sorted({cx.axis(a, rank) for a in axes})
    if len(ins) != len(axes):
        raise cx.fail(f"repeated Unsqueeze axes {axes}")
    dims = iter(x.shape)
    return [reshape(cx, x, tuple(1 if i in ins else next(dims) for i in range(rank)))]


@handler("Concat")
def _concat(cx: NodeCtx) -> list[Sym | None]:
    xs = [cx.x(i) for i in range(len(cx.ins))]
    rank = len(xs[0].shape)
    axis = cx.axis(int(cx.attr("axis")), rank)
    if not all(isinstance(x, Const) and not x.weight for x in xs):
        # empty parts carry no data; a run-time concat need not see them
        xs = [x for x in xs if x.shape[axis] != 0] or xs[:1]
    if len(xs) == 1:
        return [xs[0]]
    return [cx.emit(Op.CONCAT, *xs, final=True, axis=axis)]


def _slice1(cx: NodeCtx, x: Sym, axis: int, start: int, end: int, step: int = 1, name: str | None = None,
            final: bool = True) -> Sym:
    if (start, end, step) == (0, x.shape[axis], 1):
        return x
    return cx.emit(Op.SLICE, x, final=final, name=name, axes=(axis,), starts=(start,), ends=(end,), steps=(step,))


@handler("Split")
def _split(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    axis = cx.axis(int(cx.attr("axis", 0)), len(x.shape))
    dim = x.shape[axis]
    n_out = len(cx.node.output)
    sizes = cx.ints(1)
    if sizes is None:
        n = int(cx.attr("num_outputs", n_out))
        chunk = -(-dim // n)  # opset 18: the last chunk may be smaller
        if cx.opset < 18 and dim % n:
            raise cx.fail(f"cannot split dim {dim} into {n} equal parts")
        sizes = [min(chunk, dim - i * chunk) for i in range(n)]
    if len(sizes) != n_out or sum(sizes) != dim or min(sizes) < 0:
        raise cx.fail(f"split sizes {sizes} do not cover dim {dim} with {n_out} outputs")
    outs: list[Sym | None] = []
    start = 0
    for i, s in enumerate(sizes):
        name = cx.node.output[i]
        outs.append(_slice1(cx, x, axis, start, start + s, name=name) if name else None)
        start += s
    return outs


def clamp_slice(dim: int, start: int, end: int, step: int) -> tuple[int, int]:
    """ONNX Slice bounds -> python range() bounds (end -1 = before index 0 for negative steps)."""
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        return max(0, min(start, dim)), max(0, min(end, dim))
    if dim == 0:
        return 0, 0  # nothing to take backwards
    # ONNX clamps a backward start to [0, dim-1] (a start before index 0 takes index 0) and the end to
    # [-1, dim-1]; a start of -1 would read as the last element in range()/numpy terms
    return max(0, min(start, dim - 1)), max(-1, min(end, dim - 1))


@handler("Slice")
def _slice(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    rank = len(x.shape)
    starts, ends = cx.ints(1) or [], cx.ints(2) or []
    axes = cx.ints(3) or list(range(len(starts)))
    steps = cx.ints(4) or [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise cx.fail("starts, ends, axes and steps differ in length")
    norm: dict[int, tuple[int, int, int]] = {}
    for s, e, a, st in zip(starts, ends, axes, steps):
        ax = cx.axis(a, rank)
        if st == 0 or ax in norm:
            raise cx.fail("zero step or repeated axis in Slice")
        s, e = clamp_slice(x.shape[ax], s, e, st)
        if (s, e, st) != (0, x.shape[ax], 1):
            norm[ax] = (s, e, st)
    if not norm:
        return [x]
    ax_sorted = sorted(norm)
    return [cx.emit(Op.SLICE, x, final=True, axes=tuple(ax_sorted), starts=tuple(norm[a][0] for a in ax_sorted),
                    ends=tuple(norm[a][1] for a in ax_sorted), steps=tuple(norm[a][2] for a in ax_sorted))]


@handler("Gather")
def _gather(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    return [cx.emit(Op.GATHER, x, cx.x(1), final=True, axis=cx.axis(int(cx.attr("axis", 0)), len(x.shape)))]


@handler("GatherElements")
def _gather_elements(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    return [cx.emit(Op.GATHER_ELEMENTS, x, cx.x(1), final=True,
                    axis=cx.axis(int(cx.attr("axis", 0)), len(x.shape)))]


@handler("GatherND")
def _gather_nd(cx: NodeCtx) -> list[Sym | None]:
    return [cx.emit(Op.GATHER_ND, cx.x(0), cx.x(1), final=True, batch_dims=int(cx.attr("batch_dims", 0)))]


@handler("ScatterND")
def _scatter_nd(cx: NodeCtx) -> list[Sym | None]:
    if cx.attr("reduction", "none") != "none":
        raise cx.fail(f"ScatterND reduction {cx.attr('reduction')!r} is not supported")
    return [cx.emit(Op.SCATTER_ND, cx.x(0), cx.x(1), cx.x(2), final=True)]


@handler("Expand")
def _expand(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    target = cx.ints(1) or []
    try:
        out = tuple(int(d) for d in np.broadcast_shapes(x.shape, tuple(target)))
    except ValueError:
        raise cx.fail(f"cannot expand {list(x.shape)} to {target}") from None
    cx.em.check_size(out, f"node {cx.node.name!r} (Expand)")
    if out == tuple(x.shape):
        return [x]
    if len(out) > len(x.shape):  # the IR's EXPAND keeps the rank: add leading 1s first
        x = reshape(cx, x, (1,) * (len(out) - len(x.shape)) + tuple(x.shape), final=False)
    return [cx.emit(Op.EXPAND, x, final=True, shape=out)]


@handler("Tile")
def _tile(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    reps = tuple(cx.ints(1) or [])
    if len(reps) != len(x.shape) or min(reps, default=1) < 0:
        raise cx.fail(f"repeats {list(reps)} do not fit shape {list(x.shape)}")
    cx.em.check_size([d * r for d, r in zip(x.shape, reps)], f"node {cx.node.name!r} (Tile)")
    if all(r == 1 for r in reps):
        return [x]
    return [cx.emit(Op.TILE, x, final=True, repeats=reps)]


@handler("Trilu")
def _trilu(cx: NodeCtx) -> list[Sym | None]:
    k = cx.ints(1)
    return [cx.emit(Op.TRILU, cx.x(0), final=True, upper=bool(cx.attr("upper", 1)), k=int(k[0]) if k else 0)]


@handler("CumSum")
def _cumsum(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    ax = cx.ints(1)
    if not ax or len(ax) != 1:
        raise cx.fail("CumSum axis must be a scalar")
    return [cx.emit(Op.CUMSUM, x, final=True, axis=cx.axis(ax[0], len(x.shape)),
                    exclusive=bool(cx.attr("exclusive", 0)), reverse=bool(cx.attr("reverse", 0)))]


# ---- ops whose result is known at import time ------------------------------------------------


@handler("Shape")
def _shape(cx: NodeCtx) -> list[Sym | None]:
    shape = cx.x(0).shape
    start, end = int(cx.attr("start", 0)), cx.attr("end")
    sl = shape[start:] if end is None else shape[start:int(end)]  # python slicing clamps like ONNX
    return [Const(np.array(sl, dtype=np.int64))]


@handler("Size")
def _size(cx: NodeCtx) -> list[Sym | None]:
    return [Const(np.array(_prod(cx.x(0).shape), dtype=np.int64))]


@handler("Range")
def _range(cx: NodeCtx) -> list[Sym | None]:
    start, limit, delta = (cx.const(i) for i in range(3))
    assert start is not None and limit is not None and delta is not None
    s, lim, d = start.item(), limit.item(), delta.item()
    if d == 0:
        raise cx.fail("Range with delta 0")
    try:
        n = max(int(math.ceil((lim - s) / d)), 0)
    except (OverflowError, ValueError):  # inf or nan bounds
        raise cx.fail(f"Range({s}, {lim}, {d}) has no finite length") from None
    cx.em.check_size((n,), f"node {cx.node.name!r} (Range)", start.dtype.itemsize)
    return [Const((s + np.arange(n, dtype=np.float64 if start.dtype.kind == "f" else np.int64) * d).astype(start.dtype))]


@handler("ConstantOfShape")
def _constant_of_shape(cx: NodeCtx) -> list[Sym | None]:
    shape = cx.ints(0) or []
    if min(shape, default=0) < 0:
        raise cx.fail(f"negative dim in shape {shape}")
    value = cx.attr("value")
    fill = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
    if fill.size != 1:
        raise cx.fail(f"value must hold one element, it holds {fill.size}")
    cx.em.check_size(shape, f"node {cx.node.name!r} (ConstantOfShape)", fill.dtype.itemsize)
    return [Const(np.full(tuple(shape), fill[0], dtype=fill.dtype))]


@handler("Constant")
def _constant(cx: NodeCtx) -> list[Sym | None]:
    kinds = {a.name for a in cx.node.attribute}
    if "value" in kinds:
        return [Const(cx.attr("value"))]
    if "value_float" in kinds:
        return [Const(np.array(cx.attr("value_float"), np.float32))]
    if "value_floats" in kinds:
        return [Const(np.array(cx.attr("value_floats"), np.float32))]
    if "value_int" in kinds:
        return [Const(np.array(cx.attr("value_int"), np.int64))]
    if "value_ints" in kinds:
        return [Const(np.array(cx.attr("value_ints"), np.int64))]
    raise cx.fail(f"Constant with {sorted(kinds)} is not supported (strings and sparse tensors are not)")
