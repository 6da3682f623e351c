"""The ``head_rope`` kernel family: [RMSNorm over head_dim] -> layout views -> RoPE -> [layout views
-> KV-cache write], one warp per head row (``HeadRopeSpec``); several such RoPEs sharing cos/sin
(the q and k heads of one QKV product, each with its own norm and output) in one launch
(``HeadRopeGroupSpec``: the grid covers the heads of every part).

``plan(body)`` is the capability half (asked by fusion through ``fused.can_fuse``): it says why a
body is not one such kernel, or returns what ``emit`` needs. The norm works on whole rows of the
last axis, so the layout views between it and the RoPE (a head transpose) commute with it: the
kernel reads x through the composed view of the norm's input and normalizes each row it loads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fusec.codegen import specs as S
from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value
from fusec.lower import Context, LoweringError
from fusec.lower import layout as L
from fusec.ops import Op

_LAYOUT = (Op.SLICE, Op.RESHAPE, Op.TRANSPOSE, Op.EXPAND)


class NoPlan(Exception):
    """The body is not one head_rope kernel; the message says why."""


def applies(body: Graph) -> bool:
    """Bodies this family answers for: a RoPE with a norm before it or a cache write after it, or
    several RoPEs (siblings rotating heads of one product: one launch covers all their heads)."""
    ops = [n.op for n in body.nodes]
    return ops.count(Op.ROPE) > 1 or (Op.ROPE in ops and bool(set(ops) & {Op.RMSNORM, Op.CACHE_WRITE}))


@dataclasses.dataclass
class Part:
    """One RoPE of a head_rope body with its norm and cache write; ``x`` is (body input index,
    view of the RoPE's input in it), ``out`` the index of the body output it writes (the cache
    when it has one), ``res`` that of its rotated rows when they are an output besides the cache.
    A part without a RoPE (``rope`` None) copies its heads into a cache as they are (the V heads
    of the QKV product the RoPE parts rotate)."""

    rope: Node | None
    norm: Node | None
    write: Node | None
    x: tuple[int, L.View]
    out: int
    res: int | None = None

    @property
    def rows(self) -> Value:
        """The [B, H, S, D] rows the part stores: the RoPE's result, or what the cache copy stores."""
        return self.rope.output if self.rope is not None else self.write.inputs[1]  # type: ignore[union-attr]


def plan(body: Graph) -> list[Part]:
    """The parts of a head_rope body (one per RoPE, all sharing cos/sin and the positions), or
    NoPlan saying why the body is not one such kernel."""
    ropes = [n for n in body.nodes if n.op == Op.ROPE]
    other = [n for n in body.nodes if n.op not in _LAYOUT + (Op.ROPE, Op.RMSNORM, Op.CACHE_WRITE)]
    if not ropes or other:
        raise NoPlan("the head_rope kernel takes RoPEs, each with at most one RMSNorm before it and one cache "
                     "write after it, joined by layout views")
    parts = [_part(body, rope) for rope in ropes]
    claimed = [n for p in parts for n in (p.norm, p.write) if n is not None]
    parts += [_copy_part(body, w) for w in body.nodes if w.op == Op.CACHE_WRITE and w not in claimed]
    claimed = [n for p in parts for n in (p.norm, p.write) if n is not None]
    if len(set(claimed)) != len(claimed) or len(claimed) != sum(n.op in (Op.RMSNORM, Op.CACHE_WRITE) for n in body.nodes):
        raise NoPlan("every RMSNorm and cache write must belong to exactly one RoPE (or cache copy) of the group")
    outs = [i for p in parts for i in (p.out, p.res) if i is not None]
    if sorted(outs) != list(range(len(body.outputs))):
        raise NoPlan("the group's outputs must be its RoPEs' results or caches, each written by one RoPE")
    r0 = parts[0].rope
    assert r0 is not None
    for p in parts[1:]:
        (B, _, S_, D), (B0, _, S0, D0) = p.rows.shape, r0.output.shape
        if (B, S_, D) != (B0, S0, D0) or p.rows.dtype != r0.output.dtype or \
                (p.rope is not None and p.rope.inputs[1:] != r0.inputs[1:]):
            raise NoPlan("RoPEs in one head_rope kernel must share batch, sequence, head size, dtype and cos/sin")
    if len({_positions_key(p.write.inputs[2]) for p in parts if p.write is not None}) > 1:
        raise NoPlan("the cache writes of one head_rope kernel must share the positions")
    return parts


def _copy_part(body: Graph, write: Node) -> Part:
    """A cache write of heads that are not rotated (read through layout views of a body input)."""
    from fusec.lower.fused_plan import _NoPlan, _view_from_input

    x = write.inputs[1]
    if len(x.shape) != 4 or x.shape[3] % 64 or x.shape[3] > 256:
        raise NoPlan(f"a cache copy in a head_rope kernel moves [B, H, S, D] rows with D a multiple of 64 up to 256, "
                     f"got {list(x.shape)}")
    _check_write(body, write, x.shape)
    try:
        xi, xview = _view_from_input(body, x)
    except _NoPlan as e:
        raise NoPlan(str(e)) from None
    if len(xview.shape) != 4 or xview.strides[3] != 1:
        raise NoPlan("a cache copy reads a [B, H, S, D] view with contiguous D")
    return Part(None, None, write, (xi, xview), body.outputs.index(write.output))


def _check_write(body: Graph, write: Node, shape: tuple[int, ...]) -> None:
    if len(write.inputs) == 4:
        raise NoPlan("a cache write with destination rows is a kernel of its own")
    if write.output not in body.outputs or write.attrs.axis != 2 or len(write.inputs[0].shape) != 4:
        raise NoPlan("the cache write must be a group output, along axis 2 of a [B, H, T, D] cache")
    if write.inputs[1].shape != shape:
        raise NoPlan("the cache write must store the RoPE's [B, H, S, D] result")
    if write.inputs[0] not in body.inputs or (write.inputs[2] not in body.inputs and fixed_position(write.inputs[2]) is None):
        raise NoPlan("the cache and the positions must be inputs of the group (or the positions one integer literal)")


def _part(body: Graph, rope: Node) -> Part:
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
    prod = body.producers()
    v = x
    while (n := prod.get(v)) is not None and n.op in _LAYOUT:
        v = n.inputs[0]
    norm = prod.get(v) if prod.get(v) is not None and prod[v].op == Op.RMSNORM else None
    if norm is not None:
        if len(norm.inputs) != 2 or norm.inputs[1].shape != (shape[3],) or norm.inputs[0].shape[-1] != shape[3]:
            raise NoPlan("the norm must be an RMSNorm over the head dimension with a [D] weight")
    from fusec.lower.fused_plan import _NoPlan, _view_from_input

    try:  # the norm maps rows to rows of the same shape: read x through it as the identity
        xi, xview = _view_from_input(body, x, through=norm)
    except _NoPlan as e:
        raise NoPlan(str(e)) from None
    if len(xview.shape) != 4 or xview.strides[3] != 1:
        raise NoPlan("the RoPE input is not a [B, H, S, D] view with contiguous D")
    writes = [n for n in body.nodes if n.op == Op.CACHE_WRITE and _through_layouts(body, n.inputs[1]) is rope.output]
    if len(writes) > 1:
        raise NoPlan("a RoPE's result is written to one cache at most")
    write = writes[0] if writes else None
    if write is not None:
        _check_write(body, write, shape)
        if any(u is not write and u.op != Op.RESHAPE for u in body.users().get(rope.output, [])):
            raise NoPlan("a RoPE whose result goes to a cache must have no other reader in the group")
    elif rope.output not in body.outputs:
        raise NoPlan("without a cache write, the RoPE must be a group output")
    res = body.outputs.index(rope.output) if write is not None and rope.output in body.outputs else None
    return Part(rope, norm, write, (xi, xview), body.outputs.index((write or rope).output), res)


def fixed_position(v: Value) -> int | None:
    """The value of positions the body holds as a literal (a one-row batch's constant start, which
    fusion keeps inside the body), else None."""
    if v.data is None or v.numel != 1 or v.dtype not in (DType.I32, DType.I64):
        return None
    return int(v.data.reshape(()).item())


def _positions_key(v: Value) -> object:
    fixed = fixed_position(v)
    return v if fixed is None else ("fixed", fixed)


def _through_layouts(body: Graph, v: Value) -> Value:
    """``v`` with zero-copy layout producers stripped (the value they view)."""
    prod = body.producers()
    while (n := prod.get(v)) is not None and n.op in (Op.RESHAPE,) and n.inputs[0].numel == v.numel \
            and n.inputs[0].shape == v.shape:
        v = n.inputs[0]
    return v


def emit(ctx: Context, parts: list[Part], node: Node, label: str) -> None:
    from fusec.codegen.build_heads import HeadRopeGroupSpec

    specs, xs, ws, outs = [], [], [], []
    pos: Value | None = None
    fixed = next((f for p in parts if p.write is not None and (f := fixed_position(p.write.inputs[2])) is not None), -1)
    for p in parts:
        spec, x, w, out, ppos = part_spec(ctx, p, parts[0], node, label)
        specs.append(spec)
        xs.append(x)
        ws.append(w)
        outs.append(out)
        pos = ppos if ppos is not None else pos
    cos = node.inputs[node.attrs.body.inputs.index(parts[0].rope.inputs[1])]
    sin = node.inputs[node.attrs.body.inputs.index(parts[0].rope.inputs[2])]
    args: list[Any] = [a for x, w in zip(xs, ws) for a in ([x] if w is None else [x, w])]
    copies = tuple(i for i, p in enumerate(parts) if p.res is not None)
    if fixed >= 0:
        pos = None  # the literal start row is part of the kernel
    args += [cos, sin] + ([pos] if pos is not None else []) + outs + [node.outputs[parts[i].res] for i in copies]  # type: ignore[index]
    from fusec.passes.select_kernels import selection

    rpw = dict(selection(node).params).get("rpw", 1)  # kernel selection's rows a warp
    group = len(specs) > 1 or copies or fixed >= 0 or rpw > 1
    ctx.kernel(HeadRopeGroupSpec(tuple(specs), copies, fixed, rpw) if group else specs[0], args, label)
    if pos is not None:  # run-time positions: each cache part writes rows pos[b] + s only
        for p, out in zip(parts, outs):
            if p.write is not None:
                ctx.wrote_rows_from_pos(out, pos)


def part_spec(ctx: Context, p: Part, first: Part, node: Node, label: str
              ) -> tuple[S.HeadRopeSpec, Any, Value | None, Value, Value | None]:
    """One part's spec and its pointers: (spec, x, norm weight, output, positions)."""
    from fusec.lower.nodes import _bcast_strides

    body: Graph = node.attrs.body
    outer: dict[Value, Value] = dict(zip(body.inputs, node.inputs))
    outer.update({c: c for c in body.constants})
    rope, norm, write = p.rope or first.rope, p.norm, p.write
    assert rope is not None
    xi, xview = p.x
    B, H, S_, D = p.rows.shape
    cos, sin = (outer[v] for v in rope.inputs[1:])
    cst = _bcast_strides(cos, (B, H, S_, D))
    if cst != _bcast_strides(sin, (B, H, S_, D)) or cst[1] != 0 or cst[3] != 1:
        raise LoweringError(f"{label}: cos/sin layout {list(cos.shape)} is not [B|1, 1, S|1, D]")
    out = node.outputs[p.out]
    w: Value | None = None
    pos: Value | None = None
    kw: dict[str, Any] = {}
    if norm is not None:
        w = outer[norm.inputs[1]]
        kw.update(norm=True, eps=float(norm.attrs.eps), weight_offset=float(norm.attrs.weight_offset), w_dtype=w.dtype)
    if write is not None:
        cache, pos = outer[write.inputs[0]], outer.get(write.inputs[2], write.inputs[2])
        if not ctx.same_storage(cache, out):
            raise LoweringError(f"{label}: the cache write's result is not planned in the cache's storage")
        kw.update(cache_len=out.shape[2], pos_dtype=pos.dtype)
    out_strides = L.View.contiguous(out.shape).strides[:3]  # [B, H, S|T, D]: the rope's result or the cache
    spec = S.HeadRopeSpec(B, H, S_, D, out.dtype, tuple(xview.strides[:3]), tuple(out_strides),  # type: ignore[arg-type]
                          (cst[0], cst[2]), cos.dtype, rotate=p.rope is not None, **kw)
    return spec, (node.inputs[xi], xview.offset), w, out, pos
