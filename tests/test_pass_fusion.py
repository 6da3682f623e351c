"""fusion: groups by fusion kind, legality apart from profitability, the codegen's capability
asked while groups form (a declined node is recorded with the codegen's reason), typed records,
FUSED numerics."""

from __future__ import annotations

import json

import numpy as np

from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph, Value, print_graph, verify
from fusec.ops import FusionKind, Op
from fusec.passes import fusion
from fusec.passes.base import PassOptions

RNG = np.random.default_rng(20261123)
F = DType.F32


def _run(g: Graph, **kw) -> tuple[Graph, PassOptions]:  # type: ignore[no-untyped-def]
    opts = PassOptions(**kw)
    out = fusion.run(g, opts).graph
    verify(out)
    json.dumps(out.meta["fusions"])  # records are JSON-able
    return out, opts


def _same(g0: Graph, g1: Graph) -> None:
    inputs = {v.name: RNG.standard_normal(v.shape).astype(v.dtype.np) for v in g0.inputs}
    r0, r1 = reference.run(g0, inputs), reference.run(g1, inputs)
    for k in r0:
        np.testing.assert_allclose(r1[k], r0[k], rtol=1e-5, atol=1e-5)


def _w(b: GraphBuilder, *shape: int, dt: DType = F) -> Value:
    return b.const(RNG.standard_normal(shape).astype(dt.np), name="w")


def _fused(g: Graph) -> list:  # type: ignore[type-arg]
    return [n for n in g.nodes if n.op == Op.FUSED]


def _body_ops(n) -> list[Op]:  # type: ignore[no-untyped-def]
    return [m.op for m in n.attrs.body.nodes]


def _block(residual_reads: int = 1, dt: DType = F) -> Graph:
    """GPT-2 MLP block: LN -> GEMM+bias+GELU -> GEMM+bias+residual (h read again downstream)."""
    b = GraphBuilder("block")
    x = b.input("x", (2, 4, 16), dt)
    h = b.emit(Op.LAYERNORM, x, _w(b, 16, dt=dt), _w(b, 16, dt=dt), axis=2, eps=1e-5)
    u = b.emit(Op.GELU, b.emit(Op.ADD, b.emit(Op.MATMUL, h, _w(b, 16, 32, dt=dt)), _w(b, 32, dt=dt)), approximate="tanh")
    d = b.emit(Op.ADD, b.emit(Op.ADD, b.emit(Op.MATMUL, u, _w(b, 32, 16, dt=dt)), _w(b, 16, dt=dt)), x)
    b.output(b.emit(Op.LAYERNORM, d, _w(b, 16, dt=dt), axis=2, eps=1e-5), "y")
    for i in range(residual_reads - 1):
        b.output(b.emit(Op.NEG, d), f"extra{i}")
    return b.build()


def test_gemm_epilogues_and_kernel_count() -> None:
    g = _block()
    out, opts = _run(g)
    groups = _fused(out)
    assert [_body_ops(n) for n in groups] == [[Op.MATMUL, Op.ADD, Op.GELU], [Op.MATMUL, Op.ADD, Op.ADD]]
    assert all(n.attrs.rule == "gemm_epilogue" and n.attrs.kind == FusionKind.GEMM for n in groups)
    # LN, GEMM(+bias+GELU), GEMM(+bias+residual), LN
    assert out.meta["kernels"] == 4 == opts.stats["kernels"]
    assert "= fused[kind=gemm, rule=gemm_epilogue, body=<3 nodes>]" in print_graph(out)
    _same(g, out)


def test_residual_sum_read_twice_ends_the_epilogue_and_joins_the_norm_as_second_output() -> None:
    b = GraphBuilder()
    x = b.input("x", (3, 8), F)
    y = b.input("y", (3, 8), F)
    h = b.emit(Op.ADD, x, b.emit(Op.EXP, y))
    b.output(b.emit(Op.LAYERNORM, h, _w(b, 8), axis=1, eps=1e-5), "n")
    b.output(h, "h")  # the residual stream goes on
    g = b.build()
    out, _ = _run(g)
    (node,) = _fused(out)  # the row kernel takes add -> norm; the exp in front is declined, with why
    assert node.attrs.rule == "reduce_fusion" and _body_ops(node) == [Op.ADD, Op.LAYERNORM]
    assert [v.name for v in node.outputs] == ["h", "n"]
    (no,) = [r for r in fusion.records(out) if not r.legal]
    assert no.rule == "reduce_fusion" and no.reason.startswith("not one kernel: ") and len(no.members) == 2
    _same(g, out)


def test_elementwise_chain_is_one_kernel_and_views_are_free() -> None:
    b = GraphBuilder()
    x = b.input("x", (4, 6), F)
    e = b.emit(Op.EXP, b.emit(Op.RESHAPE, x, shape=(6, 4)))
    b.output(b.emit(Op.ADD, b.emit(Op.MUL, e, b.scalar(2.0, F)), b.scalar(1.0, F)), "y")
    g = b.build()
    out, _ = _run(g)
    (node,) = _fused(out)
    assert node.attrs.rule == "elementwise" and out.meta["kernels"] == 1
    assert len(node.inputs) == 1 and len(node.attrs.body.constants) == 2  # scalars live in the body
    _same(g, out)


def test_legality_rejects_cycles_and_unwanted_extra_outputs() -> None:
    b = GraphBuilder()
    x = b.input("x", (4, 4), F)
    a = b.emit(Op.EXP, x)
    m = b.emit(Op.MATMUL, a, _w(b, 4, 4))
    b.output(b.emit(Op.ADD, a, m), "y")
    g = b.build()
    grouping = fusion._Grouping(g, PassOptions())
    exp_node, _, add_node = g.nodes
    assert "cycle" in (grouping.legal({exp_node, add_node}, multi_output=True) or "")
    assert grouping.legal({exp_node}, multi_output=False) is None
    assert "read outside" in (grouping.legal({exp_node, g.nodes[1]}, multi_output=False) or "")
    out, _ = _run(g)
    _same(g, out)


def test_disabled_rule_is_recorded_and_its_nodes_fall_back() -> None:
    g = _block()
    out, _ = _run(g, disabled_fusions=frozenset({"gemm_epilogue"}))
    recs = [r for r in out.meta["fusions"] if r["rule"] == "gemm_epilogue"]
    assert recs and all(r["decision"] == "rejected" and r["reason"] == "disabled by option" for r in recs)
    assert all("matmul" not in [o.value for o in _body_ops(n)] for n in _fused(out))
    assert out.meta["kernels"] > 4
    _same(g, out)


def test_candidate_only_rules_the_codegen_cannot_emit_are_declined_even_when_enabled() -> None:
    g = _block()  # fp32: the fused MLP's kernel runs fp16/bf16 products only
    out, _ = _run(g)
    (rec,) = [r for r in fusion.records(out) if r.rule == "mlp"]
    assert rec.decision == "rejected" and not rec.legal and len(rec.members) >= 5
    assert rec.reason.startswith("not one kernel: the fused MLP runs fp16/bf16")
    for rule in ("mlp", "norm_gemm"):
        on, _ = _run(g, enabled_fusions=frozenset({rule}))
        assert not any(n.attrs.rule.startswith(rule) for n in _fused(on))
        assert [_body_ops(n) for n in _fused(on)] == [_body_ops(n) for n in _fused(out)]  # the rest as by default
        _same(g, on)


def test_mlp_candidate_is_legal_off_by_default_and_applied_when_enabled() -> None:
    """fp16: the whole MLP (GEMM+bias+GELU -> GEMM+bias+residual) is one kernel the codegen emits
    (fusec.lower.mlp): a legal candidate, off by default; enabled, it is one fused node with both
    products, whose reference computes what the unfused graph computes."""
    g = _block(dt=DType.F16)
    out, _ = _run(g)
    (rec,) = [r for r in fusion.records(out) if r.rule == "mlp"]
    assert rec.decision == "candidate" and rec.legal and len(rec.members) == 6, rec
    assert not any(n.attrs.rule.startswith("mlp") for n in _fused(out))
    on, _ = _run(g, enabled_fusions=frozenset({"mlp"}))
    (mlp,) = [n for n in _fused(on) if n.attrs.rule == "mlp"]
    assert _body_ops(mlp) == [Op.MATMUL, Op.ADD, Op.GELU, Op.MATMUL, Op.ADD, Op.ADD]
    assert on.meta["kernels"] == out.meta["kernels"] - 1  # two GEMM+epilogue kernels become one
    inputs = {v.name: RNG.standard_normal(v.shape).astype(v.dtype.np) for v in g.inputs}
    r0, r1 = reference.run(out, inputs), reference.run(on, inputs)
    assert all(np.array_equal(r0[k], r1[k]) for k in r0)  # the same nodes, stored in the same dtype


def test_attention_group_takes_head_layouts() -> None:
    b = GraphBuilder("attn")
    x = b.input("x", (2, 5, 16), F)
    qkv = b.emit(Op.ADD, b.emit(Op.MATMUL, x, _w(b, 16, 48)), _w(b, 48))
    heads = []
    for i in range(3):
        s = b.emit(Op.SLICE, qkv, axes=(2,), starts=(16 * i,), ends=(16 * i + 16,), steps=(1,))
        heads.append(b.emit(Op.TRANSPOSE, b.emit(Op.RESHAPE, s, shape=(2, 5, 4, 4)), perm=(0, 2, 1, 3)))
    a = b.emit(Op.ATTENTION, *heads, scale=0.5, causal=True)
    a = b.emit(Op.RESHAPE, b.emit(Op.TRANSPOSE, a, perm=(0, 2, 1, 3)), shape=(2, 5, 16))
    b.output(b.emit(Op.ADD, b.emit(Op.MATMUL, a, _w(b, 16, 16)), x), "y")
    g = b.build()
    out, _ = _run(g)
    assert out.meta["kernels"] == 3  # QKV GEMM+bias, attention (+layouts), out-proj GEMM+residual
    att = next(n for n in _fused(out) if Op.ATTENTION in _body_ops(n))
    assert att.attrs.rule == "gemm_prologue+gemm_epilogue" and _body_ops(att).count(Op.SLICE) == 3
    _same(g, out)


def test_attention_prologue_declines_rope_with_the_codegens_reason_and_rope_keeps_its_views() -> None:
    """The attention kernel reads q/k/v through layout views only: the prologue's RoPE nodes are
    declined at fusion time (recorded, not legal), and each RoPE forms its own one-kernel group
    with the views in front of it. Every applied record is part of a fused node that lowers."""
    from fusec.lower.fused_plan import can_fuse

    b = GraphBuilder("rope_attn")
    x = b.input("x", (1, 6, 32), F)
    qkv = b.emit(Op.MATMUL, x, _w(b, 32, 96))
    cos = b.const(RNG.standard_normal((6, 8)).astype(np.float32), name="cos")
    sin = b.const(RNG.standard_normal((6, 8)).astype(np.float32), name="sin")
    heads = []
    for i in range(3):
        s = b.emit(Op.SLICE, qkv, axes=(2,), starts=(32 * i,), ends=(32 * i + 32,), steps=(1,))
        h = b.emit(Op.TRANSPOSE, b.emit(Op.RESHAPE, s, shape=(1, 6, 4, 8)), perm=(0, 2, 1, 3))
        heads.append(b.emit(Op.ROPE, h, cos, sin, rotary_dim=8) if i < 2 else h)
    a = b.emit(Op.ATTENTION, *heads, scale=0.35, causal=True)
    b.output(b.emit(Op.RESHAPE, b.emit(Op.TRANSPOSE, a, perm=(0, 2, 1, 3)), shape=(1, 6, 32)), "y")
    g = b.build()
    out, _ = _run(g)
    groups = _fused(out)
    att = next(n for n in groups if Op.ATTENTION in _body_ops(n))
    assert Op.ROPE not in _body_ops(att) and _body_ops(att).count(Op.SLICE) == 1  # v's views only
    ropes = [n for n in groups if Op.ROPE in _body_ops(n)]
    assert len(ropes) == 2 and all(_body_ops(n)[-1] == Op.ROPE and Op.SLICE in _body_ops(n) for n in ropes)
    declined = [r for r in fusion.records(out) if r.rule == "gemm_prologue" and not r.legal]
    assert len(declined) == 2 and all("through rope" in r.reason for r in declined)
    assert all(can_fuse(n.attrs.body) for n in groups)
    assert {r.name for r in fusion.records(out) if r.applied} == {n.name for n in groups}
    _same(g, out)


def test_elementwise_group_the_codegen_cannot_emit_is_declined_and_regrown_in_parts() -> None:
    b = GraphBuilder()
    x = b.input("x", (4, 8), F)
    r = b.emit(Op.RESHAPE, b.emit(Op.EXP, x), shape=(8, 4))  # regroups axes: no elementwise index map
    b.output(b.emit(Op.ABS, b.emit(Op.NEG, b.emit(Op.SIGMOID, r))), "y")
    g = b.build()
    out, _ = _run(g)
    whole = [r for r in fusion.records(out) if r.rule == "elementwise" and not r.legal]
    assert len(whole) == 1 and "regroups axes" in whole[0].reason and len(whole[0].members) == 5
    (node,) = _fused(out)
    assert _body_ops(node) == [Op.SIGMOID, Op.NEG, Op.ABS]
    assert [n.op for n in out.nodes] == [Op.EXP, Op.RESHAPE, Op.FUSED]
    _same(g, out)


def test_a_group_past_the_whole_group_limit_is_regrown_as_a_declined_one_is(monkeypatch) -> None:
    """An elementwise group grown past WHOLE_GROUP_MAX nodes is declined without asking the codegen (asking costs the
    whole group at every node it grows by) and regrown node by node: for a chain too deep for one kernel anyway, the
    same kernels as when the codegen declines it."""
    from fusec.lower.fused_plan import MAX_EXPR_DEPTH

    b = GraphBuilder()
    v = b.input("x", (4, 8), F)
    for i in range(fusion.WHOLE_GROUP_MAX + 100):
        v = b.emit(Op.NEG if i % 2 else Op.TANH, v)
    b.output(v, "y")
    g = b.build()
    out, _ = _run(g)
    whole = [r for r in fusion.records(out) if r.rule == "elementwise" and not r.legal]
    assert len(whole) == 1 and whole[0].reason == f"not one kernel: {fusion.WHOLE_GROUP_MAX} nodes or more, grown " \
        "node by node" and len(whole[0].members) == fusion.WHOLE_GROUP_MAX
    fused = _fused(out)
    assert all(len(n.attrs.body.nodes) <= MAX_EXPR_DEPTH for n in fused)
    assert sum(len(n.attrs.body.nodes) for n in fused) == len(g.nodes)  # every node in a kernel
    monkeypatch.setattr(fusion, "WHOLE_GROUP_MAX", 10 ** 9)  # the codegen asked, and declining it
    asked, _ = _run(g)
    (why,) = [r for r in fusion.records(asked) if r.rule == "elementwise" and not r.legal]
    assert "ops in a row" in why.reason
    assert [_body_ops(n) for n in _fused(asked)] == [_body_ops(n) for n in fused]
    _same(g, out)


def test_independent_pointwise_ops_on_one_value_are_one_multi_output_kernel() -> None:
    """Pointwise siblings (ops reading one computed value, neither feeding the other) join one group, each result
    an output of it: one launch, the shared value read once. The kernel plan covers them over one index space."""
    from fusec.lower.fused_plan import kernel_plan

    b = GraphBuilder("siblings")
    x = b.input("x", (3, 8), F)
    t = b.emit(Op.EXP, x)
    b.output(b.emit(Op.NEG, t), "a")
    b.output(b.emit(Op.MUL, t, b.scalar(2.0, F)), "c")
    b.output(b.emit(Op.GREATER, t, b.scalar(1.5, F)), "d")  # a bool output beside the floats
    g = b.build()
    out, _ = _run(g)
    (node,) = _fused(out)
    assert sorted(v.name for v in node.outputs) == ["a", "c", "d"] and len(out.nodes) == 1
    family, plan = kernel_plan(node.attrs.body)
    assert family == "elementwise" and len(plan.more) == 2 and len(plan.operands) == 1  # x, read once
    _same(g, out)


def test_multi_output_group_is_not_hoisted_past_a_read_of_the_state_it_updates() -> None:
    """A multi-output group runs before the first reader of any of its outputs. It may not take a state's new value
    where a node outside it reads the old value after that point (the update would then be copied back after the
    run instead of written in place after the last read)."""
    b = GraphBuilder("state_hoist")
    x = b.input("x", (4,), F)
    pos = b.state("pos", (4,), F)
    t = b.emit(Op.EXP, x)
    early = b.emit(Op.NEG, t)  # read by the product, long before the state's update
    y = b.emit(Op.MATMUL, b.emit(Op.RESHAPE, early, shape=(1, 4)), _w(b, 4, 4))
    b.output(b.emit(Op.ADD, b.emit(Op.RESHAPE, y, shape=(4,)), pos), "z")  # the old pos, read after the product
    new = b.emit(Op.ADD, t, pos)  # a pointwise sibling of `early` through t: pos's new value
    b.update(pos, new)
    g = b.build()
    out, _ = _run(g)
    holder = {v.name: n for n in out.nodes for v in n.outputs}[new.name]
    assert holder.op != Op.FUSED or Op.NEG not in _body_ops(holder)
    _same(g, out)
    # without the later read of the old value, the sibling joins the group (one launch for both)
    b = GraphBuilder("state_hoist_ok")
    x = b.input("x", (4,), F)
    pos = b.state("pos", (4,), F)
    t = b.emit(Op.EXP, x)
    early = b.emit(Op.NEG, t)
    b.output(b.emit(Op.MATMUL, b.emit(Op.RESHAPE, early, shape=(1, 4)), _w(b, 4, 4)), "y")
    new = b.emit(Op.ADD, t, pos)
    b.update(pos, new)
    g = b.build()
    out, _ = _run(g)
    holder = {v.name: n for n in out.nodes for v in n.outputs}[new.name]
    assert holder.op == Op.FUSED and Op.NEG in _body_ops(holder)
    _same(g, out)


def test_a_generation_plans_state_updates_stay_in_place_with_multi_output_groups() -> None:
    """The bookkeeping at the end of a prefill and a decode step (the new position, the current token, the done flags)
    is one multi-output elementwise kernel that writes each state's new value over the old one: no copy into a state
    after the run (the memory plan's in-place rule reads the group's recorded kernel plan), and no more than one such
    group a plan entry beside the prefill's start."""
    from fusec.compiler import compile_generation

    for batch in (1, 3):
        plan = compile_generation("qwen3-tiny", batch=batch, max_seq_len=48, prefill_len=16, dtype="bf16",
                                  arch="sm_90", eos_ids=[])
        for entry, v in plan.manifest["entries"].items():
            labels = [L.get("label", "") for L in v["launches"]]
            assert not [x for x in labels if "<- update" in x], (batch, entry, labels)
            groups = sum("fused[elementwise]" in x for x in labels)
            assert 1 <= groups <= (2 if entry == "prefill" else 1), (batch, entry, labels)
