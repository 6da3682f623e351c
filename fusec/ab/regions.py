"""What the A/B experiments measure: candidates, and the standalone region graph of each.

``candidates(graph, dtype)`` optimizes ``graph`` up to (not including) the fusion pass, runs the
fusion pass once to read its records, and lowers the rule-based result far enough to find the
kernel choice points. It returns one ``Candidate`` per distinct experiment:

- a *fusion* candidate for every legal record in ``graph.meta["fusions"]`` (``FusionRecord.legal``:
  correct and one kernel, applied by a default-on rule or left a candidate by an off-by-default
  one): the variants are "fused" (override True) and "unfused" (override False);
- a *kernel choice* for every alternative of every choice point (``fusec.lower.choices``):
  "unfused" is the default lowering (cuBLAS + a separate epilogue kernel), "fused" the variant.

Candidates whose regions are structurally identical (same ops, attributes, shapes, dtypes and
constant shapes; ``Region.signature``) are one experiment that ``applies_to`` all their keys:
the 12 identical QKV epilogues of GPT-2 are measured once. ``extract_region`` cuts the members
out of the pre-fusion graph with the fusion pass's own cut (``fusec.passes.subgraph``): values
read from outside become graph inputs, constants stay constants, and values read outside the
members (or model outputs) become the region's outputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any

from fusec.ir import Graph, Node, Value, verify
from fusec.ops import Op
from fusec.passes.subgraph import escaping, extract, label


class RegionError(ValueError):
    """The members named by a record are not nodes of the graph (a bug, not user input)."""


@dataclasses.dataclass
class Region:
    graph: Graph
    signature: str  # sha256 of the canonical structure (16 hex digits)
    shape: str  # one line for people: "f16[16,64] -> matmul+add+gelu -> f16[16,256]"
    cost: float  # expected effect estimate: bytes touched + FLOPs / 64 (see estimate_cost)


@dataclasses.dataclass
class Candidate:
    """One experiment: ``key`` is the candidate key (fusion) or the choice key (kernel choice)."""

    key: str
    kind: str  # "fusion" | "kernel_choice"
    rule: str  # fusion rule, or "choice:<variant>"
    members: list[str]  # member labels of the first candidate
    ops: list[str]
    layer: str | None
    region: Region
    applies_to: list[str]
    default: str  # what the rule-based compile does: "fused" | "unfused"
    variant: str = "fused"  # kernel choice: the alternative's variant name
    count: int = 1  # how many places of the model this experiment decides
    # kernel choice: the fusion candidates that must stay fused for the choice point to exist
    # (the gemm_epilogue groups it lowers); an accepted choice keeps them fused
    requires: list[str] = dataclasses.field(default_factory=list)

    @property
    def weight(self) -> float:
        """Expected effect of the decision on the whole plan (orders a budgeted run)."""
        return self.region.cost * self.count

    @property
    def overrides(self) -> tuple[dict[str, bool], dict[str, bool]]:
        """(fused, unfused) fusion overrides for compiling the region."""
        if self.kind != "fusion":
            return {}, {}
        return {self.key: True}, {self.key: False}

    @property
    def choices(self) -> tuple[dict[str, str], dict[str, str]]:
        """(fused, unfused) lowering choices for compiling the region."""
        if self.kind != "kernel_choice":
            return {}, {}
        return {self.key: self.variant}, {self.key: "cublas"}

    @property
    def name(self) -> str:
        return self.key if self.kind == "fusion" else f"{self.key}->{self.variant}"


def pre_fusion(graph: Graph, storage: str) -> Graph:
    """``graph`` after every pass that precedes fusion (the graph the fusion records name)."""
    from fusec.passes.base import PassOptions
    from fusec.passes.pipeline import PIPELINE, optimize, pass_name

    cut = [pass_name(p) for p in PIPELINE].index("fusion")
    g, _ = optimize(graph, PassOptions(storage_dtype=storage), pipeline=PIPELINE[:cut])
    return g


def extract_region(graph: Graph, labels: list[str], name: str = "region") -> Graph:
    """The members ``labels`` of ``graph`` as a standalone, verified graph: the fusion pass's cut
    (``fusec.passes.subgraph.extract``) with every constant kept a constant (see module doc)."""
    want = set(labels)
    members = [n for n in graph.nodes if label(n) in want]
    if len(members) != len(want):
        missing = want - {label(n) for n in members}
        raise RegionError(f"region members not in the graph: {sorted(missing)[:5]}")
    users = graph.users()
    outputs = escaping(members, lambda v: users.get(v, []), set(graph.outputs))
    g = extract(members, outputs, name, inline=lambda v: True).body
    verify(g)
    return g


def _canon(graph: Graph) -> str:
    """Structure without names or constant values: equal for regions that time alike."""
    ids: dict[Value, str] = {v: f"i{i}" for i, v in enumerate(graph.inputs)}
    lines = [";".join(v.type_str for v in graph.inputs)]
    for j, n in enumerate(graph.nodes):
        args = []
        for v in n.inputs:
            if v not in ids:  # a constant: its type (and a scalar's value, which changes the math)
                val = repr(v.data.reshape(-1)[0].item()) if v.data is not None and v.numel == 1 else ""
                ids[v] = f"c{v.type_str}{val}"
            args.append(ids[v])
        for k, o in enumerate(n.outputs):
            ids[o] = f"n{j}.{k}"
        lines.append(f"{n.op.value}({','.join(args)}){n.attrs!r}->{';'.join(o.type_str for o in n.outputs)}")
    lines.append("out:" + ",".join(ids[v] for v in graph.outputs))
    return "\n".join(lines)


def estimate_cost(graph: Graph) -> float:
    """Bytes every member reads and writes, plus matrix-product FLOPs / 64 (about an H100's
    FLOP:byte balance for fp16): a rough size of the work a decision can speed up or slow down."""
    total = 0.0
    for n in graph.nodes:
        total += sum(v.nbytes for v in n.inputs) + sum(v.nbytes for v in n.outputs)
        if n.op == Op.MATMUL:
            a, b = n.inputs
            total += 2.0 * math.prod(a.shape[:-1]) * a.shape[-1] * b.shape[-1] / 64
    return total


def make_region(graph: Graph, labels: list[str]) -> Region:
    g = extract_region(graph, labels)
    sig = hashlib.sha256(_canon(g).encode()).hexdigest()[:16]
    ops = "+".join(n.op.value for n in g.nodes)
    shape = f"{' '.join(v.type_str for v in g.inputs)} -> {ops} -> {' '.join(v.type_str for v in g.outputs)}"
    g.name = f"region_{sig}"
    return Region(g, sig, shape, estimate_cost(g))


def candidates(graph: Graph, storage: str, only: list[str] | None = None) -> tuple[Graph, list[Candidate]]:
    """(pre-fusion graph, experiments) for ``graph``; ``only``: keep candidates whose key, rule or
    member label is listed."""
    from fusec.lower.choices import choice_points
    from fusec.passes import fusion
    from fusec.passes.base import PassOptions
    from fusec.passes.pipeline import PIPELINE, optimize, pass_name

    pre = pre_fusion(graph, storage)
    records = fusion.records(fusion.run(pre, PassOptions(storage_dtype=storage)).graph)
    out: dict[str, Candidate] = {}
    group_key = {frozenset(r.members): r.key for r in records if r.applied}
    for r in records:
        if not r.legal:  # illegal, not one kernel, or overlapping an applied group: never applicable
            continue
        if only and not ({r.key, r.rule} & set(only) or set(r.members) & set(only)):
            continue
        region = make_region(pre, list(r.members))
        default = "fused" if r.applied else "unfused"
        sig = f"fusion:{r.rule}:{default}:{region.signature}"
        if sig in out:
            out[sig].applies_to.append(r.key)
            out[sig].count += 1
            continue
        out[sig] = Candidate(r.key, "fusion", r.rule, list(r.members), [n.op.value for n in region.graph.nodes],
                             r.layer, region, [r.key], default)
    # kernel choices: from the rule-based graph, as the compiler lowers it
    rest = PIPELINE[[pass_name(p) for p in PIPELINE].index("fusion"):]
    full, _ = optimize(pre, PassOptions(storage_dtype=storage), pipeline=rest)
    for node, cp in choice_points(full):
        body: list[Node] = node.attrs.body.nodes if node.op == Op.FUSED else [node]
        labels = [label(n) for n in body]
        if only and not ({cp.key, "choice"} & set(only) or set(labels) & set(only)):
            continue
        for variant in cp.variants[1:]:
            sig = f"choice:{cp.key}:{variant}"
            need = [group_key[frozenset(labels)]] if frozenset(labels) in group_key else []
            if sig in out:
                out[sig].count += 1
                out[sig].requires.extend(need)
                continue
            region = make_region(pre, labels)
            out[sig] = Candidate(cp.key, "kernel_choice", f"choice:{variant}", labels,
                                 [n.op.value for n in region.graph.nodes], None, region, [cp.key], "unfused", variant,
                                 requires=need)
    return pre, list(out.values())


def describe(c: Candidate) -> dict[str, Any]:
    """The ledger's description of an experiment (no timings)."""
    return {"candidate": c.name, "key": c.key, "rule": c.rule, "kind": c.kind, "members": c.members, "ops": c.ops,
            "layer": c.layer, "applies_to": list(c.applies_to), "region": {"signature": c.region.signature,
                                                                            "shape": c.region.shape},
            "variant": c.variant, "rule_default": c.default, "cost_estimate": c.region.cost, "count": c.count,
            "requires": list(c.requires)}
