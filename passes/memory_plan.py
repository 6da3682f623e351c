"""Static memory planning: every non-weight value gets a fixed byte offset in one arena.

Contract of ``plan_memory(graph, alignment=256) -> MemoryPlan``:

- Time is the linear node order: a value lives from the node that defines it to the last node
  that reads it (inclusive). Graph inputs and outputs are *pinned*: their storage lives for the
  whole run, so the runtime can copy inputs in before the first launch and outputs out after
  the last. Constants (weights) are not in the arena; they live in a separate weights buffer
  (``weights_bytes``).
- A *storage group* is one buffer and every value that lives in it:
  * views (``fusec.passes.views.view_of``) live in their base's buffer at base + byte_offset and
    extend the buffer's life; a view of a constant aliases the weights buffer and is not in the
    arena (``offsets`` lacks it; ``alias`` names the constant). constant_fold folds such views,
    so after the pipeline none is left;
  * in-place: an ELEMENTWISE/BROADCAST node (or a fused node made only of such ops) may write
    its output over an input whose whole buffer dies at that node, when input and output have
    the same dtype and byte size, neither buffer is pinned, and no *other* input of the node
    reads the same buffer (a kernel thread could otherwise read an element another thread
    already overwrote).
- concat in place: an input of a CONCAT whose blocks are contiguous in its output (every axis
  before the concat axis of size 1) lives inside the output's buffer at its block's byte offset,
  so that the node producing it writes it there and the concat copies nothing, when the input
  fills its buffer (with the in-place chain that made it, if any), nothing in that buffer is read
  after the concat and the concat is the input's only reader, the buffer is not pinned, a
  constant or state, and the offset keeps the alignment.
- State (``Graph.state_pairs``: a KV cache, a position) lives outside the arena, in the plan's
  state region, like weights: ``state`` maps every value stored there (the state input, its views,
  and the ``cache_write`` results, which write in place into their cache's storage) to
  (state name, byte offset). A state update that is not stored in its state (e.g. ``pos + 1``)
  stays an ordinary pinned output; the lowering copies it into the state at the end of the run.
- Offsets: greedy by size (Pisarchyk & Lee, arXiv 2001.03288, "Greedy by Size for Offset
  Calculation"): groups in decreasing size, each into the smallest gap among the time-overlapping
  groups already placed, else above them. Sizes are rounded up to ``alignment``, so every offset
  is aligned.

Numbers: ``naive_bytes`` = sum of the aligned sizes of every value that needs a buffer of its
own without planning (everything but views and weights); ``lower_bound_bytes`` = max over time
of the sum of the aligned sizes of live groups (the best any offset assignment of these groups
can do); ``arena_bytes`` (= planned) >= lower bound.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from fusec.codegen.spec_base import contiguous_strides
from fusec.ir import Graph, Node, Value
from fusec.ops import OP_INFO, FusionKind, Op
from fusec.passes import views
from fusec.passes.base import PassOptions, PassResult

NAME = "memory_plan"
REQUIRES = ("views",)  # the plan's views must be the ones the views pass counted: plan last

_INPLACE_KINDS = (FusionKind.ELEMENTWISE, FusionKind.BROADCAST)


def inplace_capable(node: Node) -> bool:
    """May ``node`` write its output over a same-size input? True for ELEMENTWISE/BROADCAST ops, and
    for a fused node (a ``body`` graph in its attrs) whose body holds only such ops: then output
    element i depends on input elements at index i alone (a same-size input cannot be broadcast)."""
    info = OP_INFO.get(node.op)
    if info is not None and info.kind in _INPLACE_KINDS:
        return True
    body = getattr(node.attrs, "body", None)
    if not isinstance(body, Graph) or not body.nodes:
        return False
    return all(inplace_capable(n) and views.view_of(n) is None for n in body.nodes)


def _reads_at_own_index(node: Node, v: Value) -> bool:
    """Whether ``node`` reads ``v`` (the size of each of its outputs) only element i for its outputs' element i, so an
    output may overwrite v: an in-place capable single-output node; or a fused elementwise group (several outputs,
    layout ops inside) whose recorded kernel plan reads v through the outputs' own contiguous strides."""
    if views.view_of(node) is not None:
        return False
    sel = getattr(node, "kernel", None)
    if node.op == Op.FUSED and sel is not None and sel.family == "elementwise":
        body, shape = node.attrs.body, node.outputs[0].shape
        mine = {body.inputs[j] for j, x in enumerate(node.inputs) if x is v}
        flat = [st for d, st in zip(shape, contiguous_strides(shape)) if d != 1]
        return all([st for d, st in zip(shape, strides) if d != 1] == flat and off == 0
                   for bv, strides, off in sel.detail.operands if bv in mine)
    return inplace_capable(node) and len(node.outputs) == 1


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


@dataclasses.dataclass
class UsageRecord:
    """One arena buffer: the group named after its root value."""

    name: str
    size: int  # aligned bytes
    first: int  # first node index that touches it
    last: int  # last node index that touches it (inclusive)
    offset: int = 0
    pinned: bool = False
    members: list[str] = dataclasses.field(default_factory=list)

    def overlaps_in_time(self, other: UsageRecord) -> bool:
        return self.first <= other.last and other.first <= self.last


@dataclasses.dataclass
class MemoryPlan:
    alignment: int
    arena_bytes: int
    offsets: dict[str, int]  # arena values (incl. views, in-place) -> byte offset
    alias: dict[str, dict[str, Any]]  # value -> {"base": root, "byte_offset": int, "kind": view|inplace|update|concat}
    records: list[UsageRecord]
    naive_bytes: int
    lower_bound_bytes: int
    weights_bytes: int
    num_steps: int = 0
    state: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)  # value -> (state, byte offset)

    @property
    def planned_bytes(self) -> int:
        return self.arena_bytes

    def summary(self) -> dict[str, int]:
        return {"naive_bytes": self.naive_bytes, "planned_bytes": self.arena_bytes,
                "lower_bound_bytes": self.lower_bound_bytes, "weights_bytes": self.weights_bytes}


def _place(records: list[UsageRecord], key: Any) -> int:
    """Best-fit offsets in the order ``key`` gives (each record into the smallest gap among the
    time-overlapping records already placed, else above them); returns the arena size."""
    # placed: (offset, end, first, last) sorted by offset, a new record after those with its offset
    # (the order a stable sort gives); plain tuples keep the O(n^2) scan cheap.
    placed: list[tuple[int, int, int, int]] = []
    top = 0
    for rec in sorted(records, key=key):
        size = rec.size
        if size == 0:
            rec.offset = 0
            continue
        rf, rl = rec.first, rec.last
        prev, best, best_gap = 0, None, None
        for off, end, first, last in placed:
            if first > rl or rf > last:  # not alive at the same time
                continue
            gap = off - prev
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = prev, gap
            if end > prev:
                prev = end
        rec.offset = prev if best is None else best
        bisect.insort_right(placed, (rec.offset, rec.offset + size, rf, rl), key=lambda t: t[0])
        top = max(top, rec.offset + size)
    return top


REPAIR_ROUNDS = 8
_REPAIR_BUDGET = 4_000_000  # record pairs compared over all repair rounds (each placement is O(n^2))


def greedy_by_size(records: list[UsageRecord]) -> int:
    """Assign ``offset`` to every record; returns the arena size. Deterministic.

    Greedy by size first. When that ends above the lower bound, a few repair rounds: the records
    placed above the bound move ahead of their size class (a priority bumped once per round they
    overflow) and the placement is redone; the smallest arena wins. Greedy by size places the large
    per-layer buffers before the small long-lived ones that cross layers (a residual stream, a mask),
    which then find no gap; placed earlier, they leave the large ones a layout that fits (GPT-2 tiny:
    1.096x -> 1.0x the bound)."""
    bound = lower_bound(records, max((r.last for r in records), default=0) + 1)
    prio: dict[str, int] = {}

    def key(r: UsageRecord) -> tuple[Any, ...]:
        return (-prio.get(r.name, 0), -r.size, r.first, r.name)

    top = _place(records, key)
    best = (top, {r.name: r.offset for r in records})
    rounds = min(REPAIR_ROUNDS, _REPAIR_BUDGET // max(len(records) ** 2, 1)) if top > bound else 0
    for _ in range(rounds):
        over = [r.name for r in records if r.offset + r.size > bound and not r.pinned]
        if not over:
            break
        for name in over:
            prio[name] = prio.get(name, 0) + 1
        top = _place(records, key)
        if top < best[0]:
            best = (top, {r.name: r.offset for r in records})
        if top <= bound:
            break
    for r in records:
        r.offset = best[1][r.name]
    return best[0]


def lower_bound(records: list[UsageRecord], steps: int) -> int:
    delta = [0] * (steps + 2)
    for r in records:
        delta[r.first] += r.size
        delta[r.last + 1] -= r.size
    best = cur = 0
    for d in delta:
        cur += d
        best = max(best, cur)
    return best


def _updates_in_state(graph: Graph, nodes: list[Node], states: set[Value], root: dict[Value, Value],
                      boff: dict[Value, int], kind: dict[Value, str], members: dict[Value, list[Value]],
                      last: dict[Value, int]) -> None:
    """Store a state's new value straight into the state's storage (no copy after the run) where
    that is safe: the node computing it runs after every read of the old value, and reads the old
    value itself (if at all) only elementwise, element i for element i (an in-place capable node)."""
    users: dict[Value, list[int]] = {}
    for i, n in enumerate(nodes):
        for v in n.inputs:
            users.setdefault(root.get(v, v), []).append(i)
    producer = {o: i for i, n in enumerate(nodes) for o in n.outputs}
    user_outs = set(graph.user_outputs())
    for src, dst in graph.state_pairs():
        if dst is src or src not in states or dst in kind or root.get(dst) is not dst or dst in user_outs:
            continue
        i = producer.get(dst)
        if i is None or dst.nbytes != src.nbytes or dst.dtype != src.dtype:
            continue
        p = nodes[i]
        reads = [j for j in users.get(src, [])]
        if any(j > i for j in reads):
            continue  # the old value is still read after the new one is made
        if i in reads and not _reads_at_own_index(p, src):
            continue
        for m in members.pop(dst):  # the new value and its views move into the state's storage
            root[m] = src
            members[src].append(m)
        kind[dst] = "update"
        last[src] = max(last[src], last.pop(dst, i))


def concat_blocks(node: Node) -> list[int] | None:
    """The byte offset of each input's block in a CONCAT's output when every block is contiguous
    there (every axis before the concat axis of size 1), else None."""
    if node.op != Op.CONCAT:
        return None
    out, axis = node.outputs[0], node.attrs.axis % len(node.outputs[0].shape)
    if any(d != 1 for d in out.shape[:axis]):
        return None
    offs, at = [], 0
    for v in node.inputs:
        offs.append(at)
        at += v.nbytes
    return offs


def _concats_in_place(nodes: list[Node], consts: set[Value], pinned: set[Value], root: dict[Value, Value],
                      boff: dict[Value, int], kind: dict[Value, str], members: dict[Value, list[Value]],
                      first: dict[Value, int], last: dict[Value, int], alignment: int) -> None:
    """Move each eligible CONCAT input's buffer into its output's (see the module docstring): the
    input fills its buffer (at offset 0, the same size: the buffer may hold the in-place chain that
    made it), nothing in that buffer is read after the concat, and the concat is the input's only
    reader."""
    readers: dict[Value, int] = {}
    for n in nodes:
        for v in n.inputs:
            readers[v] = readers.get(v, 0) + 1
    for i, node in enumerate(nodes):
        offs = concat_blocks(node)
        if offs is None:
            continue
        out = node.outputs[0]
        r_out = root[out]
        for v, off in zip(node.inputs, offs):
            r, at = root.get(v), boff[out] + off
            if (r is None or r is r_out or r not in members or r in consts or r in pinned or boff[v] != 0
                    or r.nbytes != v.nbytes or last[r] != i or readers.get(v) != 1 or at % alignment
                    or v.dtype != out.dtype):
                continue
            for m in members.pop(r):
                root[m], boff[m] = r_out, boff[m] + at
                members[r_out].append(m)
            kind[r] = "concat"
            first[r_out] = min(first[r_out], first.pop(r))
            last[r_out] = max(last[r_out], last.pop(r))


def plan_memory(graph: Graph, alignment: int = 256) -> MemoryPlan:
    """Plan ``graph``'s arena (see the module docstring for the contract)."""
    from fusec.ir import writes_in_place

    nodes = graph.nodes
    end = max(len(nodes) - 1, 0)
    states = {src for src, _ in graph.state_pairs()}
    consts = set(graph.constants) | states  # neither lives in the arena
    root: dict[Value, Value] = {}
    boff: dict[Value, int] = {}
    kind: dict[Value, str] = {}
    members: dict[Value, list[Value]] = {}
    first: dict[Value, int] = {}
    last: dict[Value, int] = {}

    def own(v: Value, t: int) -> None:
        root[v], boff[v], members[v] = v, 0, [v]
        first[v] = last[v] = t

    for v in graph.inputs:
        own(v, 0)
    for c in graph.constants:
        own(c, 0)
    view_nodes = set()
    for i, node in enumerate(nodes):
        info = views.view_of(node)
        if info is not None:
            out, r = node.outputs[0], root[info.base]
            root[out], boff[out], kind[out] = r, boff[info.base] + info.byte_offset, "view"
            members[r].append(out)
            last[r] = max(last[r], i)
            view_nodes.add(i)
        elif writes_in_place(node):  # a cache_write (or a fused one): the result is its cache's storage
            for j, k in writes_in_place(node):
                out, r = node.outputs[k], root[node.inputs[j]]
                root[out], boff[out], kind[out] = r, boff[node.inputs[j]], "update"
                members[r].append(out)
                last[r] = max(last[r], i)
            for k, o in enumerate(node.outputs):
                if o not in root:
                    own(o, i)
            view_nodes.add(i)
        else:
            for o in node.outputs:
                own(o, i)
        for v in node.inputs:
            last[root[v]] = max(last[root[v]], i)
    _updates_in_state(graph, nodes, states, root, boff, kind, members, last)
    pinned = {root[v] for v in (*graph.inputs, *graph.outputs)}
    for r in pinned:
        first[r], last[r] = 0, end

    # In-place: in node order, so chains (add -> mul -> gelu) reuse one buffer.
    outputs = set(graph.outputs)
    for i, node in enumerate(nodes):
        if i in view_nodes or len(node.outputs) != 1:
            continue
        out = node.outputs[0]
        if not inplace_capable(node) or out in outputs or root[out] in pinned:
            continue
        for v in node.inputs:
            r = root[v]
            if (r in consts or r in pinned or last[r] != i or v.dtype != out.dtype or v.nbytes != out.nbytes
                    or any(root[u] is r and u is not v for u in node.inputs)):
                continue
            for m in members.pop(out):  # out and its views move into r's buffer
                root[m], boff[m] = r, boff[m] + boff[v]
                members[r].append(m)
            kind[out] = "inplace"
            last[r] = max(last[r], last.pop(out))
            first.pop(out)
            break

    _concats_in_place(nodes, consts, pinned, root, boff, kind, members, first, last, alignment)

    records = [UsageRecord(r.name, align_up(r.nbytes, alignment), first[r], last[r], pinned=r in pinned,
                           members=[m.name for m in ms])
               for r, ms in members.items() if r not in consts]
    arena = greedy_by_size(records)
    offset_of = {rec.name: rec.offset for rec in records}
    offsets = {v.name: offset_of[r.name] + boff[v] for v, r in root.items() if r not in consts}
    alias = {v.name: {"base": root[v].name, "byte_offset": boff[v], "kind": kind[v]} for v in kind}
    in_state = {v.name: (r.name, boff[v]) for v, r in root.items() if r in states}
    naive = sum(align_up(v.nbytes, alignment) for v in root if v not in consts and kind.get(v) not in ("view", "update"))
    return MemoryPlan(alignment=alignment, arena_bytes=arena, offsets=offsets, alias=alias, records=records,
                      naive_bytes=naive, lower_bound_bytes=lower_bound(records, len(nodes)),
                      weights_bytes=graph.weight_bytes, num_steps=len(nodes), state=in_state)


def run(graph: Graph, options: PassOptions) -> PassResult:
    plan = plan_memory(graph)
    g = graph.copy()
    g.meta["memory"] = plan.summary()
    return PassResult(g, False)
