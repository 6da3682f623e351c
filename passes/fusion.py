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
How a group is checked, grown and recorded is ``passes/fusion_groups.py``; this module holds the proposals.
Every candidate and its decision is a ``FusionRecord`` in ``graph.meta["fusions"]`` (as JSON);
``graph.meta["kernels"]`` counts the launches of the result (every node except zero-copy views,
a FUSED node being one).
"""

from __future__ import annotations

import sys

from fusec.ir import Graph, Node, Value, verify
from fusec.ops import FusedAttrs, Op
from fusec.passes import fusion_rules as R
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.fusion_groups import Groups, candidate_key, group_name, pointwise_or_injective, target_meta
from fusec.passes.fusion_rules import Decision, FusionRecord
from fusec.passes.match import prune_constants, toposort
from fusec.passes.subgraph import extract
from fusec.passes.views import view_of

__all__ = ["candidate_key", "describe_kernels", "kernel_count", "records", "run", "target_meta"]

NAME = "fusion"
# An elementwise group is first grown whole (legal only), then asked once whether it is one kernel. Each step of that
# growth checks the whole group, so a group of n nodes costs O(n^2): a chain of 10,000 Relus took ~200 s to compile
# (forty-sixth session, CPU). At this many nodes the whole group is declined unasked and grown node by node (each
# node joining while the group stays one kernel), as any group the codegen declines is; no elementwise kernel
# computes more than MAX_EXPR_DEPTH (200) ops in a row, and groups of real models are tens of nodes.
WHOLE_GROUP_MAX = 1024


class _Grouping(Groups):
    """The rules' proposals, in the order the module docstring gives, over ``Groups``' mechanics."""

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
                pro = R.prologue(self.view, n, pointwise_or_injective, set())
                pro += self.multi_output_prologue(n, pro)
                self.propose_anchor(n, R.K.REDUCE, [("reduce_fusion", pro + R.epilogue(self.view, n), True)])
        for n in nodes:
            if n not in self.owner and pointwise_or_injective(n) and view_of(n) is None:
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
                    more = R.prologue(self.view, p, pointwise_or_injective, group)
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
            members = self.grow(seed, capable=False, most=WHOLE_GROUP_MAX)
            if _launches(members) < 2:
                return
            why = (f"{WHOLE_GROUP_MAX} nodes or more, grown node by node" if len(members) == WHOLE_GROUP_MAX
                   else self.lowerable(members))
            if why is not None:
                self.record("elementwise", kind, members, Decision.REJECTED, "not one kernel: " + why, legal=False)
                self.not_one_kernel.update(members)
                start = next((m for m in self.sorted(members) if not R.layout(m)), seed)
                members = self.grow(start, capable=True)
        if _launches(members) >= 2:
            self.propose("elementwise", kind, members, multi_output=True)

    def grow(self, seed: Node, capable: bool, most: int = sys.maxsize) -> list[Node]:
        """The group grown from ``seed`` over its producers, users and pointwise siblings, each joining if the group
        stays legal (and, ``capable``, one kernel), up to ``most`` members."""
        members, inside, frontier = [seed], {seed}, [seed]
        while frontier and len(members) < most:
            n = frontier.pop()
            # producers, users, and pointwise siblings through a computed input: independent pointwise ops reading it
            # in one launch (horizontal; layout ops stay with their chains)
            near = [self.ctx.prod(v) for v in n.inputs] + [u for v in n.outputs for u in self.ctx.users(v)]
            if R.elementwise_like(n):
                near += [u for v in n.inputs if self.ctx.prod(v) is not None for u in self.ctx.users(v)
                         if R.elementwise_like(u)]
            for m in near:
                if len(members) == most:
                    break
                if m is None or m in inside or m in self.owner or not pointwise_or_injective(m):
                    continue
                if self.check(inside | {m}, multi_output=True, capable=capable) is None:
                    inside.add(m)
                    members.append(m)
                    frontier.append(m)
        return members


def _injective(n: Node) -> bool:
    return R.kind(n) == R.K.INJECTIVE


def _launches(members: list[Node]) -> int:
    return sum(1 for m in members if view_of(m) is None)


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
        cut = extract(members, outputs, group_name(gid))
        cut.body.meta.update(target_meta(options))
        verify(cut.body)
        rule = "+".join(group.rules)
        replace[members[-1]] = Node(Op.FUSED, cut.reads, outputs, FusedAttrs(group.kind, rule, cut.body), group_name(gid))
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
