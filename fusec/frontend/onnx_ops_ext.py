"""ONNX op handlers, part 3: rounding, sign, integer remainders and bit operations, arg max/min,
top-k and padding (Floor, Ceil, Round, Sign, Mod, BitShift, BitwiseAnd/Or/Xor/Not, Xor, ArgMax,
ArgMin, TopK, Pad). Each runs on run-time tensors as IR ops (on constants the emitter folds
them with the reference), with ONNX's attribute defaults and opset differences resolved here.
"""

from __future__ import annotations

import numpy as np

from fusec.frontend.emit import Sym
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.ops import PAD_MODES, Op

_ELEMENTWISE = {"Floor": Op.FLOOR, "Ceil": Op.CEIL, "Round": Op.ROUND, "Sign": Op.SIGN, "BitwiseNot": Op.BITWISE_NOT,
                "BitwiseAnd": Op.BITWISE_AND, "BitwiseOr": Op.BITWISE_OR, "BitwiseXor": Op.BITWISE_XOR, "Xor": Op.XOR}


@handler(*_ELEMENTWISE)
def _elementwise(cx: NodeCtx) -> list[Sym | None]:
    """One IR op over the node's inputs (unary or binary; broadcasting as in numpy)."""
    return [cx.emit(_ELEMENTWISE[cx.node.op_type], *(cx.x(i) for i in range(len(cx.ins))), final=True)]


@handler("Mod")
def _mod(cx: NodeCtx) -> list[Sym | None]:
    return [cx.emit(Op.MOD, cx.x(0), cx.x(1), final=True, fmod=bool(cx.attr("fmod", 0)))]


@handler("BitShift")
def _bit_shift(cx: NodeCtx) -> list[Sym | None]:
    direction = str(cx.attr("direction", ""))
    if direction not in ("LEFT", "RIGHT"):
        raise cx.fail(f"direction must be LEFT or RIGHT, got {direction!r}")
    return [cx.emit(Op.BIT_SHIFT, cx.x(0), cx.x(1), final=True, left=direction == "LEFT")]


@handler("ArgMax", "ArgMin")
def _arg(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    op = Op.ARGMAX if cx.node.op_type == "ArgMax" else Op.ARGMIN
    return [cx.emit(op, x, final=True, axis=cx.axis(int(cx.attr("axis", 0)), len(x.shape)),
                    keepdims=bool(cx.attr("keepdims", 1)), select_last_index=bool(cx.attr("select_last_index", 0)))]


@handler("TopK")
def _topk(cx: NodeCtx) -> list[Sym | None]:
    """Indices by TOPK, values gathered from them (one op per output: the IR's ops have one)."""
    x = cx.x(0)
    ks = cx.ints(1)
    if ks is None or len(ks) != 1:
        raise cx.fail("K must be a single integer")
    axis = cx.axis(int(cx.attr("axis", -1)), len(x.shape))
    if not 0 <= ks[0] <= x.shape[axis]:
        raise cx.fail(f"K = {ks[0]} is outside [0, {x.shape[axis]}] (the length of axis {axis})")
    names = list(cx.node.output) + ["", ""]
    idx = cx.emit(Op.TOPK, x, name=names[1] or None, axis=axis, k=ks[0], largest=bool(cx.attr("largest", 1)))
    values = cx.emit(Op.GATHER_ELEMENTS, x, idx, name=names[0] or None, axis=axis)
    return [values, idx]


@handler("Pad")
def _pad(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    rank = len(x.shape)
    mode = str(cx.attr("mode", "constant"))
    if mode not in PAD_MODES:
        raise cx.fail(f"mode {mode!r} is not one of {', '.join(PAD_MODES)}")
    raw = cx.ints(1) or []
    axes_in = cx.ints(3) if cx.has(3) else None
    axes = list(range(rank)) if axes_in is None else [cx.axis(a, rank, "pad axis") for a in axes_in]
    if len(set(axes)) != len(axes) or len(raw) != 2 * len(axes):
        raise cx.fail(f"pads has {len(raw)} entries for {len(axes)} distinct axes (two per axis needed)")
    pads = [0] * (2 * rank)
    for i, ax in enumerate(axes):
        pads[ax], pads[rank + ax] = raw[i], raw[len(axes) + i]
    ins = [x]
    if mode == "constant" and cx.has(2):
        value = cx.x(2)
        if int(np.prod(value.shape)) != 1:
            raise cx.fail(f"constant_value must be one element, got shape {list(value.shape)}")
        ins.append(value)
    return [cx.emit(Op.PAD, *ins, final=True, pads=tuple(pads), mode=mode)]
