"""ONNX ops rewritten as IR layout and elementwise ops: RotaryEmbedding (opset 23), Hardmax,
SpaceToDepth / DepthToSpace, EyeLike.

RotaryEmbedding without interleaving is the IR's ROPE (rotate-half: the [rd/2] cos/sin caches
are repeated to [rd], gathered by ``position_ids`` when given); the interleaved form (pairs
(x[2i], x[2i+1])) is written with strided slices. Hardmax is ``iota == argmax`` along its axis.
"""

from __future__ import annotations

import numpy as np

from fusec.dtypes import DType
from fusec.frontend.emit import Const, Sym, np_dtype
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.frontend.onnx_load import np_dtype_of
from fusec.frontend.onnx_ops_data import reshape
from fusec.ops import Op


def _slice_last(cx: NodeCtx, x: Sym, start: int, end: int, step: int = 1) -> Sym:
    ax = len(x.shape) - 1
    if (start, end, step) == (0, x.shape[ax], 1):
        return x
    return cx.emit(Op.SLICE, x, axes=(ax,), starts=(start,), ends=(end,), steps=(step,))


@handler("RotaryEmbedding")
def _rotary_embedding(cx: NodeCtx) -> list[Sym | None]:
    x, cos, sin = cx.x(0), cx.x(1), cx.x(2)
    if len(x.shape) == 4:
        b, h, s, d = x.shape
        xh = x  # [B, H, S, D]: cos/sin [B, S, rd/2] go to [B, 1, S, rd/2]
    elif len(x.shape) == 3:
        heads = int(cx.attr("num_heads", 0) or 0)
        if heads <= 0 or x.shape[2] % heads:
            raise cx.fail(f"a 3-D input {list(x.shape)} needs num_heads dividing its hidden size, got {heads}")
        b, s, h, d = x.shape[0], x.shape[1], heads, x.shape[2] // heads
        xh = reshape(cx, x, (b, s, h, d), final=False)  # [B, S, H, D]: cos/sin go to [B, S, 1, rd/2]
    else:
        raise cx.fail(f"input must be rank 3 or 4, got {list(x.shape)}")
    rd = int(cx.attr("rotary_embedding_dim", 0) or 0) or d
    if rd % 2 or rd > d:
        raise cx.fail(f"rotary_embedding_dim {rd} must be even and at most the head size {d}")
    if cx.has(3):  # position ids pick rows of [max_pos, rd/2] caches
        pos = cx.x(3)
        cos, sin = (cx.emit(Op.GATHER, t, pos, axis=0) for t in (cos, sin))
    for t in (cos, sin):
        if tuple(t.shape) != (b, s, rd // 2):
            raise cx.fail(f"cos/sin of shape {list(t.shape)} (after position_ids) must be [{b}, {s}, {rd // 2}]")
        if np_dtype(t) != np_dtype(x):
            raise cx.fail(f"cos/sin dtype {np_dtype(t)} differs from the input's {np_dtype(x)}")
    head_axis = (b, 1, s, rd // 2) if len(x.shape) == 4 else (b, s, 1, rd // 2)
    cos, sin = (reshape(cx, t, head_axis, final=False) for t in (cos, sin))
    if not cx.attr("interleaved", 0):
        cos2, sin2 = (cx.emit(Op.CONCAT, t, t, axis=3) for t in (cos, sin))
        y = cx.emit(Op.ROPE, xh, cos2, sin2, final=len(x.shape) == 4, rotary_dim=rd)
    else:
        rot = _slice_last(cx, xh, 0, rd)
        x1, x2 = _slice_last(cx, rot, 0, rd, 2), _slice_last(cx, rot, 1, rd, 2)
        real = cx.emit(Op.SUB, cx.emit(Op.MUL, cos, x1), cx.emit(Op.MUL, sin, x2))
        imag = cx.emit(Op.ADD, cx.emit(Op.MUL, sin, x1), cx.emit(Op.MUL, cos, x2))
        pair = tuple(real.shape) + (1,)
        inter = cx.emit(Op.CONCAT, reshape(cx, real, pair, final=False), reshape(cx, imag, pair, final=False), axis=4)
        y = reshape(cx, inter, tuple(rot.shape), final=False)
        if rd < d:
            y = cx.emit(Op.CONCAT, y, _slice_last(cx, xh, rd, d), axis=3)
    if len(x.shape) == 3:
        y = reshape(cx, y, tuple(x.shape), name=cx.node.output[0])
    return [y]


@handler("Hardmax")
def _hardmax(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    axis = cx.axis(int(cx.attr("axis", -1)), len(x.shape))
    n = x.shape[axis]
    iota = Const(np.arange(n, dtype=np.int64).reshape(tuple(n if i == axis else 1 for i in range(len(x.shape)))))
    best = cx.emit(Op.ARGMAX, x, axis=axis, keepdims=True)
    hit = cx.emit(Op.EQUAL, iota, best)
    return [cx.emit(Op.CAST, hit, final=True, to=DType.from_np(np_dtype(x)))]


def _blocks(cx: NodeCtx) -> tuple[Sym, int, str]:
    x = cx.x(0)
    bs = int(cx.attr("blocksize", 0) or 0)
    mode = str(cx.attr("mode", "DCR"))
    if len(x.shape) != 4 or bs < 1 or mode not in ("DCR", "CRD"):
        raise cx.fail(f"needs a 4-D input, blocksize >= 1 and mode DCR or CRD, got {list(x.shape)}, {bs}, {mode!r}")
    return x, bs, mode


@handler("SpaceToDepth")
def _space_to_depth(cx: NodeCtx) -> list[Sym | None]:
    x, bs, mode = _blocks(cx)
    n, ch, hh, ww = x.shape
    if hh % bs or ww % bs:
        raise cx.fail(f"height and width {hh}x{ww} must be multiples of blocksize {bs}")
    t = reshape(cx, x, (n, ch, hh // bs, bs, ww // bs, bs), final=False)
    t = cx.emit(Op.TRANSPOSE, t, perm=(0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4))
    return [reshape(cx, t, (n, ch * bs * bs, hh // bs, ww // bs), name=cx.node.output[0])]


@handler("DepthToSpace")
def _depth_to_space(cx: NodeCtx) -> list[Sym | None]:
    x, bs, mode = _blocks(cx)
    n, ch, hh, ww = x.shape
    if ch % (bs * bs):
        raise cx.fail(f"channels {ch} must be a multiple of blocksize^2 = {bs * bs}")
    c2 = ch // (bs * bs)
    if mode == "DCR":
        t = cx.emit(Op.TRANSPOSE, reshape(cx, x, (n, bs, bs, c2, hh, ww), final=False), perm=(0, 3, 4, 1, 5, 2))
    else:
        t = cx.emit(Op.TRANSPOSE, reshape(cx, x, (n, c2, bs, bs, hh, ww), final=False), perm=(0, 1, 4, 2, 5, 3))
    return [reshape(cx, t, (n, c2, hh * bs, ww * bs), name=cx.node.output[0])]


@handler("EyeLike")
def _eye_like(cx: NodeCtx) -> list[Sym | None]:
    """Only the input's shape matters: the result is an import-time constant."""
    x = cx.x(0)
    if len(x.shape) != 2:
        raise cx.fail(f"input must be 2-D, got {list(x.shape)}")
    dt = np_dtype_of(int(cx.attr("dtype"))) if cx.attr("dtype") is not None else np_dtype(x)
    return [Const(np.eye(x.shape[0], x.shape[1], k=int(cx.attr("k", 0)), dtype=dt))]


def _grid_indices(cx: NodeCtx, shape: tuple[int, ...], axis: int, along: Sym) -> Sym:
    """[*shape, rank] coordinates of every element of ``shape``, with the ``axis`` coordinate taken
    from the run-time int64 tensor ``along`` (broadcast to ``shape``): ScatterND's index form."""
    rank = len(shape)
    parts: list[Sym] = []
    for i in range(rank):
        if i == axis:
            part: Sym = along if tuple(along.shape) == shape else cx.emit(Op.EXPAND, along, shape=shape)
        else:
            part = Const(np.indices(shape, dtype=np.int64)[i])
        parts.append(reshape(cx, part, shape + (1,), final=False))
    return cx.emit(Op.CONCAT, *parts, axis=rank)


def _int64(cx: NodeCtx, x: Sym) -> Sym:
    return x if np_dtype(x) == np.int64 else cx.emit(Op.CAST, x, to=DType.I64)


@handler("ScatterElements")
def _scatter_elements(cx: NodeCtx) -> list[Sym | None]:
    """ScatterElements without a reduction is ScatterND with full coordinates."""
    data, idx, upd = cx.x(0), cx.x(1), cx.x(2)
    if cx.attr("reduction", "none") != "none":
        raise cx.fail(f"ScatterElements reduction {cx.attr('reduction')!r} is not supported")
    if len(idx.shape) != len(data.shape) or tuple(idx.shape) != tuple(upd.shape):
        raise cx.fail(f"indices {list(idx.shape)} and updates {list(upd.shape)} must have one shape of data's rank")
    axis = cx.axis(int(cx.attr("axis", 0)), len(data.shape))
    along = _int64(cx, idx)
    dim = Const(np.asarray(data.shape[axis], np.int64))
    negative = cx.emit(Op.LESS, along, Const(np.zeros((), np.int64)))
    along = cx.emit(Op.WHERE, negative, cx.emit(Op.ADD, along, dim), along)
    return [cx.emit(Op.SCATTER_ND, data, _grid_indices(cx, tuple(idx.shape), axis, along), upd, final=True)]


@handler("TensorScatter")
def _tensor_scatter(cx: NodeCtx) -> list[Sym | None]:
    """Write ``update`` into the cache at write_indices[b] + s along ``axis`` (mod the cache length
    in circular mode), as ScatterND with full coordinates."""
    cache, upd = cx.x(0), cx.x(1)
    rank = len(cache.shape)
    axis = cx.axis(int(cx.attr("axis", -2)), rank)
    mode = str(cx.attr("mode", "linear"))
    fits = len(upd.shape) == rank and upd.shape[axis] <= cache.shape[axis] and all(
        u == k for i, (u, k) in enumerate(zip(upd.shape, cache.shape)) if i != axis)
    if axis == 0 or mode not in ("linear", "circular") or not fits:
        raise cx.fail(f"update {list(upd.shape)} does not fit cache {list(cache.shape)} along axis {axis} "
                      f"(mode {mode!r})")
    b, shape = cache.shape[0], tuple(upd.shape)
    seq = Const(np.arange(shape[axis], dtype=np.int64).reshape(tuple(shape[axis] if i == axis else 1
                                                                     for i in range(rank))))
    pos: Sym = seq
    if cx.has(2):
        start = reshape(cx, _int64(cx, cx.x(2)), (b,) + (1,) * (rank - 1), final=False)
        pos = cx.emit(Op.ADD, start, seq)
    if mode == "circular":
        pos = cx.emit(Op.MOD, pos, Const(np.asarray(cache.shape[axis], np.int64)), fmod=False)
    return [cx.emit(Op.SCATTER_ND, cache, _grid_indices(cx, shape, axis, pos), upd, final=True)]


@handler("ReverseSequence")
def _reverse_sequence(cx: NodeCtx) -> list[Sym | None]:
    """out[.., t, ..] = x[.., L_b - 1 - t, ..] for t < L_b (else x itself): a GatherElements."""
    x, lens = cx.x(0), cx.x(1)
    if len(x.shape) < 2:
        raise cx.fail(f"input must have rank >= 2, got {list(x.shape)}")
    bax, tax = (cx.axis(int(cx.attr(n, d)), len(x.shape)) for n, d in (("batch_axis", 1), ("time_axis", 0)))
    if bax == tax or tuple(lens.shape) != (x.shape[bax],):
        raise cx.fail(f"batch_axis {bax} / time_axis {tax} and sequence_lens {list(lens.shape)} do not fit "
                      f"{list(x.shape)}")
    rank = len(x.shape)
    t = Const(np.arange(x.shape[tax], dtype=np.int64).reshape(tuple(x.shape[tax] if i == tax else 1
                                                                   for i in range(rank))))
    n = reshape(cx, _int64(cx, lens), tuple(x.shape[bax] if i == bax else 1 for i in range(rank)), final=False)
    back = cx.emit(Op.SUB, cx.emit(Op.SUB, n, Const(np.ones((), np.int64))), t)
    idx = cx.emit(Op.WHERE, cx.emit(Op.LESS, t, n), back, t)
    idx = cx.emit(Op.EXPAND, idx, shape=tuple(x.shape))
    return [cx.emit(Op.GATHER_ELEMENTS, x, idx, final=True, axis=tax)]
