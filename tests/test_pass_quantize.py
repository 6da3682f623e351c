"""passes/quantize.py (``--quantize int8|int4``) and how the layout passes treat QMATMUL:
merge_gemms stacks packed q/k/v and gate/up along N, pad_gemm and transpose_cache leave packed
weights alone, precision keeps the packed operands' dtypes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.loader import load_graph
from fusec.models.registry import get_config
from fusec.ops import Op
from fusec.passes.base import PassOptions
from fusec.passes.pipeline import optimize
from fusec.quant_gguf import random_blocks, repack


def _count(g, op) -> int:
    """Nodes of ``op``, inside fused bodies too."""
    return sum(_count(n.attrs.body, op) if n.op == Op.FUSED else n.op == op for n in g.nodes)


def _inputs(g):
    rng = np.random.default_rng(0)
    return {v.name: (np.ones(v.shape, np.int64) if v.name == "attention_mask" else rng.integers(0, 100, v.shape))
            for v in g.inputs}


@pytest.mark.parametrize("method,group,tol", [("int8", 128, 0.02), ("int4", 32, 0.15)])
def test_quantize_llama_tiny(method, group, tol):
    g = load_graph("llama-tiny", None)
    feeds = _inputs(g)
    ref = reference.run(g, feeds)["logits"]
    opts = PassOptions(quantize=method, quantize_group=group)
    q, opts = optimize(g, opts, verify_each=True)
    rec = q.meta["quantized"]
    assert rec["products"] == 14 and rec["format"] == ("int8" if method == "int8" else "uint4")  # 2 layers x 7
    assert rec["weight_bytes_packed"] < rec["weight_bytes_fp32"] / (3.5 if method == "int8" else 6)
    assert _count(q, Op.QMATMUL) == 8  # q/k/v and gate/up merged per layer: 4 a layer (o/down in fused epilogues)
    assert _count(q, Op.MATMUL) == 1  # the LM head stays
    heads = [d for d in opts.declines if d[0] == "quantize"]
    assert len(heads) == 1 and "'lm_head.weight' (the LM head) kept" in heads[0][2]
    out = reference.run(q, feeds)["logits"]
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert 0 < err < tol
    # --quantize-head: the LM head is packed too
    q2, _ = optimize(g, PassOptions(quantize=method, quantize_group=group, quantize_head=True))
    assert q2.meta["quantized"]["products"] == 15 and _count(q2, Op.MATMUL) == 0


def test_quantize_keeps_unfit_weights_and_bf16_plans_keep_packed_dtypes():
    g = load_graph("llama-tiny", None)
    _, opts = optimize(g, PassOptions(quantize="int4", quantize_group=128))
    reasons = [d[2] for d in opts.declines if d[0] == "quantize"]
    cfg = get_config("llama-tiny")
    assert cfg.hidden_size % 128  # q/k/v/o and gate/up (K = hidden) miss the group; down (K = ffn) may not
    expected = cfg.num_layers * (6 + (cfg.intermediate_size % 128 != 0))
    assert sum("is not a multiple of the int4 group 128" in r for r in reasons) == expected
    q, _ = optimize(g, PassOptions(quantize="int8", storage_dtype="bf16"))
    for n in [m for f in q.nodes for m in (f.attrs.body.nodes if f.op == Op.FUSED else [f])]:
        if n.op == Op.QMATMUL:
            assert n.inputs[0].dtype == DType.BF16 and n.outputs[0].dtype == DType.BF16
            assert [v.dtype for v in n.inputs[1:]] == [DType.I8, DType.F16]


def test_merge_gemms_stacks_packed_weights_of_one_format():
    rng = np.random.default_rng(5)
    b = GraphBuilder("m")
    x = b.input("x", (2, 4, 256), DType.F32)
    outs = []
    for i, (t, n) in enumerate([("Q4_K", 24), ("Q4_K", 40), ("Q6_K", 8)]):
        qw = repack(random_blocks(t, n, 256, rng), t, n, 256, f"w{i}")
        cs = [b.const(a, name=f"w{i}.{r}") for r, a in zip(qw.roles, qw.arrays)]
        outs.append(b.emit(Op.QMATMUL, x, *cs, format=qw.format, n=n, k=256, group=qw.group))
    for i, o in enumerate(outs):
        b.output(o, f"y{i}")
    g = b.build()
    feeds = {"x": rng.standard_normal((2, 4, 256)).astype(np.float32)}
    ref = reference.run(g, feeds)
    q, opts = optimize(g, PassOptions(), verify_each=True)
    mms = [n for n in q.nodes if n.op == Op.QMATMUL]
    assert sorted(n.attrs.n for n in mms) == [8, 64]  # the two Q4_K merged, the Q6_K apart
    got = reference.run(q, feeds)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-6, atol=1e-6)


def test_weight_report_counts_packed_tensors_in_fused_bodies_too():
    from fusec.weight_report import weight_formats

    g = load_graph("llama-tiny", None)
    q, _ = optimize(g, PassOptions(quantize="int4", quantize_group=32))
    rep = weight_formats(q)
    packed = rep["by_format"]["uint4"]
    assert packed["tensors"] == 8 and packed["bytes"] == q.meta["quantized"]["weight_bytes_packed"]
    assert all(t["bits_per_weight"] == pytest.approx(4.75) for t in rep["tensors"] if t["format"] == "uint4")
    table = next(t for t in rep["tensors"] if t.get("embedding"))
    # a step reads every weight once, and of the embedding table only the rows gathered
    consts = {id(c): c.nbytes for c in q.constants}
    consts.update({id(c): c.nbytes for n in q.nodes if n.op == Op.FUSED for c in n.attrs.body.constants})
    assert rep["step_bytes"] == sum(consts.values()) - table["bytes"] + 16 * table["bytes"] // table["shape"][0]


def test_quantize_reads_weights_stored_narrow_through_their_cast(monkeypatch):
    """A generation plan stores its large weights in bf16 (``storage``): each product then reads its weight through a
    CAST to fp32 that constant folding keeps for the precision pass. The pass quantizes through that CAST, from the
    stored values, exactly the products it quantizes when the weights are fp32 constants (before, it quantized none:
    ``--quantize`` on a bf16 generation plan did nothing)."""
    from fusec.genmodel import build_graphs, load_generation_model
    from fusec.models.weights import StoredWeights
    from fusec.quantize import quantize_weight

    monkeypatch.setattr(StoredWeights, "MIN_ELEMENTS", 1)  # llama-tiny's matrices are under the size stored narrow
    gm = load_generation_model("llama-tiny")
    counts = {}
    for storage in (None, "bf16"):
        g = build_graphs(gm, 1, 32, 8, [], storage=storage)["decode"]
        casts = sum(n.op == Op.CAST and n.inputs[0].data is not None for n in g.nodes)
        assert (casts > 0) == (storage is not None)
        q, _ = optimize(g, PassOptions(quantize="int4", quantize_group=32, **({"storage_dtype": storage} if storage else {})))
        counts[storage] = q.meta["quantized"]["products"]
        if storage is None:
            continue
        # the codes of a packed weight are those of the stored (bf16) weight
        stored = {v.name: v for v in g.constants if v.dtype == DType.BF16}
        name, w = next((k, v) for k, v in stored.items() if k.endswith("down_proj.weight"))
        want = quantize_weight(w.data.astype(np.float32), "int4", 32, name)
        got = {v.name: v for v in q.constants if v.name.startswith(name + ".")}
        assert got and all(np.array_equal(got[f"{name}.{role}"].data, a) for role, a in zip(want.roles, want.arrays))
    assert counts["bf16"] == counts[None] > 0


def test_a_bf16_generation_plan_with_quantize_runs_its_products_packed(monkeypatch, tmp_path):
    """``compile_generation(..., dtype="bf16", quantize="int4")``, what ``fusec generate MODEL --quantize int4`` compiles,
    with the model's matrices stored in bf16: the decode step's products run on the quantized GEMV and the plan's
    weights hold the packed codes (for sm_90, on the CPU)."""
    from fusec.compiler import compile_generation
    from fusec.models.weights import StoredWeights

    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(StoredWeights, "MIN_ELEMENTS", 1)
    plan = compile_generation("llama-tiny", batch=1, max_seq_len=32, prefill_len=8, dtype="bf16", arch="sm_90",
                              eos_ids=[], quantize="int4", quantize_group=32)
    rep = plan.manifest["reports"]["decode"]
    assert rep["quantized"]["products"] > 0 and rep["quantized"]["format"] == "uint4"
    assert rep["lowering"]["by_template"].get("qmatmul:qgemv", 0) > 0, rep["lowering"]["by_template"]


def test_the_entries_of_a_plan_pack_each_weight_once(monkeypatch):
    """A generation plan's prefill and decode graphs hold the same weight arrays (stored in bf16, as a bf16 plan's
    are): under ``sharing_derived`` (as ``compile_entries`` runs the entries) each weight is quantized once and both
    graphs hold the same packed arrays."""
    from fusec import quantize as Q
    from fusec.bulk import sharing_derived
    from fusec.genmodel import GenModel, build_graphs
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights, StoredWeights

    monkeypatch.setattr(StoredWeights, "MIN_ELEMENTS", 1)  # every matrix stored narrow
    calls = []
    real = Q.quantize_weight
    monkeypatch.setattr(Q, "quantize_weight", lambda w, *a, **kw: calls.append(1) or real(w, *a, **kw))
    # matrices over constant folding's 4,096-element layout limit, as a real model's (llama-tiny's q/k/v/o fold)
    cfg = dataclasses.replace(get_config("llama-tiny"), hidden_size=128, intermediate_size=256, num_heads=4,
                              num_kv_heads=2, head_dim=32)
    graphs = build_graphs(GenModel(cfg, SharedWeights(RandomWeights(0)), None, (), cfg.name), 1, 32, 8, [],
                          storage="bf16")

    def opts():
        return PassOptions(quantize="int4", quantize_group=32, storage_dtype="bf16")

    with sharing_derived():
        pre, _ = optimize(graphs["prefill"], opts())
        dec, _ = optimize(graphs["decode"], opts())
        n = pre.meta["quantized"]["products"]
        assert n == dec.meta["quantized"]["products"] == 14 and len(calls) == n  # 2 layers x 7 weights, once each

        def packed(g):
            return {v.name: v.data for v in g.constants if v.name.endswith((".codes", ".scales", ".zeros"))}

        a, b = packed(pre), packed(dec)
        assert a and a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    optimize(graphs["decode"], opts())  # outside it: made again
    assert len(calls) == 2 * n
