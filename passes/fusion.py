"""Operator fusion: group nodes into kernels; each applied group becomes one FUSED node carrying its
subgraph (the reference backend runs it, so the fused graph must agree with the original), and
each FUSED node is exactly one kernel of the plan.

Order of proposals (``fusion_rules``; a rule proposes by fusion kind, never by op name):
whole candidates of the candidate-only rules first (``mlp``, ``norm_gemm``), a norm with the packed products in
different formats that read it (``packed_siblings``: one launch), then RoPE siblings
(``rope_siblings``: the q and k RoPEs of one layer, one output each) and single RoPEs with their
norm and cache write (``head_rope``), each such group with the attention reading its rotated q and
caches (``rope_attention``: the group becomes the attention's prologue), then per GEMM anchor its
``gemm_prologue`` and ``gemm_epilogue``, then per REDUCE anchor ``reduce_fusion``, then
``elementwise`` groups of what is left.

A group is formed only when it is
- legal (``legal``): only its final values are read outside it (several outputs only where the
  rule allows them: a residual sum written next to its norm), all outputs with one element count
  (one index space; ``rope_siblings`` alone gives each output its own: its grid is their rows in turn), and grouping creates no cycle (no path leaves the group and comes back);
- one kernel (``lowerable``): the codegen's capability query, ``fusec.lower.fused_plan.can_fuse``, says
  a template emits the group's body as one kernel. The pass asks it while it forms groups, like
  Inductor's scheduler asks its backends ``can_fuse``: a rule's proposal that is not one kernel as
  a whole is fitted node by node outward from its anchor (each node joins if the group stays legal
  and lowerable), and every node it declines is recorded with the codegen's reason; an
  elementwise group that is not one kernel is recorded as declined and regrown node by node from
  its first non-layout node. This is the one question the pass asks the codegen (no lowering
  state: a pure function of the candidate body, cut out with ``passes.subgraph.extract``);
- profitable (``fusion_rules.decide``): the rule default, an option, or an A/B override.
Every candidate and its decision is a ``FusionRecord`` in ``graph.meta["fusions"]`` (as JSON);
``graph.meta["kernels"]`` counts the launches of the result (every node except zero-copy views,
a FUSED node being one).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection, Sequence
from typing import Any

from fusec.ir import Graph, Node, Value, verify, writes_in_place
from fusec.ops import FusedAttrs, FusionKind, Op
from fusec.passes import fusion_rules as R
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.fusion_rules import Decision, FusionRecord
from fusec.passes.match import Ctx, prune_constants, toposort
from fusec.passes.subgraph import escaping, extract, label
from fusec.passes.views import view_of

NAME = "fusion"


def target_meta(options: PassOptions) -> dict[str, Any]:
    """What a fused body's kernel plan may use of the target, recorded in the body (``fused.kernel_plan`` reads only
    the body): ``wgmma`` where fusec's GEMM takes the products of up to 128 rows in its wgmma form (sm_90, unless
    FUSEC_GEMM_STREAM=0: ``choices.gemm_stream``), which also takes a gated unit after such a product
    (``lower.skinny``)."""
    from fusec.lower.choices import gemm_stream

    return {"wgmma": True} if options.wgmma and gemm_stream(True) else {}


@dataclasses.dataclass
class _Group:
    kind: FusionKind
    members: list[Node]
    rules: list[str] = dataclasses.field(default_factory=list)  # the parts applied, in order


class _Grouping:
    def __init__(self, graph: Graph, options: PassOptions):
        self.graph, self.options = graph, options
        self.ctx = Ctx(graph)
        self.graph_outputs = set(graph.outputs)
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.owner: dict[Node, int] = {}
        self.groups: list[_Group] = []
        self.records: list[FusionRecord] = []
        self.not_one_kernel: set[Node] = set()  # members of elementwise groups declined as a whole
        self.view = R.View(self.ctx.users, self.ctx.prod, self.ctx.is_output, lambda n: n in self.owner)
        # values some node overwrites in place (a cache_write's cache): value -> positions of the writers
        self.overwritten: dict[Value, list[int]] = {}
        for n in graph.nodes:
            for j, _ in writes_in_place(n):
                self.overwritten.setdefault(n.inputs[j], []).append(self.order[n])
        self.state_old = {new: old for old, new in graph.state_pairs() if new is not old}  # a state's new -> old value

    def sorted(self, members: Collection[Node]) -> list[Node]:
        return sorted(members, key=self.order.__getitem__)

    # ---- legality and capability ---------------------------------------------------------------
    def outputs(self, members: Collection[Node]) -> list[Value]:
        return escaping(self.sorted(members), self.ctx.users, self.graph_outputs)

    def legal(self, members: set[Node], multi_output: bool, outs: list[Value] | None = None,
              spaces: bool = False) -> str | None:
        """None if grouping ``members`` into one kernel is correct, else the reason it is not
        (``outs``: ``self.outputs(members)`` when the caller has it; ``spaces``: each output may have
        its own index space, for kernels whose grid is the concatenation of their parts')."""
        outs = self.outputs(members) if outs is None else outs
        if len(outs) > 1 and not multi_output:
            return f"intermediate {outs[0].name!r} is read outside the group"
        if len({v.numel for v in outs}) > 1 and not spaces:
            return "group outputs differ in element count: " + ", ".join(f"{v.name}{list(v.shape)}" for v in outs)
        # Does any path leave the group and re-enter it? A search from the group's readers, pruned
        # at the last member's position (nothing later can lead back): checked for every node a
        # group grows by, so it must stay cheaper than a whole-graph reachability query.
        last = max(self.order[m] for m in members)
        if len(outs) > 1:  # a multi-output group whose output is read before its last member runs before that reader:
            # not where it would make a state's new value before the old value's last read (a copy after the run)
            early = min((self.order[u] for v in outs for u in self.ctx.users(v)
                         if u not in members and self.order[u] < last), default=None)
            if early is not None:
                for v in outs:
                    old = self.state_old.get(v)
                    if old is not None and any(u not in members and self.order[u] >= early for u in self.ctx.users(old)):
                        return (f"state {old.name!r}'s new value {v.name!r} would be made before a read of the old "
                                f"one: the group runs before {v.name!r}'s readers")
        # The group runs at its last member: a member's read of a value that a node between the
        # member and there overwrites in place (a cache_write) would see the new contents.
        for m in members:
            for v in m.inputs:
                if any(self.order[m] < w < last for w in self.overwritten.get(v, ())):
                    return f"{m.describe()} reads {v.name!r} before it is overwritten in place; the group runs after"
        stack = [u for n in members for v in n.outputs for u in self.ctx.users(v) if u not in members]
        seen: set[Node] = set()
        while stack:
            x = stack.pop()
            if x in seen or self.order[x] > last:
                continue
            seen.add(x)
            for v in x.outputs:
                for u in self.ctx.users(v):
                    if u in members:
                        return f"grouping would create a cycle through {x.describe()}"
                    stack.append(u)
        return None

    def lowerable(self, members: Collection[Node], outs: list[Value] | None = None) -> str | None:
        """None if the codegen emits ``members`` as one kernel (or they are no fused node at all:
        a single node, or views only), else the codegen's reason."""
        from fusec.lower.fused_plan import can_fuse

        ordered = self.sorted(members)
        if len(ordered) < 2 or all(view_of(n) is not None for n in ordered):
            return None
        body = extract(ordered, self.outputs(ordered) if outs is None else outs, "candidate").body
        body.meta.update(target_meta(self.options))
        cap = can_fuse(body)
        return None if cap else cap.reason

    def check(self, members: set[Node], multi_output: bool, capable: bool = True, spaces: bool = False) -> str | None:
        """None if ``members`` may be one group: legal and (``capable``) one kernel; else why not."""
        outs = self.outputs(members)
        if (why := self.legal(members, multi_output, outs, spaces)) is not None:
            return "illegal: " + why
        if capable and (why := self.lowerable(members, outs)) is not None:
            return "not one kernel: " + why
        return None

    # ---- bookkeeping ---------------------------------------------------------------------------
    def record(self, rule: str, kind: FusionKind, members: Sequence[Node], decision: Decision, reason: str,
               legal: bool, name: str | None = None) -> None:
        ordered = self.sorted(members)
        self.records.append(FusionRecord(rule, kind, decision, reason, legal, tuple(label(n) for n in ordered),
                                         candidate_key(rule, ordered), self.ctx.layer(ordered[-1]), name))

    def decide(self, rule: str, members: Sequence[Node]) -> tuple[Decision, str]:
        o = self.options
        return R.decide(rule, o.disabled_fusions, o.enabled_fusions, o.fusion_overrides,
                        candidate_key(rule, self.sorted(members)))

    def new_group(self, kind: FusionKind, members: list[Node], rules: list[str]) -> int:
        gid = len(self.groups)
        self.groups.append(_Group(kind, list(members), rules))
        for n in members:
            self.owner[n] = gid
        return gid

    # ---- proposals -----------------------------------------------------------------------------
    def propose(self, rule: str, kind: FusionKind, members: list[Node], multi_output: bool = False,
                spaces: bool = False) -> None:
        """A whole candidate: applied as proposed, or not at all."""
        clash = [n for n in members if n in self.owner]
        why = (f"{label(clash[0])} is already in {_gname(self.owner[clash[0]])}" if clash
               else self.check(set(members), multi_output, spaces=spaces))
        if why is not None:
            self.record(rule, kind, members, Decision.REJECTED, why, legal=False)
            return
        decision, reason = self.decide(rule, members)
        gid = self.new_group(kind, members, [rule]) if decision == Decision.APPLIED else None
        self.record(rule, kind, members, decision, reason, True, None if gid is None else _gname(gid))

    def propose_anchor(self, anchor: Node, kind: FusionKind, parts: list[tuple[str, list[Node], bool]]) -> None:
        """One group per anchor: each part (rule, nodes found outward from the anchor, several
        outputs allowed) joins it, as a whole or as much of it as stays legal and one kernel."""
        gid = self.new_group(kind, [anchor], [])
        for rule, extra, multi in parts:
            extra = [n for n in extra if n not in self.owner]
            if extra:
                self.extend(gid, rule, extra, multi)
        if len(self.groups[gid].members) == 1 and _pointwise_or_injective(anchor):
            # nothing joined (a RoPE whose head_rope kernel cannot be made): the anchor stays free
            # for an elementwise group with its producers
            self.groups[gid].members = []
            del self.owner[anchor]

    def extend(self, gid: int, rule: str, extra: list[Node], multi_output: bool, spaces: bool = False) -> None:
        group = self.groups[gid]
        base = set(group.members)
        declined: list[tuple[Node, str]] = []
        whole = self.check(base | set(extra), multi_output, spaces=spaces)
        if whole is None:
            kept = extra
        else:
            kept, declined = self.fit(base, extra, multi_output, spaces)
        anchor = group.members[0]
        if not kept and whole is not None and len(extra) > 1:  # why the whole proposal failed (its parts alone fail
            # for their own reasons: a gated unit's first slice leaves the other half read outside the group)
            self.record(rule, group.kind, [anchor] + extra, Decision.REJECTED, whole, legal=False)
        for n, why in declined:
            self.record(rule, group.kind, [anchor, n], Decision.REJECTED, why, legal=False)
        if not kept:
            return
        decision, reason = self.decide(rule, [anchor] + kept)
        if decision == Decision.APPLIED:
            group.members += kept
            group.rules.append(rule)
            for n in kept:
                self.owner[n] = gid
        self.record(rule, group.kind, [anchor] + kept, decision, reason, True,
                    _gname(gid) if decision == Decision.APPLIED else None)

    def fit(self, base: set[Node], extra: list[Node], multi_output: bool,
            spaces: bool = False) -> tuple[list[Node], list[tuple[Node, str]]]:
        """The nodes of ``extra`` (in the order the rule found them, outward from the group) that
        join one by one, each touching the group and keeping it legal and one kernel; and the
        declined ones with the reason. A node only reachable through a declined one is skipped."""
        group = set(base)
        kept: list[Node] = []
        declined: list[tuple[Node, str]] = []
        for x in extra:
            if not self.touches(x, group):
                continue
            why = self.check(group | {x}, multi_output, spaces=spaces)
            if why is None:
                group.add(x)
                kept.append(x)
            else:
                declined.append((x, why))
        return kept, declined

    def touches(self, x: Node, group: set[Node]) -> bool:
        return (any(self.ctx.prod(v) in group for v in x.inputs)
                or any(u in group for v in x.outputs for u in self.ctx.users(v)))

    # ---- rules ---------------------------------------------------------------------------------
    def run_rules(self) -> None:
        nodes = self.graph.nodes
        for n in nodes:  # candidate-only rules first: if enabled they take precedence
            mlp = R.mlp_candidate(self.view, n)
            if mlp is not None:
                self.propose("mlp", R.K.GEMM, mlp + R.epilogue(self.view, n))
        for n in nodes:  # packed products of one norm in different formats: one launch, before the GEMM anchors
            sib = R.packed_siblings(self.view, n)
            if sib:
                self.propose("packed_siblings", R.K.GEMM, sib, multi_output=True, spaces=True)
        self.head_ropes(nodes)  # before the GEMM anchors: a RoPE joins its norm and cache write, not attention
        for n in nodes:
            if R.kind(n) == R.K.GEMM and n not in self.owner:
                self.gemm_anchor(n)
        for n in nodes:
            if R.kind(n) == R.K.REDUCE and n not in self.owner:
                pro = R.prologue(self.view, n, _pointwise_or_injective, set())
                pro += self.multi_output_prologue(n, pro)
                self.propose_anchor(n, R.K.REDUCE, [("reduce_fusion", pro + R.epilogue(self.view, n), True)])
        for n in nodes:
            if n not in self.owner and _pointwise_or_injective(n) and view_of(n) is None:
                self.elementwise_group(n)

    def gemm_anchor(self, n: Node) -> None:
        """One group per product: its norm prologue, injective prologue, elementwise epilogue, or else
        a gated unit, and a sampler of its result; each part as far as it stays one kernel."""
        gid = self.new_group(R.K.GEMM, [n], [])
        parts = [("norm_gemm", R.norm_prologue(self.view, n), False),
                 ("gemm_prologue", R.prologue(self.view, n, _injective, set()), False),
                 ("gemm_epilogue", R.epilogue(self.view, n), False)]
        for rule, extra, multi in parts:
            extra = [m for m in extra if m not in self.owner]
            if extra:
                self.extend(gid, rule, extra, multi)
        chain = [m for m in self.groups[gid].members[1:] if self.order[m] > self.order[n]]
        if not chain:
            extra = R.gated(self.view, n)
            if extra:
                self.extend(gid, "gated_epilogue", extra, False)
                chain = [m for m in self.groups[gid].members[1:] if self.order[m] > self.order[n]]
        end = max(chain, key=self.order.__getitem__) if chain else None
        extra = R.sample_after(self.view, n, [end] if end is not None else [])
        if extra:
            self.extend(gid, "gemm_sample", extra, False)

    def head_ropes(self, nodes: list[Node]) -> None:
        """RoPE-like nodes (multi-input INJECTIVE) with their ``head_rope`` members (a norm before,
        a cache write after; or a cache write beside other readers: ``side_writes``) and the
        layout views they read through. Siblings, i.e. those with
        one ``sibling_key`` (the q and k heads of one QKV product, rotated at the same positions),
        are proposed first as one group with one output per sibling (``rope_siblings``); what is
        not grouped so is proposed alone (``head_rope``)."""
        found: list[tuple[Node, list[Node]]] = []
        for n in nodes:
            if R.kind(n) == R.K.INJECTIVE and len(n.inputs) >= 2 and len(n.outputs) == 1 and n not in self.owner:
                extra = R.head_rope(self.view, n)
                extra += [m for m in R.input_views(self.view, n) if m not in extra]
                if not any(R.kind(m) == R.K.OPAQUE for m in extra):
                    extra += R.side_writes(self.view, n)[:1]
                found.append((n, extra))
        siblings: dict[tuple[Value, ...], list[tuple[Node, list[Node]]]] = {}
        for rope, extra in found:
            siblings.setdefault(R.sibling_key(self.view, rope, extra), []).append((rope, extra))
        copies = R.cache_copies(self.view, nodes)
        for key, group in siblings.items():
            members = [m for rope, extra in group for m in (rope, *extra)]
            positions = {m.inputs[2] for m in members if R.kind(m) == R.K.OPAQUE and len(m.inputs) == 3}
            plain = [m for (src, pos), chain in copies.items() if src is key[0] and pos in positions for m in chain
                     if m not in self.owner]
            if plain:  # the V heads of the same product, copied into their cache by the same launch
                self.propose("rope_siblings", R.K.INJECTIVE, members + plain, multi_output=True, spaces=True)
            if len(group) > 1 and not any(m in self.owner for m in members):
                self.propose("rope_siblings", R.K.INJECTIVE, members, multi_output=True, spaces=True)
        for rope, _ in found:
            if rope not in self.owner and (extra := R.head_rope(self.view, rope)):
                self.propose_anchor(rope, R.K.INJECTIVE, [("head_rope", extra, False)])
        for gid, group in enumerate(self.groups):  # then the attention reading them, as their prologue's kernel
            if {"rope_siblings", "head_rope"} & set(group.rules):
                extra = R.attention_reader(self.view, self.outputs(group.members))
                if extra:
                    self.extend(gid, "rope_attention", extra, multi_output=True, spaces=True)

    def multi_output_prologue(self, anchor: Node, taken: list[Node]) -> list[Node]:
        """Elementwise producers feeding the group whose results are also read elsewhere (the
        residual sum in front of a norm): the kernel writes them too."""
        group = set(taken) | {anchor}
        extra: list[Node] = []
        for n in [anchor] + taken:
            for v in n.inputs:
                p = self.ctx.prod(v)
                if p is None or p in group or p in self.owner or not R.elementwise_like(p) or len(p.outputs) != 1:
                    continue
                if p.outputs[0].numel != anchor.inputs[0].numel:
                    continue
                if self.legal(group | {p}, multi_output=True) is None:
                    group.add(p)
                    extra.append(p)
                    # and what only p reads (the embedding gathers in front of the first norm)
                    more = R.prologue(self.view, p, _pointwise_or_injective, group)
                    if more and self.legal(group | set(more), multi_output=True) is None:
                        group.update(more)
                        extra.extend(more)
        return extra

    def elementwise_group(self, seed: Node) -> None:
        """The legal group of pointwise/injective nodes around ``seed``; when the codegen cannot
        emit it as one kernel, the largest group it can, grown from its first non-layout node."""
        kind = R.kind(seed)
        if seed in self.not_one_kernel:  # what is left of a group declined as a whole (recorded)
            members = self.grow(seed, capable=True)
        else:
            members = self.grow(seed, capable=False)
            if _launches(members) < 2:
                return
            why = self.lowerable(members)
            if why is not None:
                self.record("elementwise", kind, members, Decision.REJECTED, "not one kernel: " + why, legal=False)
                self.not_one_kernel.update(members)
                start = next((m for m in self.sorted(members) if not R.layout(m)), seed)
                members = self.grow(start, capable=True)
        if _launches(members) >= 2:
            self.propose("elementwise", kind, members, multi_output=True)

    def grow(self, seed: Node, capable: bool) -> list[Node]:
        members, inside, frontier = [seed], {seed}, [seed]
        while frontier:
            n = frontier.pop()
            # producers, users, and pointwise siblings through a computed input: independent pointwise ops reading it
            # in one launch (horizontal; layout ops stay with their chains)
            near = [self.ctx.prod(v) for v in n.inputs] + [u for v in n.outputs for u in self.ctx.users(v)]
            if R.elementwise_like(n):
                near += [u for v in n.inputs if self.ctx.prod(v) is not None for u in self.ctx.users(v)
                         if R.elementwise_like(u)]
            for m in near:
                if m is None or m in inside or m in self.owner or not _pointwise_or_injective(m):
                    continue
                if self.check(inside | {m}, multi_output=True, capable=capable) is None:
                    inside.add(m)
                    members.append(m)
                    frontier.append(m)
        return members


def _injective(n: Node) -> bool:
    return R.kind(n) == R.K.INJECTIVE


def _pointwise_or_injective(n: Node) -> bool:
    return R.elementwise_like(n) or R.kind(n) == R.K.INJECTIVE


def _launches(members: list[Node]) -> int:
    return sum(1 for m in members if view_of(m) is None)


def _gname(gid: int) -> str:
    return f"fused_{gid}"


def candidate_key(rule: str, ordered: list[Node]) -> str:
    """A candidate's stable name: its rule, first and last member labels and a hash of all member
    labels (graph order). The ``fused_N`` group names shift when an earlier decision changes;
    this key does not, so A/B decisions (``PassOptions.fusion_overrides``) can name candidates."""
    labels = [label(n) for n in ordered]
    digest = hashlib.sha256("\0".join(labels).encode()).hexdigest()[:8]
    return f"{rule}:{labels[0]}..{labels[-1]}#{digest}"


def records(graph: Graph) -> list[FusionRecord]:
    """The typed fusion records of a fused graph (``graph.meta["fusions"]`` holds their JSON)."""
    return [FusionRecord.from_json(r) for r in graph.meta.get("fusions", [])]


def kernel_count(graph: Graph) -> int:
    return sum(1 for n in graph.nodes if view_of(n) is None)


def describe_kernels(graph: Graph) -> list[str]:
    """One line per kernel launch: ``rule: op+op+...`` for fused nodes, the op name otherwise."""
    out = []
    for n in graph.nodes:
        if view_of(n) is not None:
            continue
        if n.op == Op.FUSED:
            ops = [m.op.value for m in n.attrs.body.nodes if view_of(m) is None]
            out.append(f"{n.attrs.rule}: {'+'.join(ops)}")
        else:
            out.append(n.op.value)
    return out


def run(graph: Graph, options: PassOptions) -> PassResult:
    grouping = _Grouping(graph, options)
    grouping.run_rules()
    replace: dict[Node, Node] = {}
    dropped: set[Node] = set()
    for gid, group in enumerate(grouping.groups):
        members = grouping.sorted(group.members)
        if len(members) < 2 or all(view_of(m) is not None for m in members):
            continue
        outputs = grouping.outputs(members)
        cut = extract(members, outputs, _gname(gid))
        cut.body.meta.update(target_meta(options))
        verify(cut.body)
        rule = "+".join(group.rules)
        replace[members[-1]] = Node(Op.FUSED, cut.reads, outputs, FusedAttrs(group.kind, rule, cut.body), _gname(gid))
        dropped.update(members[:-1])
    nodes = [replace.get(n, n) for n in graph.nodes if n not in dropped]
    g = graph.copy()
    g.nodes = toposort(nodes, g)
    g.constants = prune_constants(g.constants, g.nodes, g.outputs)
    g.meta["fusions"] = [r.to_json() for r in grouping.records]
    g.meta["kernels"] = kernel_count(g)
    options.stats["kernels"] = g.meta["kernels"]
    options.bump("fusions_applied", len(replace))
    return PassResult(g, bool(replace))
