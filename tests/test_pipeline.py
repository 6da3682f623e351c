"""pipeline: order checks, dumps, verify-after-each, progress, meta carry-over, report; and the
whole pipeline on every tiny built-in model (numerics kept, plan <= 1.1 x lower bound)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest

from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph, IRError, Node, Value
from fusec.ops import NoAttrs, Op
from fusec.passes import constant_fold, cse, dce, memory_plan, pipeline, simplify, views
from fusec.passes.base import PassOptions, PassResult


def _graph() -> Graph:
    rng = np.random.default_rng(20261123)
    b = GraphBuilder("g")
    x = b.input("x", (4, 8), DType.F32)
    c = b.emit(Op.EXP, b.const((rng.standard_normal(8) + 0.5).astype(np.float32), name="c"))  # folds
    h = b.emit(Op.MUL, b.emit(Op.ADD, x, c), b.scalar(1.0, DType.F32))  # * 1 goes
    r = b.emit(Op.RESHAPE, b.emit(Op.RESHAPE, h, shape=(32,)), shape=(8, 4))  # one reshape, a view
    b.emit(Op.TANH, x)  # dead
    b.output(b.emit(Op.SIGMOID, r), "y")
    return b.build()


# The passes this file's structural assertions are about; the default PIPELINE grows (patterns,
# fusion) and is exercised for order, dumps, progress and numerics only.
OWN = [constant_fold, simplify, cse, dce, views, memory_plan]


def _fake_pass(name: str, requires: tuple[str, ...] = (), fn=None) -> types.ModuleType:
    mod = types.ModuleType(f"fake_{name}")
    mod.NAME = name
    mod.REQUIRES = requires
    mod.run = fn or (lambda g, o: PassResult(g.copy(), False))
    return mod


def test_default_pipeline_order_is_consistent() -> None:
    pipeline.check_order(pipeline.PIPELINE)
    names = [pipeline.pass_name(m) for m in pipeline.PIPELINE]
    assert names[:4] == ["constant_fold", "simplify", "cse", "dce"]
    assert names[-2:] == ["views", "memory_plan"]


def test_missing_requirement_is_refused_before_any_pass_runs() -> None:
    ran: list[str] = []

    def spy(g: Graph, o: PassOptions) -> PassResult:
        ran.append("a")
        return PassResult(g.copy(), False)

    bad = [_fake_pass("a", fn=spy), _fake_pass("b", requires=("a", "c")), _fake_pass("c")]
    with pytest.raises(pipeline.PassOrderError, match="'b' requires 'c'"):
        pipeline.optimize(_graph(), pipeline=bad)
    assert ran == []
    # a requirement met by an earlier optimize() (recorded in graph.meta) counts
    g = _graph()
    g.meta["passes"] = ["c"]
    out, _ = pipeline.optimize(g, pipeline=[_fake_pass("b", requires=("c",))])
    assert out.meta["passes"] == ["c", "b"]


def test_optimize_dumps_verifies_reports_progress_and_keeps_numerics(tmp_path: Path) -> None:
    g = _graph()
    seen: list[tuple[str, int, int]] = []
    out, opts = pipeline.optimize(g, dump_dir=tmp_path, verify_each=True,
                                  progress=lambda n, i, t: seen.append((n, i, t)))
    names = [pipeline.pass_name(m) for m in pipeline.PIPELINE]
    assert seen == [(n, i, len(names)) for i, n in enumerate(names)]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00-input.txt"] + [f"{i + 1:02d}-{n}.txt" for i, n in enumerate(names)]
    assert "exp" in (tmp_path / "00-input.txt").read_text()
    assert "exp" not in (tmp_path / "01-constant_fold.txt").read_text()
    assert "memory" in out.meta and "views" in out.meta
    x = (np.random.default_rng(20261124).standard_normal((4, 8)) + 0.25).astype(np.float32)
    want = reference.run(g, {"x": x})["y"]
    np.testing.assert_allclose(reference.run(out, {"x": x})["y"], want, rtol=1e-6)
    plan = memory_plan.plan_memory(out)
    np.testing.assert_allclose(reference.run_planned(out, {"x": x}, plan)["y"], reference.run(out, {"x": x})["y"],
                               rtol=1e-5, atol=1e-6)
    assert "memory" not in g.meta and len(g.nodes) == 7  # the caller's graph is untouched


def test_canonicalization_passes_leave_the_expected_graph() -> None:
    out, opts = pipeline.optimize(_graph(), pipeline=OWN, verify_each=True)
    assert [n.op for n in out.nodes] == [Op.ADD, Op.RESHAPE, Op.SIGMOID]
    assert out.meta["views"] == 1 and out.meta["passes"] == [pipeline.pass_name(m) for m in OWN]
    assert opts.stats["constants_folded"] == 1 and opts.stats["simplified"] == 2  # x*1, reshape pair


def test_verify_each_names_the_pass_that_broke_the_graph() -> None:
    def breaks(g: Graph, o: PassOptions) -> PassResult:
        bad = Value("bad", (3,), DType.F32)  # wrong shape for neg of a [4, 8]
        return PassResult(Graph(g.inputs, g.outputs, [Node(Op.NEG, [g.inputs[0]], [bad], NoAttrs())] + g.nodes,
                                g.constants, g.name, g.meta), True)

    with pytest.raises(IRError, match="after pass #1 'breaker'"):
        pipeline.optimize(_graph(), pipeline=[_fake_pass("breaker", fn=breaks)], verify_each=True)


def test_meta_dropped_by_a_pass_is_carried_forward() -> None:
    def forgetful(g: Graph, o: PassOptions) -> PassResult:
        return PassResult(Graph(g.inputs, g.outputs, g.nodes, g.constants, g.name), False)

    g = _graph()
    g.meta["patterns"] = {"attention": 2}
    out, _ = pipeline.optimize(g, pipeline=[_fake_pass("forgetful", fn=forgetful)])
    assert out.meta["patterns"] == {"attention": 2}


def test_report_is_json_and_passes_through_pass_records() -> None:
    out, opts = pipeline.optimize(_graph(), pipeline=OWN)
    out.meta["fusions"] = 3
    opts.stats["gemms_merged"] = 1
    rep = json.loads(json.dumps(pipeline.report(out, opts)))
    assert rep["ops"] == {"add": 1, "reshape": 1, "sigmoid": 1}
    mem = rep["memory"]
    assert set(mem) == {"naive_bytes", "planned_bytes", "lower_bound_bytes", "weights_bytes"}
    assert mem["planned_bytes"] >= mem["lower_bound_bytes"] > 0 and mem["weights_bytes"] == 32
    assert rep["fusions"] == 3 and rep["gemms_merged"] == 1 and rep["views"] == 1
    assert rep["stats"]["constants_folded"] == 1


# ---- built-in models --------------------------------------------------------------------------

models = pytest.importorskip("fusec.models")
TINY = [n for n in models.names() if n.endswith("-tiny")]


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_pipeline_plan_within_target_and_arena_run_matches(name: str) -> None:
    cfg = models.get_config(name)
    g = models.build(name)
    out, opts = pipeline.optimize(g, verify_each=True)
    plan = memory_plan.plan_memory(out)
    assert plan.arena_bytes <= 1.1 * plan.lower_bound_bytes, plan.summary()
    assert plan.arena_bytes < plan.naive_bytes
    rng = np.random.default_rng(20261125)
    b, s = cfg.default_batch, cfg.default_seq
    mask = np.ones((b, s), np.int64)
    mask[:, -2:] = 0 if not cfg.is_decoder else 1  # padding on encoders only: decoders are causal
    feeds = {"input_ids": rng.integers(0, cfg.vocab_size, (b, s)), "attention_mask": mask}
    want = reference.run(g, feeds)[cfg.output_name]
    got_opt = reference.run(out, feeds)[cfg.output_name]
    got_arena = reference.run_planned(out, feeds, plan)[cfg.output_name]
    np.testing.assert_allclose(got_arena, got_opt, rtol=1e-5, atol=1e-6)  # order may follow alignment
    err = np.linalg.norm(got_opt - want) / np.linalg.norm(want)
    assert err < 1e-5, err
