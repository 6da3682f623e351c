"""ONNX NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss, decomposed into IR ops.

loss[n, d...] = -input[n, target[n, d...], d...] * weight[target[n, d...]] (weight 1 without one),
0 where the target equals ``ignore_index``; reduced by ``none``, ``sum`` or ``mean`` (a weighted
mean: the sum divided by the sum of the weights used). The class is picked with GATHER_ELEMENTS
along axis 1. SoftmaxCrossEntropyLoss feeds it log(softmax(scores, axis=1)) and can return those
log-probabilities as its second output.
"""

from __future__ import annotations

import numpy as np

from fusec.frontend.emit import Const, Sym, np_dtype
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.frontend.onnx_ops_act import c
from fusec.frontend.onnx_ops_data import reshape
from fusec.ops import Op


def nll(cx: NodeCtx, x: Sym, target: Sym, weight: Sym | None, final: bool = True) -> Sym:
    n, ncls = x.shape[0], x.shape[1]
    if len(x.shape) < 2 or tuple(target.shape) != (n, *x.shape[2:]):
        raise cx.fail(f"target of shape {list(target.shape)} does not fit input {list(x.shape)} "
                      "(it must be [N, d1, ...] for input [N, C, d1, ...])")
    if np_dtype(target).kind not in "iu":
        raise cx.fail(f"target must hold integers, it holds {np_dtype(target)}")
    if weight is not None and tuple(weight.shape) != (ncls,):
        raise cx.fail(f"weight of shape {list(weight.shape)} must be [C] = [{ncls}]")
    reduction = str(cx.attr("reduction", "mean"))
    if reduction not in ("none", "sum", "mean"):
        raise cx.fail(f"reduction must be none, sum or mean, got {reduction!r}")
    ignore = cx.attr("ignore_index")
    safe, valid = target, None
    if ignore is not None:
        valid = cx.emit(Op.NOT, cx.emit(Op.EQUAL, target, Const(np.asarray(ignore, np_dtype(target)))))
        safe = cx.emit(Op.WHERE, valid, target, Const(np.zeros((), np_dtype(target))))
    idx = reshape(cx, safe, (n, 1, *x.shape[2:]), final=False)
    picked = reshape(cx, cx.emit(Op.GATHER_ELEMENTS, x, idx, axis=1), tuple(target.shape), final=False)
    w: Sym | None = None
    if weight is not None:
        w = cx.emit(Op.GATHER, weight, safe, axis=0)
    if valid is not None:
        w = cx.emit(Op.WHERE, valid, c(x, 1.0) if w is None else w, c(x, 0.0))
    loss = cx.emit(Op.NEG, picked) if w is None else cx.emit(Op.MUL, cx.emit(Op.NEG, picked), w)
    every = tuple(range(len(target.shape)))
    if reduction == "none":
        return loss
    total = cx.emit(Op.REDUCE_SUM, loss, axes=every, keepdims=False, final=final and reduction == "sum")
    if reduction == "sum":
        return total
    # the mean over the targets not ignored, as onnxruntime and PyTorch take it (onnx.reference's
    # NegativeLogLikelihoodLoss averages over every element when ignore_index is -1: not followed)
    if w is None:
        return cx.emit(Op.DIV, total, c(total, float(np.prod(target.shape))), final=final)
    return cx.emit(Op.DIV, total, cx.emit(Op.REDUCE_SUM, w, axes=every, keepdims=False), final=final)


@handler("NegativeLogLikelihoodLoss")
def _nll(cx: NodeCtx) -> list[Sym | None]:
    return [nll(cx, cx.x(0), cx.x(1), cx.x(2) if cx.has(2) else None)]


@handler("SoftmaxCrossEntropyLoss")
def _sce(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    if len(x.shape) < 2:
        raise cx.fail(f"scores must be [N, C, ...], got {list(x.shape)}")
    log_prob = cx.emit(Op.LOG, cx.emit(Op.SOFTMAX, x, axis=1))
    loss = nll(cx, log_prob, cx.x(1), cx.x(2) if cx.has(2) else None)
    return [loss, log_prob if cx.used(1) else None]
