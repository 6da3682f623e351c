"""GPU lowering of ``Op.PAD``.

Constant mode: two launches into the output, the fill (an elementwise kernel of the fill value,
broadcast) then the copy of the kept part of the input into its box (the index-mapping copy kernel).

Reflect, edge and wrap modes: the output splits, axis by axis, into at most three segments (before,
the input, after); in each the source coordinate is affine in the output one: ``start + step * j``
with step 1 (the input, and wrap's periodic copies: one segment per period a pad spans), -1
(reflect's mirror images) or 0 (edge's repeated border). Every combination of segments is one copy
launch with those source strides (3 ** padded axes launches for pads within one period, no fill).
Negative pads crop first, as in the reference. More than ``MAX_PAD_COPIES`` launches (wide wrap pads
over several axes) are refused in one line (shape inference already refuses a reflect pad wider
than one reflection and any pad of an empty axis)."""

from __future__ import annotations

import itertools
import math

from fusec.codegen import copyspecs as C
from fusec.codegen import specs as S
from fusec.codegen.elementwise import Const, In
from fusec.ir import Node
from fusec.lower import Context, LoweringError

MAX_PAD_COPIES = 81  # 3 ** 4: four padded axes


def lower_pad(ctx: Context, node: Node, label: str) -> None:
    x, out, a = node.inputs[0], node.output, node.attrs
    rank = len(x.shape)
    begins, ends = a.pads[:rank], a.pads[rank:]
    kept = tuple(d + min(b, 0) + min(e, 0) for d, b, e in zip(x.shape, begins, ends))
    xs, os_ = S.contiguous_strides(x.shape), S.contiguous_strides(out.shape)
    crop = sum(-min(b, 0) * s for b, s in zip(begins, xs))
    if a.mode != "constant":
        for spec in mirror_copies(x.dtype, kept, [max(b, 0) for b in begins], [max(e, 0) for e in ends],
                                  xs, os_, crop, a.mode, label):
            ctx.kernel(spec, [x, out], label)
        return
    if any(b > 0 or e > 0 for b, e in zip(begins, ends)):
        if len(node.inputs) > 1:  # the run-time fill value, read at every position
            fill = S.elementwise_spec(In(0), [node.inputs[1].shape], [x.dtype], out.shape, vectorize=False)
            ctx.kernel(fill, [node.inputs[1], out], label)
        else:
            zero = False if x.dtype.value == "bool" else 0
            ctx.kernel(S.elementwise_spec(Const(zero, x.dtype), [], [], out.shape, vectorize=False), [out], label)
    if 0 in kept:
        return  # nothing of the input survives the crop
    dst_off = sum(max(b, 0) * s for b, s in zip(begins, os_))
    ctx.kernel(C.CopySpec(x.dtype, kept, xs, os_, src_offset=crop, dst_offset=dst_off), [x, out], label)


def _wrap_runs(out: int, length: int, src: int, d: int) -> list[tuple[int, int, int, int]]:
    """Wrap's periodic positions from output ``out`` on, source ``src`` (mod d): one run per period."""
    runs = []
    while length > 0:
        n = min(d - src % d, length)
        runs.append((out, n, src % d, 1))
        out, length, src = out + n, length - n, 0
    return runs


def _segments(d: int, b: int, e: int, mode: str, axis: int, label: str) -> list[tuple[int, int, int, int]]:
    """(output start, length, source start, source step) along one axis of (cropped) extent ``d``."""
    if mode == "reflect" and d == 1:
        mode = "edge"  # a single element reflects onto itself (numpy, the reference)
    if mode == "reflect" and max(b, e) > d - 1:  # shape inference refuses it first
        raise LoweringError(f"{label}: pad in reflect mode of {max(b, e)} on axis {axis} exceeds its extent "
                            f"less one ({d - 1})")
    if (b or e) and d == 0:
        raise LoweringError(f"{label}: pad in {mode} mode of the empty axis {axis}")
    if mode == "wrap":
        return [s for s in _wrap_runs(0, b, -b, d) + [(b, d, 0, 1)] + _wrap_runs(b + d, e, 0, d) if s[1] > 0]
    before = {"reflect": (b, -1), "edge": (0, 0)}[mode]
    after = {"reflect": (d - 2, -1), "edge": (d - 1, 0)}[mode]
    segs = [(0, b) + before, (b, d, 0, 1), (b + d, e) + after]
    return [s for s in segs if s[1] > 0]


def mirror_copies(dtype, kept: tuple[int, ...], begins: list[int], ends: list[int], xs: tuple[int, ...],  # noqa: ANN001
                  os_: tuple[int, ...], crop: int, mode: str, label: str) -> list[C.CopySpec]:
    """The copy specs of a reflect / edge / wrap pad (see the module docstring)."""
    per_axis = [_segments(d, b, e, mode, i, label) for i, (d, b, e) in enumerate(zip(kept, begins, ends))]
    count = math.prod(len(p) for p in per_axis)
    if count > MAX_PAD_COPIES:
        raise LoweringError(f"{label}: pad in {mode} mode over {sum(len(p) > 1 for p in per_axis)} axes needs "
                            f"{count} copies (more than {MAX_PAD_COPIES}); it runs on the reference backend")
    specs = []
    for combo in itertools.product(*per_axis):
        shape = tuple(s[1] for s in combo)
        src = tuple(s[3] * st for s, st in zip(combo, xs))
        specs.append(C.CopySpec(dtype, shape, src, os_, src_offset=crop + sum(s[2] * st for s, st in zip(combo, xs)),
                                dst_offset=sum(s[0] * st for s, st in zip(combo, os_))))
    return specs
