"""ONNX normalizations and reductions without an IR op of their own, decomposed into IR ops.

RMSNormalization over the last axis with a [D] scale is the IR's RMSNORM; LayerNormalization
whose Mean / InvStdDev outputs are used, RMSNormalization over several axes, Group-, Instance-,
MeanVariance-, Lp- and BatchNormalization, LRN and the Reduce{L1,L2,LogSum,LogSumExp,SumSquare}
family are written with REDUCE_MEAN / REDUCE_SUM / elementwise ops. Statistics are computed in
``stash_type`` (fp32 by default) and the result cast back to the input's dtype, as ONNX's
function bodies do.
"""

from __future__ import annotations

import numpy as np

from fusec.dtypes import DType
from fusec.frontend.emit import Const, Sym, np_dtype
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.frontend.onnx_load import np_dtype_of
from fusec.frontend.onnx_ops_act import c, is_float
from fusec.frontend.onnx_ops_data import reshape
from fusec.ops import Op


def cast(cx: NodeCtx, x: Sym, dt: np.dtype) -> Sym:
    if np_dtype(x) == dt:
        return x
    try:
        to = DType.from_np(dt)
    except ValueError:
        raise cx.fail(f"dtype {dt} is not supported here") from None
    return cx.emit(Op.CAST, x, to=to)


def _stash(cx: NodeCtx, x: Sym) -> np.dtype:
    """The dtype statistics are computed in (``stash_type``, fp32 by default; never below x's)."""
    st = np.dtype(np_dtype_of(int(cx.attr("stash_type", 1))))
    return np_dtype(x) if np_dtype(x) == np.float64 else st


def _float(cx: NodeCtx, i: int = 0) -> Sym:
    x = cx.x(i)
    if not is_float(np_dtype(x)):
        raise cx.fail(f"input {i} has dtype {np_dtype(x)}; this op takes floating-point tensors")
    return x


def standardize(cx: NodeCtx, x: Sym, axes: tuple[int, ...], eps: float) -> tuple[Sym, Sym, Sym]:
    """(x - mean) * inv_std over ``axes`` (keepdims), with mean and inv_std = 1/sqrt(var + eps)."""
    mean = cx.emit(Op.REDUCE_MEAN, x, axes=axes, keepdims=True)
    d = cx.emit(Op.SUB, x, mean)
    var = cx.emit(Op.REDUCE_MEAN, cx.emit(Op.MUL, d, d), axes=axes, keepdims=True)
    inv = cx.emit(Op.RECIPROCAL, cx.emit(Op.SQRT, cx.emit(Op.ADD, var, c(var, eps))))
    return cx.emit(Op.MUL, d, inv), mean, inv


def _affine(cx: NodeCtx, y: Sym, scale: Sym | None, bias: Sym | None, final: bool = True) -> Sym:
    if scale is not None:
        y = cx.emit(Op.MUL, y, scale, final=final and bias is None)
    if bias is not None:
        y = cx.emit(Op.ADD, y, bias, final=final)
    return y


def layernorm_with_stats(cx: NodeCtx) -> list[Sym | None]:
    """LayerNormalization with its Mean and InvStdDev outputs (in stash_type, keepdims shape)."""
    x = _float(cx)
    axis = cx.axis(int(cx.attr("axis", -1)), len(x.shape))
    xs = cast(cx, x, _stash(cx, x))
    y, mean, inv = standardize(cx, xs, tuple(range(axis, len(x.shape))), float(cx.attr("epsilon", 1e-5)))
    y = _affine(cx, cast(cx, y, np_dtype(x)), cx.x(1), cx.x(2) if cx.has(2) else None)
    return [y, mean, inv]


@handler("RMSNormalization")
def _rms_norm(cx: NodeCtx) -> list[Sym | None]:
    x, scale = _float(cx), cx.x(1)
    rank = len(x.shape)
    axis = cx.axis(int(cx.attr("axis", -1)), rank)
    eps = float(cx.attr("epsilon", 1e-5))
    stash = _stash(cx, x)
    if axis == rank - 1 and tuple(scale.shape) == (x.shape[-1],) and stash == np.float32 \
            and is_float(np_dtype(scale)):
        return [cx.emit(Op.RMSNORM, x, scale, final=True, eps=eps)]
    xs = cast(cx, x, stash)
    ms = cx.emit(Op.REDUCE_MEAN, cx.emit(Op.MUL, xs, xs), axes=tuple(range(axis, rank)), keepdims=True)
    y = cx.emit(Op.DIV, xs, cx.emit(Op.SQRT, cx.emit(Op.ADD, ms, c(ms, eps))))
    return [cx.emit(Op.MUL, cast(cx, y, np_dtype(x)), scale, final=True)]


def _channel_param(cx: NodeCtx, p: Sym, rank: int, what: str, channels: int) -> Sym:
    """A per-channel [C] parameter shaped [C, 1, ..., 1] to broadcast against [N, C, d...]."""
    if tuple(p.shape) != (channels,):
        raise cx.fail(f"{what} of shape {list(p.shape)} must be [{channels}]")
    return reshape(cx, p, (channels,) + (1,) * (rank - 2), final=False)


@handler("InstanceNormalization")
def _instance_norm(cx: NodeCtx) -> list[Sym | None]:
    x = _float(cx)
    rank = len(x.shape)
    if rank < 3:
        raise cx.fail(f"input must be [N, C, d1, ...], got {list(x.shape)}")
    y, _, _ = standardize(cx, x, tuple(range(2, rank)), float(cx.attr("epsilon", 1e-5)))
    ch = x.shape[1]
    return [_affine(cx, y, _channel_param(cx, cx.x(1), rank, "scale", ch), _channel_param(cx, cx.x(2), rank, "B", ch))]


@handler("GroupNormalization")
def _group_norm(cx: NodeCtx) -> list[Sym | None]:
    x = _float(cx)
    rank = len(x.shape)
    groups = cx.attr("num_groups")
    if rank < 3 or not groups or x.shape[1] % int(groups):
        raise cx.fail(f"input {list(x.shape)} must be [N, C, d1, ...] with C divisible by num_groups ({groups})")
    n, ch, g = x.shape[0], x.shape[1], int(groups)
    xs = reshape(cx, cast(cx, x, _stash(cx, x)), (n, g, int(np.prod(x.shape[1:])) // g),
                 final=False)
    y, _, _ = standardize(cx, xs, (2,), float(cx.attr("epsilon", 1e-5)))
    y = cast(cx, reshape(cx, y, tuple(x.shape), final=False), np_dtype(x))
    scale, bias = cx.x(1), cx.x(2)  # per channel (opset 21; opset 18's per-group form is deprecated)
    return [_affine(cx, y, _channel_param(cx, scale, rank, "scale", ch), _channel_param(cx, bias, rank, "bias", ch))]


@handler("MeanVarianceNormalization")
def _mvn(cx: NodeCtx) -> list[Sym | None]:
    x = _float(cx)
    axes = tuple(sorted({cx.axis(int(a), len(x.shape)) for a in cx.attr("axes", [0, 2, 3])}))
    mean = cx.emit(Op.REDUCE_MEAN, x, axes=axes, keepdims=True)
    d = cx.emit(Op.SUB, x, mean)
    # ONNX's body: sqrt(E[x^2] - E[x]^2), no epsilon beyond 1e-9 against a zero variance
    var = cx.emit(Op.SUB, cx.emit(Op.REDUCE_MEAN, cx.emit(Op.MUL, x, x), axes=axes, keepdims=True),
                  cx.emit(Op.MUL, mean, mean))
    return [cx.emit(Op.DIV, d, cx.emit(Op.ADD, cx.emit(Op.SQRT, var), c(x, 1e-9)), final=True)]


@handler("LpNormalization")
def _lp_norm(cx: NodeCtx) -> list[Sym | None]:
    x = _float(cx)
    axis = cx.axis(int(cx.attr("axis", -1)), len(x.shape))
    p = int(cx.attr("p", 2))
    if p not in (1, 2):
        raise cx.fail(f"p must be 1 or 2, got {p}")
    mag = cx.emit(Op.ABS, x) if p == 1 else cx.emit(Op.MUL, x, x)
    norm = cx.emit(Op.REDUCE_SUM, mag, axes=(axis,), keepdims=True)
    if p == 2:
        norm = cx.emit(Op.SQRT, norm)
    zero = cx.emit(Op.EQUAL, norm, c(norm, 0.0))  # an all-zero slice stays zero
    safe = cx.emit(Op.WHERE, zero, c(norm, 1.0), norm)
    return [cx.emit(Op.DIV, x, safe, final=True)]


@handler("BatchNormalization")
def _batch_norm(cx: NodeCtx) -> list[Sym | None]:
    x = _float(cx)
    rank = len(x.shape)
    if rank < 2:
        raise cx.fail(f"input must be [N, C, ...], got {list(x.shape)}")
    ch, eps = x.shape[1], float(cx.attr("epsilon", 1e-5))
    scale, bias, mean_in, var_in = (_channel_param(cx, cx.x(i), rank, n, ch)
                                    for i, n in ((1, "scale"), (2, "B"), (3, "input_mean"), (4, "input_var")))
    if not cx.attr("training_mode", 0):
        inv = cx.emit(Op.RECIPROCAL, cx.emit(Op.SQRT, cx.emit(Op.ADD, var_in, c(var_in, eps))))
        y = cx.emit(Op.MUL, cx.emit(Op.SUB, x, mean_in), inv)
        return [_affine(cx, y, scale, bias), None, None]
    axes = (0,) + tuple(range(2, rank))
    y, mean, inv = standardize(cx, x, axes, eps)
    mom = float(cx.attr("momentum", 0.9))
    d = cx.emit(Op.SUB, x, mean)
    var = cx.emit(Op.REDUCE_MEAN, cx.emit(Op.MUL, d, d), axes=axes, keepdims=True)
    run_mean = cx.emit(Op.ADD, cx.emit(Op.MUL, mean_in, c(x, mom)), cx.emit(Op.MUL, mean, c(x, 1.0 - mom)))
    run_var = cx.emit(Op.ADD, cx.emit(Op.MUL, var_in, c(x, mom)), cx.emit(Op.MUL, var, c(x, 1.0 - mom)))
    return [_affine(cx, y, scale, bias), reshape(cx, run_mean, (ch,), final=False),
            reshape(cx, run_var, (ch,), final=False)]


@handler("LRN")
def _lrn(cx: NodeCtx) -> list[Sym | None]:
    """x / (bias + alpha / size * window_sum(x^2))^beta; the channel window sum is a product with a
    constant [C, C] band matrix along the channel axis."""
    x = _float(cx)
    rank, size = len(x.shape), int(cx.attr("size", 0))
    if rank < 3 or size < 1:
        raise cx.fail(f"LRN needs input [N, C, d...] and size >= 1, got {list(x.shape)} and size {size}")
    ch = x.shape[1]
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    idx = np.arange(ch)
    band = ((idx[:, None] >= idx[None, :] - lo) & (idx[:, None] <= idx[None, :] + hi)).astype(np_dtype(x))
    perm = (0,) + tuple(range(2, rank)) + (1,)
    back = (0, rank - 1) + tuple(range(1, rank - 1))
    sq = cx.emit(Op.TRANSPOSE, cx.emit(Op.MUL, x, x), perm=perm)
    ss = cx.emit(Op.TRANSPOSE, cx.emit(Op.MATMUL, sq, Const(band)), perm=back)
    alpha, beta, bias = float(cx.attr("alpha", 1e-4)), float(cx.attr("beta", 0.75)), float(cx.attr("bias", 1.0))
    den = cx.emit(Op.POW, cx.emit(Op.ADD, cx.emit(Op.MUL, ss, c(x, alpha / size)), c(x, bias)), c(x, beta))
    return [cx.emit(Op.DIV, x, den, final=True)]


# ---- reductions ---------------------------------------------------------------------------


def reduce_axes(cx: NodeCtx, x: Sym) -> tuple[int, ...] | None:
    """The normalized axes of a Reduce* node (input 1 from opset 18, else attribute), or None for
    a no-op (empty axes with noop_with_empty_axes)."""
    given = cx.ints(1) if cx.opset >= 18 else cx.attr("axes")
    if not given:
        return None if cx.attr("noop_with_empty_axes", 0) else tuple(range(len(x.shape)))
    return tuple(sorted({cx.axis(int(a), len(x.shape), "reduce axis") for a in given}))


@handler("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")
def _reduce_family(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    op = cx.node.op_type
    axes = reduce_axes(cx, x)
    keep = bool(cx.attr("keepdims", 1))
    if op in ("ReduceL2", "ReduceLogSum", "ReduceLogSumExp") and not is_float(np_dtype(x)):
        raise cx.fail(f"input has dtype {np_dtype(x)}; {op} takes floating-point tensors here")
    if axes is None:  # no reduction: the elementwise part only
        pre = {"ReduceL1": Op.ABS, "ReduceL2": Op.ABS, "ReduceLogSum": Op.LOG}.get(op)
        if op == "ReduceSumSquare":
            return [cx.emit(Op.MUL, x, x, final=True)]
        return [cx.emit(pre, x, final=True)] if pre else [x]
    if op == "ReduceLogSumExp":  # max + log(sum(exp(x - max))); an all -inf slice gives -inf
        m = cx.emit(Op.REDUCE_MAX, x, axes=axes, keepdims=True)
        m = cx.emit(Op.WHERE, cx.emit(Op.ISINF, m), c(m, 0.0), m)
        s = cx.emit(Op.REDUCE_SUM, cx.emit(Op.EXP, cx.emit(Op.SUB, x, m)), axes=axes, keepdims=keep)
        mk = m if keep else reshape(cx, m, tuple(d for i, d in enumerate(x.shape) if i not in axes), final=False)
        return [cx.emit(Op.ADD, cx.emit(Op.LOG, s), mk, final=True)]
    pre_x = {"ReduceL1": lambda: cx.emit(Op.ABS, x), "ReduceLogSum": lambda: x}.get(op, lambda: cx.emit(Op.MUL, x, x))()
    s = cx.emit(Op.REDUCE_SUM, pre_x, axes=axes, keepdims=keep, final=op in ("ReduceL1", "ReduceSumSquare"))
    if op == "ReduceL2":
        return [cx.emit(Op.SQRT, s, final=True)]
    if op == "ReduceLogSum":
        return [cx.emit(Op.LOG, s, final=True)]
    return [s]
