"""ONNX export of the rounding, remainder, bit, arg max/min, top-k, pad and min/prod-reduction ops
and of the reference-only dtypes (``fusec.onnx_export`` merges these tables into its own).

The export writes opset 17: ops that have no form there (the Bitwise* family, opset 18; Pad's
wrap mode, opset 19) are refused in one line naming the op."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from onnx import TensorProto

from fusec.dtypes import DType
from fusec.errors import ModelError
from fusec.ops import Op

DTYPES = {DType.F64: TensorProto.DOUBLE, DType.I16: TensorProto.INT16, DType.I8: TensorProto.INT8,
          DType.U8: TensorProto.UINT8, DType.U16: TensorProto.UINT16, DType.U32: TensorProto.UINT32,
          DType.U64: TensorProto.UINT64}

SIMPLE = {Op.FLOOR: "Floor", Op.CEIL: "Ceil", Op.ROUND: "Round", Op.SIGN: "Sign", Op.XOR: "Xor"}

# ops whose ONNX form needs a later opset than the export writes: a graph with one is refused
NOT_IN_OPSET = {Op.BITWISE_AND: 18, Op.BITWISE_OR: 18, Op.BITWISE_XOR: 18, Op.BITWISE_NOT: 18}


def _ops(graph: Any) -> set[Op]:
    return {n.op for n in graph.nodes} | {o for n in graph.nodes if n.op == Op.FUSED for o in _ops(n.attrs.body)}


def check_opset(graph: Any) -> None:
    """A ModelError naming the first op (by name), fused bodies included, that opset 17 lacks."""
    late = sorted((op.value, NOT_IN_OPSET[op]) for op in _ops(graph) if op in NOT_IN_OPSET)
    if late:
        raise ModelError(f"ONNX export writes opset 17; {late[0][0]} needs opset {late[0][1]}")


def _topk(ctx: Any, n: Any, ins: list[str], out: str, a: Any) -> None:
    # TOPK is the indices; ONNX TopK also writes the values, to a name of their own
    ctx.add("TopK", [ins[0], ctx.i64([a.k], "k")], [ctx.fresh(f"{out}_values"), out], axis=a.axis,
            largest=int(a.largest), sorted=1)


def _pad(ctx: Any, n: Any, ins: list[str], out: str, a: Any) -> None:
    if a.mode == "wrap":
        raise ModelError("ONNX export writes opset 17; pad in wrap mode needs opset 19")
    ctx.add("Pad", [ins[0], ctx.i64(a.pads, "pads"), *ins[1:]], [out], mode=a.mode)


def _arg(op_type: str) -> Callable[..., None]:
    return lambda c, n, i, o, a: c.add(op_type, i, [o], axis=a.axis, keepdims=int(a.keepdims),
                                       select_last_index=int(a.select_last_index))


def _reduce(op_type: str) -> Callable[..., None]:  # opset 17: axes is an attribute
    return lambda c, n, i, o, a: c.add(op_type, i, [o], axes=list(a.axes), keepdims=int(a.keepdims))


SPECIAL: dict[Op, Callable[..., None]] = {
    Op.MOD: lambda c, n, i, o, a: c.add("Mod", i, [o], fmod=int(a.fmod)),
    Op.BIT_SHIFT: lambda c, n, i, o, a: c.add("BitShift", i, [o], direction="LEFT" if a.left else "RIGHT"),
    Op.ARGMAX: _arg("ArgMax"),
    Op.ARGMIN: _arg("ArgMin"),
    Op.TOPK: _topk,
    Op.PAD: _pad,
    Op.REDUCE_MIN: _reduce("ReduceMin"),
    Op.REDUCE_PROD: _reduce("ReduceProd"),
}
