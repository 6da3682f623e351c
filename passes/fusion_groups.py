"""How fusion forms a group, apart from which groups the rules propose (``passes/fusion.py``): a group is legal
(``Groups.legal``), one kernel (``Groups.lowerable``: the codegen's ``can_fuse``) and profitable (``Groups.decide``);
a rule's proposal joins as a whole or node by node outward from its anchor (``Groups.extend``, ``Groups.fit``), and
every candidate and its decision is recorded (``Groups.record``)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection, Sequence
from typing import Any

from fusec.ir import Graph, Node, Value, writes_in_place
from fusec.ops import FusionKind
from fusec.passes import fusion_rules as R
from fusec.passes.base import PassOptions
from fusec.passes.fusion_rules import Decision, FusionRecord
from fusec.passes.match import Ctx
from fusec.passes.subgraph import escaping, extract, label
from fusec.passes.views import view_of


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


class Groups:
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
        why = (f"{label(clash[0])} is already in {group_name(self.owner[clash[0]])}" if clash
               else self.check(set(members), multi_output, spaces=spaces))
        if why is not None:
            self.record(rule, kind, members, Decision.REJECTED, why, legal=False)
            return
        decision, reason = self.decide(rule, members)
        gid = self.new_group(kind, members, [rule]) if decision == Decision.APPLIED else None
        self.record(rule, kind, members, decision, reason, True, None if gid is None else group_name(gid))

    def propose_anchor(self, anchor: Node, kind: FusionKind, parts: list[tuple[str, list[Node], bool]]) -> None:
        """One group per anchor: each part (rule, nodes found outward from the anchor, several
        outputs allowed) joins it, as a whole or as much of it as stays legal and one kernel."""
        gid = self.new_group(kind, [anchor], [])
        for rule, extra, multi in parts:
            extra = [n for n in extra if n not in self.owner]
            if extra:
                self.extend(gid, rule, extra, multi)
        if len(self.groups[gid].members) == 1 and pointwise_or_injective(anchor):
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
                    group_name(gid) if decision == Decision.APPLIED else None)

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


def pointwise_or_injective(n: Node) -> bool:
    return R.elementwise_like(n) or R.kind(n) == R.K.INJECTIVE


def group_name(gid: int) -> str:
    return f"fused_{gid}"


def candidate_key(rule: str, ordered: list[Node]) -> str:
    """A candidate's stable name: its rule, first and last member labels and a hash of all member
    labels (graph order). The ``fused_N`` group names shift when an earlier decision changes;
    this key does not, so A/B decisions (``PassOptions.fusion_overrides``) can name candidates."""
    labels = [label(n) for n in ordered]
    digest = hashlib.sha256("\0".join(labels).encode()).hexdigest()[:8]
    return f"{rule}:{labels[0]}..{labels[-1]}#{digest}"
