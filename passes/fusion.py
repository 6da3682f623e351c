"""Operator fusion: group nodes into kernels; each applied group becomes one FUSED node carrying its
subgraph (the reference backend runs it, so the fused graph must agree with the original).

Order of proposals (``fusion_rules.RULES``; a rule proposes by fusion kind, never by op name):
candidate-only rules first (``mlp``, ``norm_gemm``: applied only when enabled), then per GEMM
anchor its ``gemm_prologue`` and ``gemm_epilogue``, then per REDUCE anchor ``reduce_fusion``,
then ``elementwise`` chains of what is left.

Legality (``legal``) is separate from profitability (``decide``): a group is legal when
- only its final values are read outside it (several outputs only where the rule allows them:
  a residual sum written next to its norm), all outputs with one element count (one index space),
- and grouping creates no cycle (no path leaves the group and comes back into it).
Every candidate and its decision is recorded in ``graph.meta["fusions"]``; ``graph.meta["kernels"]``
counts the launches of the result (every node except zero-copy views, a FUSED node being one).
"""

from __future__ import annotations

import hashlib
from typing import Any

from fusec.ir import Graph, Node, Value, verify
from fusec.ops import FusedAttrs, Op
from fusec.passes import fusion_rules as R
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, prune_constants, toposort
from fusec.passes.views import view_of

NAME = "fusion"


def decide(rule: str, options: PassOptions, key: str | None = None) -> tuple[str, str]:
    """Profitability: (decision, reason) for a legal, non-overlapping candidate of ``rule``.
    A per-candidate override (``options.fusion_overrides[key]``, from an A/B ledger) wins over
    the rule flags and the rule's default."""
    r = R.RULES[rule]
    if key is not None and key in options.fusion_overrides:
        return ("applied", "A/B decision: fused") if options.fusion_overrides[key] else ("rejected", "A/B decision: unfused")
    if rule in options.disabled_fusions:
        return "rejected", "disabled by option"
    if rule in options.enabled_fusions:
        return "applied", "enabled by option"
    if not r.default:
        return "candidate", "off by default: " + r.why
    return "applied", "default on: " + r.why


class _Grouping:
    def __init__(self, graph: Graph, options: PassOptions):
        self.graph, self.options = graph, options
        self.ctx = Ctx(graph)
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.owner: dict[Node, int] = {}
        self.groups: list[tuple[str, str, list[Node]]] = []  # (rule(s), kind, members)
        self.records: list[dict[str, Any]] = []
        self.view = R.View(self.ctx.users, self.ctx.prod, self.ctx.is_output, lambda n: n in self.owner)

    # ---- legality ------------------------------------------------------------------------------
    def outputs(self, members: set[Node]) -> list[Value]:
        return [v for n in sorted(members, key=self.order.__getitem__) for v in n.outputs
                if self.ctx.is_output(v) or any(u not in members for u in self.ctx.users(v))]

    def legal(self, members: set[Node], multi_output: bool) -> str | None:
        """None if grouping ``members`` into one kernel is correct, else the reason it is not."""
        outs = self.outputs(members)
        if len(outs) > 1 and not multi_output:
            return f"intermediate {outs[0].name!r} is read outside the group"
        if len({v.numel for v in outs}) > 1:
            return "group outputs differ in element count: " + ", ".join(f"{v.name}{list(v.shape)}" for v in outs)
        last = max(self.order[m] for m in members)
        stack = [u for n in members for v in n.outputs for u in self.ctx.users(v) if u not in members]
        seen: set[Node] = set()
        while stack:  # does any path leave the group and re-enter it?
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

    # ---- bookkeeping ---------------------------------------------------------------------------
    def record(self, rule: str, kind: str, members: list[Node], decision: str, reason: str,
               name: str | None = None) -> None:
        ordered = sorted(members, key=self.order.__getitem__)
        self.records.append({"name": name, "key": candidate_key(rule, ordered), "rule": rule, "kind": kind, "decision": decision, "reason": reason,
                             "members": [_label(n) for n in ordered], "layer": self.ctx.layer(ordered[-1])})

    def propose(self, rule: str, kind: str, members: list[Node], multi_output: bool = False) -> bool:
        """Decide one candidate; on "applied" it becomes a group. Returns whether it was applied."""
        clash = [n for n in members if n in self.owner]
        decision, reason = decide(rule, self.options, self.key(rule, members))
        if decision == "applied":
            if clash:
                decision, reason = "rejected", f"{_label(clash[0])} is already in {self._gname(self.owner[clash[0]])}"
            elif (why := self.legal(set(members), multi_output)) is not None:
                decision, reason = "rejected", "illegal: " + why
        if decision != "applied":
            self.record(rule, kind, members, decision, reason)
            return False
        gid = len(self.groups)
        self.groups.append((rule, kind, list(members)))
        for n in members:
            self.owner[n] = gid
        self.record(rule, kind, members, decision, reason, self._gname(gid))
        return True

    def grow(self, gid: int, rule: str, extra: list[Node], multi_output: bool) -> None:
        """Add ``extra`` (proposed by ``rule``) to group ``gid``, recording the decision."""
        rules, kind, members = self.groups[gid]
        decision, reason = decide(rule, self.options, self.key(rule, [members[0]] + extra))
        if decision == "applied" and (why := self.legal(set(members) | set(extra), multi_output)) is not None:
            decision, reason = "rejected", "illegal: " + why
        name = self._gname(gid)
        if decision == "applied":
            self.groups[gid] = (f"{rules}+{rule}", kind, members + extra)
            for n in extra:
                self.owner[n] = gid
        self.record(rule, kind, [members[0]] + extra, decision, reason, name if decision == "applied" else None)

    def key(self, rule: str, members: list[Node]) -> str:
        return candidate_key(rule, sorted(members, key=self.order.__getitem__))

    def _gname(self, gid: int) -> str:
        return f"fused_{gid}"

    # ---- rules ---------------------------------------------------------------------------------
    def run_rules(self) -> None:
        nodes = self.graph.nodes
        for n in nodes:  # candidate-only rules first: if enabled they take precedence
            mlp = R.mlp_candidate(self.view, n)
            if mlp is not None:
                mlp += R.epilogue(self.view, n)
                self.propose("mlp", "gemm", mlp)
        for n in nodes:
            if R.is_norm(n) and n not in self.owner:
                m = self.view.sole_reader(n.outputs[0])
                if m is not None and R.kind(m) == R.K.GEMM and m.inputs[0] is n.outputs[0] and m not in self.owner:
                    self.propose("norm_gemm", "gemm", [n, m])
        for n in nodes:
            if R.kind(n) != R.K.GEMM or n in self.owner:
                continue
            self.propose_anchor(n, "gemm", [("gemm_prologue", R.prologue(self.view, n, _injective, set()), False),
                                            ("gemm_epilogue", R.epilogue(self.view, n), False)])
        for n in nodes:
            if R.kind(n) != R.K.REDUCE or n in self.owner:
                continue
            pro = R.prologue(self.view, n, _pointwise_or_injective, set())
            pro += self.multi_output_prologue(n, pro)
            self.propose_anchor(n, "reduce", [("reduce_fusion", pro + R.epilogue(self.view, n), True)])
        for n in nodes:
            if n not in self.owner and _pointwise_or_injective(n) and view_of(n) is None:
                self.elementwise_group(n)

    def propose_anchor(self, anchor: Node, kind: str, parts: list[tuple[str, list[Node], bool]]) -> None:
        """One group per anchor: each non-empty part (rule, nodes) joins it if decided "applied"."""
        gid = len(self.groups)
        self.groups.append(("", kind, [anchor]))
        self.owner[anchor] = gid
        for rule, extra, multi in parts:
            if extra:
                self.grow(gid, rule, [n for n in extra if n not in self.owner], multi)
        rules, _, members = self.groups[gid]
        self.groups[gid] = (rules.lstrip("+"), kind, members)

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
        members = [seed]
        inside = {seed}
        frontier = [seed]
        while frontier:
            n = frontier.pop()
            near = [self.ctx.prod(v) for v in n.inputs] + [u for v in n.outputs for u in self.ctx.users(v)]
            for m in near:
                if m is None or m in inside or m in self.owner or not _pointwise_or_injective(m):
                    continue
                if self.legal(inside | {m}, multi_output=True) is None:
                    inside.add(m)
                    members.append(m)
                    frontier.append(m)
        if sum(1 for m in members if view_of(m) is None) >= 2:
            self.propose("elementwise", R.kind(seed).name.lower(), members, multi_output=True)


def _injective(n: Node) -> bool:
    return R.kind(n) == R.K.INJECTIVE


def _pointwise_or_injective(n: Node) -> bool:
    return R.elementwise_like(n) or R.kind(n) == R.K.INJECTIVE


def _label(n: Node) -> str:
    return n.name or n.outputs[0].name


def candidate_key(rule: str, ordered: list[Node]) -> str:
    """A candidate's stable name: its rule, first and last member labels and a hash of all member
    labels (graph order). The ``fused_N`` group names shift when an earlier decision changes;
    this key does not, so A/B decisions (``PassOptions.fusion_overrides``) can name candidates."""
    labels = [_label(n) for n in ordered]
    digest = hashlib.sha256("\0".join(labels).encode()).hexdigest()[:8]
    return f"{rule}:{labels[0]}..{labels[-1]}#{digest}"


def build_fused(graph: Graph, members: list[Node], outputs: list[Value], kind: str, rule: str, name: str) -> Node:
    """One FUSED node computing ``outputs`` from ``members`` (a self-contained body Graph)."""
    produced = {v for n in members for v in n.outputs}
    inputs: list[Value] = []
    consts: list[Value] = []
    fresh: dict[Value, Value] = {}
    for n in members:
        for v in n.inputs:
            if v in produced or v in fresh:
                continue
            if v.data is not None and v.numel == 1:  # scalar literals live in the kernel body
                fresh[v] = Value(v.name, v.shape, v.dtype, v.data)
                consts.append(fresh[v])
            else:
                fresh[v] = Value(v.name, v.shape, v.dtype)
                inputs.append(v)
    for v in produced:
        fresh[v] = Value(v.name, v.shape, v.dtype)
    body_nodes = [Node(n.op, [fresh[v] for v in n.inputs], [fresh[v] for v in n.outputs], n.attrs, n.name)
                  for n in members]
    body = Graph([fresh[v] for v in inputs], [fresh[v] for v in outputs], body_nodes, consts, name=name)
    verify(body)
    return Node(Op.FUSED, inputs, outputs, FusedAttrs(kind=kind, rule=rule, body=body), name=name)


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
    order = grouping.order
    replace: dict[Node, Node] = {}
    dropped: set[Node] = set()
    for gid, (rule, kind, members) in enumerate(grouping.groups):
        if len(members) < 2 or all(view_of(m) is not None for m in members):
            continue
        members = sorted(members, key=order.__getitem__)
        fused = build_fused(graph, members, grouping.outputs(set(members)), kind, rule, grouping._gname(gid))
        replace[members[-1]] = fused
        dropped.update(members[:-1])
    nodes = [replace.get(n, n) for n in graph.nodes if n not in dropped]
    g = graph.copy()
    g.nodes = toposort(nodes, g)
    g.constants = prune_constants(g.constants, g.nodes, g.outputs)
    g.meta["fusions"] = grouping.records
    g.meta["kernels"] = kernel_count(g)
    options.stats["kernels"] = g.meta["kernels"]
    options.bump("fusions_applied", len(replace))
    return PassResult(g, bool(replace))
