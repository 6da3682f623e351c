"""Fusion rules: which nodes a rule proposes to group (by fusion kind, never by op name), the
rule-based profitability default (``decide``), and the typed record of every decision
(``FusionRecord``). Legality and the codegen's capability live in ``fusion.py``; this file only
proposes and weighs.

Kinds (``fusec.ops.FusionKind``): an *elementwise-like* node is ELEMENTWISE or BROADCAST; a
*layout* node is INJECTIVE with one input (its output index is a static function of its input
index: reshape, transpose, slice ...); any INJECTIVE node may be a *prologue* (a kernel can read
its input through it: gather, rope, concat too). GEMM nodes anchor epilogues; REDUCE nodes anchor
norms/softmax with their elementwise neighbours.

``norm_gemm``, ``gated_epilogue`` and ``gemm_sample`` propose what only the skinny-product kernel
covers (``fusec.lower.skinny``: decode's products, M <= 16): elsewhere the codegen's capability
query declines them, with its reason, and they are recorded ``legal=False``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

from fusec.ir import Node, Value
from fusec.ops import OP_INFO, FusionKind, Op

K = FusionKind


class Decision(str, enum.Enum):
    APPLIED = "applied"  # the group is one fused node, hence one kernel in the plan
    REJECTED = "rejected"  # not fused: illegal, no single kernel, overlapping, or turned off
    CANDIDATE = "candidate"  # legal and lowerable, off by default: an A/B experiment may turn it on


@dataclasses.dataclass(frozen=True)
class FusionRecord:
    """One fusion candidate and its decision. ``legal``: the group is correct (one index space, no
    cycle), does not overlap an applied group, and the codegen lowers it as one kernel, i.e. an
    A/B experiment could apply it; False for candidates that can never be applied as they stand.
    ``graph.meta["fusions"]`` holds ``to_json()`` of each record (JSON-able for reports and plans);
    ``from_json`` reads one back."""

    rule: str
    kind: FusionKind
    decision: Decision
    reason: str
    legal: bool
    members: tuple[str, ...]
    key: str
    layer: str | None = None
    name: str | None = None  # the fused node's name when applied

    @property
    def applied(self) -> bool:
        return self.decision == Decision.APPLIED

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "rule": self.rule, "kind": self.kind.name.lower(),
                "decision": self.decision.value, "legal": self.legal, "reason": self.reason,
                "members": list(self.members), "layer": self.layer}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FusionRecord:
        return cls(d["rule"], FusionKind[d["kind"].upper()], Decision(d["decision"]), d["reason"], bool(d["legal"]),
                   tuple(d["members"]), d["key"], d.get("layer"), d.get("name"))


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    default: bool  # the rule-based profitability default; A/B measurement may overturn it
    why: str  # one line: what the rule fuses, and why it is (not) on by default


RULES: dict[str, Rule] = {r.name: r for r in (
    Rule("mlp", False, "whole MLP (GEMM -> activation -> GEMM) in one kernel: candidate only; a fused MLP "
                       "ran 3-14x slower than cuBLAS + separate kernels when measured, so it must win an A/B first"),
    Rule("norm_gemm", True, "an RMSNorm as the prologue of the skinny product (M <= 16) that reads it: each "
                            "block normalizes the rows it reads, so the norm costs no launch and no round trip"),
    Rule("norm_copies", True, "a norm read by several skinny products that did not merge (packed weights in two "
                              "formats) copied into each as its prologue (passes/split_norms.py): x is normalized "
                              "twice, the norm costs no launch"),
    Rule("packed_siblings", True, "the packed products of one norm that did not merge (weights in two formats: a "
                                  "Q4_K_M file's q/k in Q4_K, its v in Q6_K) as one launch of the dp4a quantized "
                                  "GEMV: x normalized once a block, each product's tasks in blocks of their own"),
    Rule("gated_epilogue", True, "a gated unit (the product's two halves, one activated, multiplied: SwiGLU) as "
                                 "the skinny product's epilogue: a tile holds rows j of both halves"),
    Rule("gemm_sample", True, "a greedy sample of the skinny product's result: each block writes its argmax, one "
                              "small launch merges them (no separate pass over the logits)"),
    Rule("gemm_epilogue", True, "elementwise/layout consumers (bias, activation, residual, cast, output "
                                "layout) applied to the GEMM accumulator before the store"),
    Rule("gemm_prologue", True, "injective producers (head split/transposes, RoPE, slices of a merged "
                                "GEMM) read in place by the GEMM/attention kernel"),
    Rule("reduce_fusion", True, "a reduction (norm, softmax) with its elementwise prologue and epilogue "
                                "(residual add + norm writes both outputs)"),
    Rule("elementwise", True, "chains of elementwise/broadcast/injective ops as one memory-bound kernel"),
    Rule("head_rope", True, "per-head norm in front of a RoPE and the KV-cache write after it, in the RoPE's "
                            "one pass over the heads (decode: three launches per K, two per Q become one)"),
    Rule("rope_siblings", True, "RoPEs rotating heads of one product with the same cos/sin (the q and k slices "
                                "of a merged QKV GEMM), each with its head_rope norm and cache write, in one "
                                "launch whose grid covers all their heads (one launch per layer instead of two)"),
    Rule("rope_attention", True, "a head_rope group (q/k norms and RoPEs, the K/V cache writes) as the prologue of "
                                 "the decode attention reading its q and caches: each block makes its q rows and the "
                                 "new cache rows it reads (one launch per layer instead of two)"),
)}


def decide(rule: str, disabled: frozenset[str], enabled: frozenset[str], overrides: dict[str, bool],
           key: str) -> tuple[Decision, str]:
    """Profitability of a legal, lowerable candidate of ``rule``: (decision, reason). A per-candidate
    override (``overrides[key]``, from an A/B ledger) wins over the rule flags and the default."""
    if key in overrides:
        return (Decision.APPLIED, "A/B decision: fused") if overrides[key] else (Decision.REJECTED, "A/B decision: unfused")
    if rule in disabled:
        return Decision.REJECTED, "disabled by option"
    if rule in enabled:
        return Decision.APPLIED, "enabled by option"
    r = RULES[rule]
    return (Decision.APPLIED, "default on: " + r.why) if r.default else (Decision.CANDIDATE, "off by default: " + r.why)


def kind(n: Node) -> FusionKind:
    return OP_INFO[n.op].kind


def elementwise_like(n: Node) -> bool:
    return kind(n) in (K.ELEMENTWISE, K.BROADCAST)


def layout(n: Node) -> bool:
    return kind(n) == K.INJECTIVE and len(n.inputs) == 1


def is_norm(n: Node) -> bool:
    """A REDUCE-kind op that keeps its input's shape (norms, softmax), as opposed to a reduction."""
    return kind(n) == K.REDUCE and len(n.outputs) == 1 and n.outputs[0].shape == n.inputs[0].shape


class View:
    """What the rules may ask about the graph while groups are being formed."""

    def __init__(self, users: Callable[[Value], list[Node]], prod: Callable[[Value], Node | None],
                 is_output: Callable[[Value], bool], owned: Callable[[Node], bool]):
        self.users, self.prod, self.is_output, self.owned = users, prod, is_output, owned

    def sole_reader(self, v: Value) -> Node | None:
        us = self.users(v)
        return us[0] if len(us) == 1 and not self.is_output(v) else None

    def only_read_by(self, v: Value, members: set[Node]) -> bool:
        return not self.is_output(v) and all(u in members for u in self.users(v))


def epilogue(view: View, anchor: Node) -> list[Node]:
    """The chain of elementwise-like/layout sole readers after ``anchor`` with the anchor's element
    count: each step reads the previous result and nothing else derived from the anchor."""
    chain: list[Node] = []
    cur = anchor.outputs[0]
    while True:
        u = view.sole_reader(cur)
        if u is None or view.owned(u) or not (elementwise_like(u) or layout(u)) or len(u.outputs) != 1:
            return chain
        if u.outputs[0].numel != anchor.outputs[0].numel:
            return chain
        chain.append(u)
        cur = u.outputs[0]


def prologue(view: View, anchor: Node, accept: Callable[[Node], bool], members: set[Node]) -> list[Node]:
    """Producers of ``anchor``'s (non-constant) inputs, transitively, that ``accept`` allows and whose
    outputs only the group reads."""
    taken: list[Node] = []
    group = set(members) | {anchor}
    stack = [v for v in anchor.inputs if v.data is None]
    while stack:
        v = stack.pop()
        p = view.prod(v)
        if p is None or p in group or view.owned(p) or not accept(p):
            continue
        if not all(view.only_read_by(o, group) for o in p.outputs):
            continue
        group.add(p)
        taken.append(p)
        stack.extend(x for x in p.inputs if x.data is None)
    return taken


def head_rope(view: View, rope: Node) -> list[Node]:
    """Around a multi-input INJECTIVE node (RoPE reads x, cos, sin): the layout chain in front of its
    first input and the row norm (a REDUCE keeping its shape) that chain starts from, if only the
    chain reads it; after it, its layout chain and a sole reader that writes the result into its
    own first input's storage (an OPAQUE node reading the chain as its second input: a KV-cache
    write). Whether one kernel covers the group is the codegen's to say."""
    if kind(rope) != K.INJECTIVE or len(rope.inputs) < 2 or len(rope.outputs) != 1:
        return []
    before: list[Node] = []
    v = rope.inputs[0]
    while True:
        p = view.prod(v)
        if p is None or view.owned(p) or view.sole_reader(p.outputs[0]) is None or len(p.outputs) != 1:
            break
        if layout(p):
            before.append(p)
            v = p.inputs[0]
            continue
        if is_norm(p) and len(p.inputs) >= 1:
            before.append(p)
            # the norm's own layout chain (a slice of a merged QKV product, the head reshape): the
            # kernel reads x through it, so the slice is never copied out
            v = p.inputs[0]
            while (q := view.prod(v)) is not None and layout(q) and not view.owned(q) and len(q.outputs) == 1 \
                    and view.sole_reader(q.outputs[0]) is not None:
                before.append(q)
                v = q.inputs[0]
        break
    if not any(is_norm(n) for n in before):
        before = []  # layout views alone are the rope kernel's own prologue
    after: list[Node] = []
    cur = rope.outputs[0]
    while True:
        u = view.sole_reader(cur)
        if u is None or view.owned(u) or len(u.outputs) != 1:
            break
        if layout(u):
            after.append(u)
            cur = u.outputs[0]
            continue
        if kind(u) == K.OPAQUE and len(u.inputs) >= 2 and u.inputs[1] is cur and u.inputs[0] is not cur:
            after.append(u)
        break
    if not after or kind(after[-1]) != K.OPAQUE:
        after = []
    return before + after


def input_views(view: View, rope: Node) -> list[Node]:
    """The layout chain in front of a multi-input INJECTIVE node's first input, each link read only
    by the next (the slice and head transpose a RoPE reads a merged QKV product through)."""
    chain: list[Node] = []
    v = rope.inputs[0]
    while (p := view.prod(v)) is not None and layout(p) and not view.owned(p) and view.sole_reader(v) is not None:
        chain.append(p)
        v = p.inputs[0]
    return chain


def side_writes(view: View, rope: Node) -> list[Node]:
    """OPAQUE readers of ``rope``'s result that write it (their second input) into their own
    first input's storage (a KV-cache write) while something else reads the result too (prefill:
    attention reads K, the cache keeps it): a kernel can store the rows twice."""
    cur = rope.outputs[0]
    return [u for u in view.users(cur) if kind(u) == K.OPAQUE and not view.owned(u) and len(u.outputs) == 1
            and len(u.inputs) >= 2 and u.inputs[1] is cur and u.inputs[0] is not cur]


def attention_reader(view: View, outputs: list[Value]) -> list[Node]:
    """The OPAQUE node that alone reads a head_rope group's rotated rows not kept in a cache (q; a
    graph output has no sole reader) and also reads another output of the group (a cache it writes):
    the decode attention, whose prologue the group can be (``rope_attention``)."""
    for o in outputs:
        a = view.sole_reader(o)
        if a is not None and kind(a) == K.OPAQUE and not view.owned(a) and len(a.outputs) == 1 \
                and any(x in a.inputs for x in outputs if x is not o):
            return [a]
    return []


def cache_copies(view: View, nodes: list[Node]) -> dict[tuple[Value, Value], list[Node]]:
    """Cache writes (OPAQUE nodes storing their second input into their first input's storage at
    the positions of their third) of heads that are not rotated: {(source, positions): the layout
    chain and the write}, where source is found as ``sibling_key`` finds it (``projection_source`` of
    the value the layout chain starts from). A head_rope
    launch over the same source and positions can copy these rows too (the V heads of a QKV product)."""
    out: dict[tuple[Value, Value], list[Node]] = {}
    for w in nodes:
        if kind(w) != K.OPAQUE or len(w.inputs) != 3 or len(w.outputs) != 1 or view.owned(w) \
                or w.inputs[0].shape != w.outputs[0].shape or w.inputs[1] is w.inputs[0]:
            continue
        chain: list[Node] = []
        v = w.inputs[1]
        while (p := view.prod(v)) is not None and layout(p) and not view.owned(p) and view.sole_reader(v) is not None:
            chain.append(p)
            v = p.inputs[0]
        if not chain or view.sole_reader(w.inputs[1]) is not w:
            continue
        out.setdefault((projection_source(view, v), w.inputs[2]), []).extend(chain[::-1] + [w])
    return out


def sibling_key(view: View, rope: Node, members: list[Node]) -> tuple[Value, ...]:
    """What RoPE siblings share: the value ``rope`` reads its rotated input from (its first input
    followed back through ``members``, its own norm and layout views, then ``projection_source``) and its
    other inputs (cos, sin).
    RoPEs with one key rotate heads of one product (a merged QKV GEMM), or of projections of one
    activation (separate q and kv GEMMs), at the same positions: one launch can cover them all
    (``rope_siblings``)."""
    inside = set(members)
    v = rope.inputs[0]
    while (p := view.prod(v)) is not None and p in inside:
        v = p.inputs[0]
    return (projection_source(view, v), *rope.inputs[1:])


def projection_source(view: View, v: Value) -> Value:
    """Where ``v`` is a projection's result (a GEMM whose other operands are constants: weights, packed
    weights, a bias), the activation it projects, followed back through a norm with constant weights (the
    copies of one norm that ``split_norms`` gives each product read the same activation); else ``v``."""
    p = view.prod(v)
    if p is None or kind(p) != K.GEMM or not p.inputs[1:] or any(w.data is None for w in p.inputs[1:]):
        return v
    v = p.inputs[0]
    n = view.prod(v)
    if n is not None and is_norm(n) and n.inputs[1:] and all(w.data is not None for w in n.inputs[1:]):
        v = n.inputs[0]
    return v


def norm_prologue(view: View, gemm: Node) -> list[Node]:
    """The norm (a REDUCE keeping its shape) whose result is the product's first operand and read
    by nothing else."""
    p = view.prod(gemm.inputs[0])
    if p is None or view.owned(p) or not is_norm(p) or view.sole_reader(gemm.inputs[0]) is not gemm:
        return []
    return [p]


def packed_siblings(view: View, norm: Node) -> list[Node]:
    """The norm and its readers where every reader is a packed product (QMATMUL) reading it as x, at least two:
    products of one activation that ``merge_gemms`` could not merge (their formats differ); else []."""
    if not is_norm(norm) or view.owned(norm) or view.is_output(norm.outputs[0]):
        return []
    readers = view.users(norm.outputs[0])
    if len(readers) < 2 or len(set(readers)) != len(readers) or any(
            r.op != Op.QMATMUL or view.owned(r) or r.inputs[0] is not norm.outputs[0]
            or norm.outputs[0] in r.inputs[1:] for r in readers):
        return []
    return [norm, *readers]


def gated(view: View, gemm: Node, limit: int = 8) -> list[Node]:
    """The elementwise/layout nodes after ``gemm`` reached from its result whose own results are read
    only among them, up to one value leaving them (a gated unit: two slices, an activation, a
    product); [] when that is not so within ``limit`` nodes."""
    first = view.users(gemm.outputs[0])
    if len(first) < 2 or not all(kind(u) == K.INJECTIVE and len(u.inputs) == 1 for u in first):
        return []  # a gated unit reads the product through (at least) two slices
    taken: list[Node] = []
    inside: set[Node] = {gemm}
    frontier = [gemm.outputs[0]]
    while frontier:
        v = frontier.pop()
        for u in view.users(v):
            if u in inside:
                continue
            if view.owned(u) or not (elementwise_like(u) or kind(u) == K.INJECTIVE) or len(u.outputs) != 1:
                continue  # a reader of ``v`` outside: ``v`` leaves the group (counted below)
            inside.add(u)
            taken.append(u)
            frontier.append(u.outputs[0])
            if len(taken) > limit:
                return []
    leaving = [n for n in taken if view.is_output(n.outputs[0]) or any(x not in inside for x in view.users(n.outputs[0]))]
    return taken if len(taken) >= 2 and len(leaving) == 1 else []


def sample_after(view: View, gemm: Node, chain: list[Node]) -> list[Node]:
    """An OPAQUE sole reader of the product's result (after its epilogue ``chain``): a sampler."""
    cur = (chain[-1] if chain else gemm).outputs[0]
    u = view.sole_reader(cur)
    if u is None or view.owned(u) or kind(u) != K.OPAQUE or len(u.outputs) != 1 or u.inputs[0] is not cur:
        return []
    return [u]


def mlp_candidate(view: View, m2: Node) -> list[Node] | None:
    """GEMM m1 -> elementwise/injective nodes -> GEMM m2 (both with constant weights): the members
    from m1 to m2, or None. Everything between must be read only inside the candidate."""
    if kind(m2) != K.GEMM or len(m2.inputs) != 2 or m2.inputs[1].data is None:
        return None
    between: list[Node] = []
    gemms: list[Node] = []
    seen: set[Node] = {m2}
    stack = [m2.inputs[0]]
    while stack:
        v = stack.pop()
        p = view.prod(v)
        if p is None:
            if v.data is None:
                return None  # reaches a graph input: not an MLP body
            continue
        if p in seen:
            continue
        seen.add(p)
        if kind(p) == K.GEMM:
            gemms.append(p)
            continue
        if not (elementwise_like(p) or kind(p) == K.INJECTIVE):
            return None
        between.append(p)
        stack.extend(p.inputs)
    if len(gemms) != 1 or not between or gemms[0].inputs[1].data is None:
        return None
    members = set(between) | set(gemms) | {m2}
    for n in between + gemms:
        if not all(view.only_read_by(o, members) for o in n.outputs):
            return None
    return gemms + between + [m2]
