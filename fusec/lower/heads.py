"""The ``head_rope`` kernel family: [RMSNorm over head_dim] -> layout views -> RoPE -> [layout views
-> KV-cache write], one warp per head row (``HeadRopeSpec``).

``plan(body)`` is the capability half (asked by fusion through ``fused.can_fuse``): it says why a
body is not one such kernel, or returns what ``emit`` needs. The norm works on whole rows of the
last axis, so the layout views between it and the RoPE (a head transpose) commute with it: the
kernel reads x through the composed view of the norm's input and normalizes each row it loads.
"""

from __future__ import annotations

from typing import Any

from fusec.codegen import specs as S
from fusec.ir import Graph, Node, Value
from fusec.lower import Context, LoweringError
from fusec.lower import layout as L
from fusec.ops import Op

_LAYOUT = (Op.SLICE, Op.RESHAPE, Op.TRANSPOSE, Op.EXPAND)


class NoPlan(Exception):
    """The body is not one head_rope kernel; the message says why."""


def applies(body: Graph) -> bool:
    """Bodies this family answers for: a RoPE with a norm before it or a cache write after it."""
    ops = {n.op for n in body.nodes}
    return Op.ROPE in ops and bool(ops & {Op.RMSNORM, Op.CACHE_WRITE})


def plan(body: Graph) -> dict[str, Any]:
    ropes = [n for n in body.nodes if n.op == Op.ROPE]
    norms = [n for n in body.nodes if n.op == Op.RMSNORM]
    writes = [n for n in body.nodes if n.op == Op.CACHE_WRITE]
    other = [n for n in body.nodes if n.op not in _LAYOUT + (Op.ROPE, Op.RMSNORM, Op.CACHE_WRITE)]
    if len(ropes) != 1 or len(norms) > 1 or len(writes) > 1 or other or len(body.outputs) != 1:
        raise NoPlan("the head_rope kernel takes one RoPE, at most one RMSNorm before it and one cache write "
                     "after it, joined by layout views")
    rope = ropes[0]
    x, shape = rope.inputs[0], rope.output.shape
    if len(shape) != 4 or rope.attrs.rotary_dim != shape[3] or shape[3] % 64 or shape[3] > 256:
        raise NoPlan(f"head_rope needs a full-width RoPE over [B, H, S, D] with D a multiple of 64 up to 256, "
                     f"got {list(shape)} rotating {rope.attrs.rotary_dim}")
    if any(c not in body.inputs for c in rope.inputs[1:]):
        raise NoPlan("RoPE must read cos/sin directly")
    cos, sin = rope.inputs[1:]
    cs = L.broadcast_to(L.View.contiguous(cos.shape), shape)
    if cs is None or cos.shape != sin.shape or (cs.strides[1] != 0 and shape[1] != 1) or cs.strides[3] != 1:
        raise NoPlan(f"cos/sin {list(cos.shape)} are not [B|1, 1, S|1, D] rows shared by every head")
    norm = norms[0] if norms else None
    if norm is not None:
        if len(norm.inputs) != 2 or norm.inputs[1].shape != (shape[3],) or norm.inputs[0].shape[-1] != shape[3]:
            raise NoPlan("the norm must be an RMSNorm over the head dimension with a [D] weight")
    from fusec.lower.fused import _NoPlan, _view_from_input

    try:  # the norm maps rows to rows of the same shape: read x through it as the identity
        xi, xview = _view_from_input(body, x, through=norm)
    except _NoPlan as e:
        raise NoPlan(str(e)) from None
    if len(xview.shape) != 4 or xview.strides[3] != 1:
        raise NoPlan("the RoPE input is not a [B, H, S, D] view with contiguous D")
    write = writes[0] if writes else None
    if write is not None:
        if write.output is not body.outputs[0] or write.attrs.axis != 2 or len(write.inputs[0].shape) != 4:
            raise NoPlan("the cache write must be the group's output, along axis 2 of a [B, H, T, D] cache")
        if _through_layouts(body, write.inputs[1]) is not rope.output or write.inputs[1].shape != shape:
            raise NoPlan("the cache write must store the RoPE's [B, H, S, D] result")
        if write.inputs[0] not in body.inputs or write.inputs[2] not in body.inputs:
            raise NoPlan("the cache and the positions must be inputs of the group")
    elif rope.output is not body.outputs[0]:
        raise NoPlan("without a cache write, the RoPE must be the group's output")
    return {"rope": rope, "norm": norm, "write": write, "x": (xi, xview)}


def _through_layouts(body: Graph, v: Value) -> Value:
    """``v`` with zero-copy layout producers stripped (the value they view)."""
    prod = body.producers()
    while (n := prod.get(v)) is not None and n.op in (Op.RESHAPE,) and n.inputs[0].numel == v.numel \
            and n.inputs[0].shape == v.shape:
        v = n.inputs[0]
    return v


def emit(ctx: Context, p: dict[str, Any], node: Node, label: str) -> None:
    from fusec.lower.nodes import _bcast_strides

    body: Graph = node.attrs.body
    outer: dict[Value, Value] = dict(zip(body.inputs, node.inputs))
    outer.update({c: c for c in body.constants})
    rope, norm, write = p["rope"], p["norm"], p["write"]
    xi, xview = p["x"]
    B, H, S_, D = rope.output.shape
    cos, sin = (outer[v] for v in rope.inputs[1:])
    cst = _bcast_strides(cos, (B, H, S_, D))
    if cst != _bcast_strides(sin, (B, H, S_, D)) or cst[1] != 0 or cst[3] != 1:
        raise LoweringError(f"{label}: cos/sin layout {list(cos.shape)} is not [B|1, 1, S|1, D]")
    out = node.output
    args: list[Any] = [(node.inputs[xi], xview.offset)]
    kw: dict[str, Any] = {}
    if norm is not None:
        w = outer[norm.inputs[1]]
        args.append(w)
        kw.update(norm=True, eps=float(norm.attrs.eps), weight_offset=float(norm.attrs.weight_offset), w_dtype=w.dtype)
    args += [cos, sin]
    if write is not None:
        cache, pos = outer[write.inputs[0]], outer[write.inputs[2]]
        if not ctx.same_storage(cache, out):
            raise LoweringError(f"{label}: the cache write's result is not planned in the cache's storage")
        kw.update(cache_len=out.shape[2], pos_dtype=pos.dtype)
        args.append(pos)
    out_strides = L.View.contiguous(out.shape).strides[:3]  # [B, H, S|T, D]: the rope's result or the cache
    spec = S.HeadRopeSpec(B, H, S_, D, out.dtype, tuple(xview.strides[:3]), tuple(out_strides),  # type: ignore[arg-type]
                          (cst[0], cst[2]), cos.dtype, **kw)
    args.append(out)
    ctx.kernel(spec, args, label)
