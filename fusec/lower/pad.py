"""GPU lowering of ``Op.PAD`` in constant mode: two launches into the output, the fill (an
elementwise kernel of the fill value, broadcast) then the copy of the kept part of the input into
its box (the index-mapping copy kernel). Reflect, edge and wrap modes read mirrored or periodic
positions, which neither kernel maps: they are refused naming the mode."""

from __future__ import annotations

from fusec.codegen import copyspecs as C
from fusec.codegen import specs as S
from fusec.codegen.elementwise import Const, In
from fusec.ir import Node
from fusec.lower import Context, LoweringError


def lower_pad(ctx: Context, node: Node, label: str) -> None:
    x, out, a = node.inputs[0], node.output, node.attrs
    if a.mode != "constant":
        raise LoweringError(f"{label}: pad in {a.mode} mode has no GPU lowering yet (constant mode has)")
    rank = len(x.shape)
    begins, ends = a.pads[:rank], a.pads[rank:]
    if any(b > 0 or e > 0 for b, e in zip(begins, ends)):
        if len(node.inputs) > 1:  # the run-time fill value, read at every position
            fill = S.elementwise_spec(In(0), [node.inputs[1].shape], [x.dtype], out.shape, vectorize=False)
            ctx.kernel(fill, [node.inputs[1], out], label)
        else:
            zero = False if x.dtype.value == "bool" else 0
            ctx.kernel(S.elementwise_spec(Const(zero, x.dtype), [], [], out.shape, vectorize=False), [out], label)
    kept = tuple(d + min(b, 0) + min(e, 0) for d, b, e in zip(x.shape, begins, ends))
    if 0 in kept:
        return  # nothing of the input survives the crop
    xs, os_ = S.contiguous_strides(x.shape), S.contiguous_strides(out.shape)
    src_off = sum(-min(b, 0) * s for b, s in zip(begins, xs))
    dst_off = sum(max(b, 0) * s for b, s in zip(begins, os_))
    ctx.kernel(C.CopySpec(x.dtype, kept, xs, os_, src_offset=src_off, dst_offset=dst_off), [x, out], label)
