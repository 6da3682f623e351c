"""Fusion is decided once: every fusion the pass records as applied is one FUSED node, every FUSED
node is one kernel of the lowered plan (nothing is split at lowering), and fused bodies obey the IR
(``verify`` descends into them). Built-in models (tiny ones end to end, large ones through a
one-layer build with their real dimensions) and the HF exports the suite already uses."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph, IRError, Node, Value, verify
from fusec.lower import LoweringError, lower
from fusec.lower.fused_plan import can_fuse
from fusec.models import registry
from fusec.ops import FusedAttrs, FusionKind, Op
from fusec.passes import fusion
from fusec.passes.memory_plan import plan_memory
from fusec.passes.pipeline import optimize

TINY = [m for m in registry.names() if m.endswith("-tiny")]
LARGE = [m for m in registry.names() if m not in TINY]


def _check(g: Graph) -> None:
    """Applied records <-> fused nodes <-> fused kernels of the plan, one to one."""
    verify(g)  # descends into every fused body
    recs = fusion.records(g)
    fused = {n.name: n for n in g.nodes if n.op == Op.FUSED}
    applied = {r.name for r in recs if r.applied}
    assert applied == set(fused), (sorted(applied ^ set(fused)))[:5]
    for r in recs:
        if r.applied:
            body_labels = {m.name or m.outputs[0].name for m in fused[r.name].attrs.body.nodes}
            assert set(r.members) <= body_labels, (r.rule, r.members)
        else:
            assert r.name is None
        assert r.legal or r.decision == "rejected", r
    for n in fused.values():
        assert can_fuse(n.attrs.body), (n.attrs.rule, can_fuse(n.attrs.body).reason)
        assert isinstance(n.attrs.kind, FusionKind)
    low = lower(g, plan_memory(g).offsets, "sm_90", dry_run=True)
    by = low.report["by_template"]
    assert sum(v for k, v in by.items() if k.startswith("fused_")) == len(fused)


@pytest.mark.parametrize("model", TINY)
def test_tiny_models_applied_fusions_are_plan_kernels(model: str) -> None:
    g, _ = optimize(registry.build(model))
    _check(g)


def _one_layer(name: str) -> Graph:
    """A cheap structural stand-in for a large model: its real widths, heads and ops, one layer,
    a small vocabulary."""
    from fusec.models.weights import RandomWeights

    cfg = dataclasses.replace(registry.get_config(name), num_layers=1, vocab_size=512)
    weights = RandomWeights(0)
    g = registry._builder(cfg.family)(cfg, 1, 8, weights)
    weights.finish()
    return g


@pytest.mark.parametrize("model", LARGE)
def test_large_models_applied_fusions_are_plan_kernels(model: str) -> None:
    g, _ = optimize(_one_layer(model))
    _check(g)


def _hf_cases() -> list[tuple[str, str]]:
    import hf_models

    return [(f, e) for f in hf_models.FAMILIES for e in hf_models.EXPORTERS]


@pytest.mark.parametrize("family,exporter", _hf_cases())
def test_hf_exports_applied_fusions_are_plan_kernels(family: str, exporter: str) -> None:
    import hf_models

    from fusec.loader import load_graph

    path, inputs, _ = hf_models.export_hf(family, exporter)
    g, _ = optimize(load_graph(path, {k: v.shape for k, v in inputs.items()}))
    _check(g)


# ---- fused bodies obey the IR ------------------------------------------------------------------

def _fused_graph() -> tuple[Graph, Node]:
    b = GraphBuilder("g")
    x = b.input("x", (4, 8), DType.F32)
    b.output(b.emit(Op.ADD, b.emit(Op.EXP, x), b.scalar(1.0, DType.F32)), "y")
    g, _ = optimize(b.build())
    (node,) = [n for n in g.nodes if n.op == Op.FUSED]
    return g, node


def test_verify_names_the_fused_node_of_a_malformed_body() -> None:
    g, node = _fused_graph()
    verify(g)
    body = node.attrs.body
    # a body value used before it is defined
    bad = Graph(body.inputs, body.outputs, list(reversed(body.nodes)), body.constants, body.name)
    node.attrs = FusedAttrs(node.attrs.kind, node.attrs.rule, bad)
    with pytest.raises(IRError, match=r"node #\d+ fused .*fused body .*before it is defined"):
        verify(g)
    # a body input carrying constant data (constants are body constants)
    data_in = Value(body.inputs[0].name, body.inputs[0].shape, body.inputs[0].dtype,
                    np.zeros(body.inputs[0].shape, np.float32))
    nodes = [Node(n.op, [data_in if v is body.inputs[0] else v for v in n.inputs], n.outputs, n.attrs) for n in body.nodes]
    node.attrs = FusedAttrs(node.attrs.kind, node.attrs.rule, Graph([data_in], body.outputs, nodes, body.constants))
    with pytest.raises(IRError, match="fused body .*carries constant data"):
        verify(g)
    # the body's outputs do not match the node's
    node.attrs = FusedAttrs(node.attrs.kind, node.attrs.rule, Graph(body.inputs, [], body.nodes, body.constants))
    with pytest.raises(IRError, match="fused"):
        verify(g)


def test_lowering_a_fused_node_no_kernel_covers_names_the_reason() -> None:
    b = GraphBuilder("body")
    bx = b.input("x", (4, 8), DType.F32)
    b.output(b.emit(Op.EXP, b.emit(Op.CUMSUM, bx, axis=1)), "z")
    body = b.build()
    assert not can_fuse(body) and "cumsum" in can_fuse(body).reason
    x, z = Value("x", (4, 8), DType.F32), Value("z", (4, 8), DType.F32)
    g = Graph([x], [z], [Node(Op.FUSED, [x], [z], FusedAttrs(FusionKind.OPAQUE, "test_rule", body), "f")])
    verify(g)
    with pytest.raises(LoweringError, match="test_rule.*not one kernel.*cumsum"):
        lower(g, plan_memory(g).offsets, "sm_90", dry_run=True)
