"""Zero-copy views: which nodes need no kernel because their output is a window on an input.

Every value fusec allocates is a contiguous row-major buffer of its own shape. A node is a *view*
when its output, read row-major, is exactly a contiguous byte range of its input's buffer, so the
runtime can hand out ``base pointer + byte_offset`` instead of launching a copy kernel:

- RESHAPE: always (row-major order is unchanged), offset 0;
- TRANSPOSE: when the permutation moves only size-1 axes (the non-1 axes keep their relative
  order), offset 0;
- EXPAND: when it only adds or keeps size-1 axes (same element count; a real broadcast reads
  with stride 0 and is not zero-copy), offset 0;
- SLICE: when the selected elements are one contiguous row-major run. Let ``k`` be the first axis
  whose output extent is not 1. The run is contiguous iff every axis after ``k`` is taken whole
  (output extent == input extent) and, if axis ``k`` has extent > 1, it is walked forward with
  step 1 (a step of 1 is also required on any later axis with extent > 1, which "whole" implies
  except for a full reversal). Axes before ``k`` select one index each. The byte offset is the
  row-major offset of the first selected element. An empty slice is not a view (nothing to alias).

Because a view of a contiguous buffer is itself a contiguous buffer of its own shape, views
compose: a chain of views resolves to the ultimate base with the byte offsets added
(``resolve``). The ``views`` pass changes nothing; it records the count in ``graph.meta["views"]``.
"""

from __future__ import annotations

import dataclasses

from fusec.ir import Graph, Node, Value
from fusec.ops import Op
from fusec.passes.base import PassOptions, PassResult

NAME = "views"


@dataclasses.dataclass(frozen=True)
class ViewInfo:
    """``node``'s single output is the bytes ``[byte_offset, byte_offset + out.nbytes)`` of ``base``."""

    base: Value
    byte_offset: int


def _row_major_strides(shape: tuple[int, ...]) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return strides


def _slice_offset(node: Node) -> int | None:
    """Element offset of a contiguous slice's first element, or None if the slice is not contiguous."""
    src, out = node.inputs[0].shape, node.outputs[0].shape
    if 0 in out:
        return None
    first = [0] * len(src)
    step = [1] * len(src)
    a = node.attrs
    for ax, s, st in zip(a.axes, a.starts, a.steps):
        first[ax], step[ax] = s, st
    k = next((i for i, d in enumerate(out) if d != 1), len(out))
    for i in range(k, len(out)):
        if out[i] > 1 and step[i] != 1:
            return None  # strided or reversed walk
        if i > k and out[i] != src[i]:
            return None  # a partial inner axis leaves gaps between rows
    return sum(f * s for f, s in zip(first, _row_major_strides(src)))


def view_of(node: Node) -> ViewInfo | None:
    """The ViewInfo if ``node`` can run as a zero-copy view of its first input, else None."""
    if len(node.outputs) != 1 or len(node.inputs) != 1:
        return None
    x, y = node.inputs[0], node.outputs[0]
    if x.dtype != y.dtype:
        return None
    if node.op == Op.RESHAPE:
        return ViewInfo(x, 0)
    if node.op == Op.EXPAND:
        return ViewInfo(x, 0) if x.numel == y.numel else None
    if node.op == Op.TRANSPOSE:
        moved = [p for p in node.attrs.perm if x.shape[p] != 1]
        return ViewInfo(x, 0) if moved == sorted(moved) else None
    if node.op == Op.SLICE:
        off = _slice_offset(node)
        return None if off is None else ViewInfo(x, off * x.dtype.itemsize)
    return None


def resolve(graph: Graph) -> dict[Value, tuple[Value, int]]:
    """For every view output in ``graph``: (ultimate base, byte offset into the base)."""
    out: dict[Value, tuple[Value, int]] = {}
    for node in graph.nodes:
        info = view_of(node)
        if info is not None:
            base, off = out.get(info.base, (info.base, 0))
            out[node.outputs[0]] = (base, off + info.byte_offset)
    return out


def run(graph: Graph, options: PassOptions) -> PassResult:
    n = sum(1 for node in graph.nodes if view_of(node) is not None)
    g = graph.copy()
    g.meta["views"] = n
    options.stats["views"] = n
    return PassResult(g, False)
