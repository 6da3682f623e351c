"""fusec.report.export_graph: the fused graph as ONNX (one node per kernel, ai.fusec fused nodes)."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from fusec.errors import FusecError
from fusec.loader import load_graph
from fusec.ops import Op
from fusec.report.export_graph import DOMAIN, VIEW_DOC, export_fused, fused_model
from fusec.report.subject import load_subject


def _body_ops(node) -> list[str]:
    # walk the fused body here, not through fusec.report.subject.node_ops
    out = []
    for inner in node.attrs.body.nodes:
        out += _body_ops(inner) if inner.op == Op.FUSED else [inner.op.value]
    return out


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "llama-tiny", "qwen3-tiny"])
def test_export_of_builtin_models_checks_and_has_one_node_per_kernel(tmp_path, name):
    sub = load_subject(name, arch="sm_90")
    path = tmp_path / f"{name}.onnx"
    export_fused(sub.graph, path)
    onnx.checker.check_model(os.fspath(path))  # again, from the file
    model = onnx.load(os.fspath(path))
    assert len(model.graph.node) == len(sub.graph.nodes)
    kernels = [n for n in model.graph.node if n.doc_string != VIEW_DOC]
    assert len(kernels) == sub.graph.meta["kernels"]  # the pipeline's kernel count (a plan's report holds it)
    assert {(o.domain, o.version) for o in model.opset_import} >= {(DOMAIN, 1)}
    fused = [n for n in sub.graph.nodes if n.op == Op.FUSED]
    custom = [n for n in model.graph.node if n.domain == DOMAIN]
    assert fused and len(custom) >= len(fused)
    with_rule = [n for n in custom if any(a.name == "rule" for a in n.attribute)]
    assert len(with_rule) == len(fused)
    for node, proto in zip(fused, with_rule):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in proto.attribute}
        assert [s.decode() for s in attrs["ops"]] == _body_ops(node)
        assert attrs["rule"].decode() == node.attrs.rule
    # every graph input and output keeps its name, and the weights are there
    assert [i.name for i in model.graph.input] == [v.name for v in sub.graph.inputs]
    assert [o.name for o in model.graph.output] == [v.name for v in sub.graph.outputs]
    assert sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer) >= sub.graph.weight_bytes


def test_kernel_count_matches_a_compiled_plan(tmp_path):
    import fusec

    plan = fusec.compile("gpt2-tiny", arch="sm_90")
    plan.save(tmp_path / "g.fplan")
    sub = load_subject(os.fspath(tmp_path / "g.fplan"))
    assert sub.graph is not None, sub.missing
    model = fused_model(sub.graph)
    kernels = [i for i, n in enumerate(model.graph.node) if n.doc_string != VIEW_DOC]
    assert len(kernels) == plan.manifest["report"]["kernels"]
    # the plan launches exactly the exported nodes that are kernels (views launch nothing)
    assert {d["node"] for d in sub.describe()} == set(kernels)


def test_no_weights_makes_them_graph_inputs(tmp_path):
    sub = load_subject("bert-tiny", arch="sm_90")
    with_w, without = tmp_path / "w.onnx", tmp_path / "nw.onnx"
    export_fused(sub.graph, with_w)
    export_fused(sub.graph, without, weights=False)
    m = onnx.load(os.fspath(without))
    onnx.checker.check_model(m)
    inputs = {i.name for i in m.graph.input}
    inits = {t.name for t in m.graph.initializer}
    for c in sub.graph.constants:
        if c.nbytes >= 1024:
            assert c.name in inputs and c.name not in inits
    assert os.path.getsize(without) * 20 < os.path.getsize(with_w)


def test_weights_round_trip(tmp_path):
    sub = load_subject("gpt2-tiny", arch="sm_90")
    m = fused_model(sub.graph)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    c = max(sub.graph.constants, key=lambda v: v.nbytes)
    np.testing.assert_array_equal(inits[c.name], c.data)


def test_plan_rebuilt_with_other_fusion_flags_says_what_is_missing(tmp_path):
    import fusec

    fusec.compile("gpt2-tiny", arch="sm_90").save(tmp_path / "g.fplan")
    sub = load_subject(os.fspath(tmp_path / "g.fplan"), disabled_fusions=["gemm_epilogue"])
    assert sub.graph is None and "--disable-fusion" in sub.missing
    with pytest.raises(FusecError, match="export-graph needs the plan's fused graph"):
        sub.need_graph("export-graph")
    fusec.compile("gpt2-tiny", arch="sm_90", disabled_fusions=["gemm_epilogue"]).save(tmp_path / "n.fplan")
    again = load_subject(os.fspath(tmp_path / "n.fplan"), disabled_fusions=["gemm_epilogue"])
    assert again.graph is not None, again.missing
    default = load_subject(os.fspath(tmp_path / "g.fplan"))
    assert len(again.launches) > len(default.launches)  # the epilogues are launches of their own now


def test_plan_without_source_needs_model(tmp_path):
    import fusec
    from fusec.onnx_export import export_onnx

    export_onnx(load_graph("gpt2-tiny"), tmp_path / "m.onnx")
    plan = fusec.compile(onnx.load(os.fspath(tmp_path / "m.onnx")), arch="sm_90")  # in memory: no source recorded
    plan.save(tmp_path / "g.fplan")
    sub = load_subject(os.fspath(tmp_path / "g.fplan"))
    assert sub.graph is None and "--model" in sub.missing
    sub = load_subject(os.fspath(tmp_path / "g.fplan"), model=os.fspath(tmp_path / "m.onnx"))
    assert sub.graph is not None, sub.missing


def test_plan_from_a_file_finds_it_next_to_the_plan_and_checks_its_digest(tmp_path):
    import fusec
    from fusec.onnx_export import export_onnx

    src = tmp_path / "m.onnx"
    export_onnx(load_graph("gpt2-tiny"), src)
    plan = fusec.compile(os.fspath(src), arch="sm_90")
    plan.save(tmp_path / "g.fplan")
    if plan.manifest["source"].get("kind") != "file":
        pytest.skip("plans of this version record the source by path")
    assert load_subject(os.fspath(tmp_path / "g.fplan")).graph is not None
    elsewhere = tmp_path / "sub"
    elsewhere.mkdir()
    os.replace(tmp_path / "g.fplan", elsewhere / "g.fplan")
    sub = load_subject(os.fspath(elsewhere / "g.fplan"))
    assert sub.graph is None and "--model" in sub.missing
    assert load_subject(os.fspath(elsewhere / "g.fplan"), model=os.fspath(src)).graph is not None
    other = tmp_path / "other.onnx"
    export_onnx(load_graph("bert-tiny"), other)
    sub = load_subject(os.fspath(elsewhere / "g.fplan"), model=os.fspath(other))
    assert sub.graph is None and "sha256" in sub.missing


@pytest.fixture(scope="module")
def generation_plan(tmp_path_factory):
    from fusec.compiler import compile_generation

    path = tmp_path_factory.mktemp("gen") / "gen.fplan"
    compile_generation("llama-tiny", batch=1, max_seq_len=32, dtype="fp16", arch="sm_90").save(path)
    return os.fspath(path)


@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_generation_plan_entries_are_rebuilt(tmp_path, generation_plan, entry):
    from fusec.report.timeline import timeline

    sub = load_subject(generation_plan, entry=entry)
    assert sub.graph is not None, sub.missing
    model = export_fused(sub.graph, tmp_path / f"{entry}.onnx", weights=False)
    onnx.checker.check_model(model)
    kernel_nodes = {i for i, n in enumerate(model.graph.node) if n.doc_string != VIEW_DOC}
    assert {d["node"] for d in sub.describe() if d["node"] is not None} == kernel_nodes
    tl = timeline(sub.mplan, sub.graph, sub.describe())
    assert max(tl["live"]) == sub.graph.meta["memory"]["lower_bound_bytes"]
    assert max(tl["extent"]) == sub.graph.meta["memory"]["planned_bytes"]
    if entry == "decode":  # the step that reads the KV cache
        assert any(d["ops"] == ["kv_attention"] for d in sub.describe())


def test_generation_plan_with_another_decoder_says_what_is_missing(generation_plan):
    sub = load_subject(generation_plan, entry="decode", model="qwen3-tiny")
    assert sub.graph is None and "qwen3-tiny" in sub.missing
