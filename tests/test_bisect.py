"""fusec.debug.bisect / `fusec run --check --bisect`: the first launch of a plan whose output
diverges from the reference (issue 12: gemma2 fp32 non-finite logits).

CPU: the launch -> IR value mapping of compiled plans, the comparison and report over a fake
executor that replays the reference's values and corrupts chosen launches, the refusals (a plan
without a rebuildable source, a launch list that differs) and the CLI's flag handling.
GPU: gpt2-tiny bisects clean in fp32 and fp16; a launch perturbed inside the executor is named."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_cli import call

import fusec
from fusec.compiler import stage
from fusec.debug import bisect, compare_launches, launch_map, reference_values, staged_for
from fusec.errors import FusecError
from fusec.inputs import random_inputs
from fusec.loader import load_graph
from fusec.lower.choices import choice_points, choose
from fusec.plan import Plan

MODEL = "gpt2-tiny"


@pytest.fixture(scope="module")
def compiled():
    """gpt2-tiny fp32 for sm_90 (NVRTC, no GPU), its rebuilt post-pass graph and the launch map."""
    plan = fusec.compile(MODEL, dtype="fp32", arch="sm_90")
    st = staged_for(plan, "gpt2-tiny plan")
    slots = launch_map(st.graph, plan.manifest["launches"], st.memory.offsets, st.memory.state)
    return plan, st, slots


@pytest.fixture(scope="module")
def replay(compiled):
    """The reference values and a fake executor over them: (run(corrupt) -> Report)."""
    plan, st, slots = compiled
    inputs = random_inputs(load_graph(MODEL), seed=0)
    ref = reference_values(st.graph, inputs)

    def run(corrupt: dict[int, str], atol: float = 1e-4, rtol: float = 1e-4):
        def step(after):
            for i in range(len(slots)):
                after(i)

        made_by = {w.name: s.index for s in slots for w, _ in s.values}
        reads: dict[str, int] = {}

        def read(addr, v):
            i = made_by.get(v.name)
            reads[v.name] = reads.get(v.name, 0) + 1
            x = np.array(inputs[v.name] if i is None else ref[v.name])
            if corrupt.get(i) == "nan":
                x.reshape(-1)[5] = np.nan
            elif corrupt.get(i) == "off":
                x.reshape(-1)[-1] += 0.5
            elif corrupt.get(i) == "stale" and reads[v.name] > 1:  # right when made, changed when used
                x.reshape(-1)[0] += 1.0
            return x

        return compare_launches(st.graph, slots, ref, inputs, step, read, atol, rtol)

    return run


def test_every_launch_maps_to_its_node_and_the_last_launch_to_its_values(compiled) -> None:
    plan, st, slots = compiled
    assert len(slots) == len(plan.manifest["launches"]) == len(st.lowered.launches)
    seen = set()
    for s in slots:
        assert s.node is not None and s.label.startswith(f"#{s.node} {st.graph.nodes[s.node].op.value}")
        node = st.graph.nodes[s.node]
        assert [v.name for v, _ in s.values] == [o.name for o in node.outputs], s.label
        for v, (space, off) in s.values:
            assert space == "arena" and off == st.memory.offsets[v.name]
        seen.add(s.node)
    out = plan.manifest["outputs"][0]
    last = slots[-1].values[0]
    assert (last[0].name, last[1][1]) == (out["name"], out["offset"])  # the logits: the plan's own record
    assert len(seen) == len(slots)  # one launch per node in this plan: every launch completes a node


def test_a_gemm_before_its_epilogue_is_listed_as_not_compared() -> None:
    """cuBLASLt epilogues forced back to cuBLAS: GEMM into the output, then the epilogue kernel; the
    GEMM's row says which launch completes the node."""
    shapes = {"input_ids": (2, 32), "attention_mask": (2, 32)}  # M = 64: cuBLAS products (M <= 16: GEMVs)
    st0 = stage(load_graph(MODEL, shapes), "fp32", "sm_90", dry_run=True)
    keys = {cp.key: "cublas" for _, cp in choice_points(st0.graph) if choose({}, cp) == "cublaslt"}
    assert keys
    plan = fusec.compile(MODEL, shapes=shapes, dtype="fp32", arch="sm_90", choices=keys)
    st = staged_for(plan, "p")
    slots = launch_map(st.graph, plan.manifest["launches"], st.memory.offsets, st.memory.state)
    partial = [s for s in slots if not s.values]
    assert partial and all(s.why_not.startswith(f"partial: node #{s.node} is complete after launch ") for s in partial)
    for s in partial:
        done = int(s.why_not.rsplit(" ", 1)[1])
        assert done > s.index and slots[done].node == s.node and slots[done].values
    assert len([s for s in slots if s.values]) == len({s.node for s in slots})


def test_a_clean_replay_reports_no_divergence(replay, compiled) -> None:
    rep = replay({})
    assert not rep.diverged and rep.first_nonfinite is None
    assert all(r.status == "ok" and r.max_abs == 0 and r.local == 0 for r in rep.rows)
    n = len(compiled[2])
    assert rep.verdict().startswith(f"no divergence: {n} of {n} launches compared")


def test_nan_in_one_launch_is_named_first(replay, compiled) -> None:
    _, st, slots = compiled
    k = 7
    rep = replay({k: "nan"})
    r = rep.rows[rep.first]
    assert r.index == k and r.status == "NONFINITE" and r.nonfinite == 1 and r.ref_nonfinite == 0
    assert r.where == [list(np.unravel_index(5, r.shape))] and f"(at {r.where[0]})" in rep.verdict()
    assert rep.first_nonfinite == rep.first
    assert [x.index for x in rep.rows if x.bad] == [k]
    assert r.local == float("inf")  # wrong on its own inputs: the kernel, not what came in
    node = st.graph.nodes[slots[k].node]
    assert f"launch {k} ({slots[k].label}), node #{slots[k].node} [fused: " in rep.verdict()
    assert rep.verdict().count(node.attrs.body.nodes[0].op.value) >= 1
    assert {d["name"] for d in rep.inputs_off} == {v.name for v in node.inputs}
    assert all(d["status"] in ("ok", "given") for d in rep.inputs_off)


def test_a_tolerance_breach_before_a_nan_is_the_first_divergence(replay) -> None:
    rep = replay({3: "off", 12: "nan"})
    assert rep.rows[rep.first].index == 3 and rep.rows[rep.first].status == "DIVERGES"
    assert rep.rows[rep.first].mismatches == 1 and abs(rep.rows[rep.first].max_abs - 0.5) < 1e-3
    assert rep.rows[rep.first_nonfinite].index == 12
    assert "first non-finite at launch 12" in rep.verdict()
    loose = replay({3: "off", 12: "nan"}, atol=1.0)  # within a looser tolerance: only the NaN counts
    assert loose.rows[loose.first].index == 12


def test_table_and_json(replay, compiled) -> None:
    rep = replay({9: "nan"})
    text = rep.table(around=2)
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["launch", "label"]
    assert [ln.split()[0] for ln in lines[1:-1]] == ["7", "8", "9", "10", "11"]
    assert "NONFINITE <== FIRST" in text and lines[-1] == f"(5 of {len(rep.rows)} rows shown)"
    doc = json.loads(json.dumps(rep.to_json(), allow_nan=False))  # strict JSON: inf as a string
    assert doc["diverged"] and doc["first"] == 9
    assert [x["local"] for x in doc["launches"] if x["index"] == 9] == ["inf"]
    assert sorted({x["index"] for x in doc["launches"]}) == list(range(len(compiled[2])))


def test_plans_without_a_rebuildable_graph_are_refused_in_one_line(compiled, tmp_path) -> None:
    g = load_graph(MODEL)
    mem = fusec.compile(g, dtype="fp32", arch="sm_90")
    with pytest.raises(FusecError, match=r"does not record a source model that can be rebuilt \(kind 'memory'\)"):
        staged_for(mem, "mem.fplan")
    assert staged_for(mem, "mem.fplan", g).graph.nodes  # given the Graph, it maps
    plan = compiled[0]
    bad = Plan(dict(plan.manifest, launches=[dict(L) for L in plan.manifest["launches"]]), plan.blobs())
    bad.manifest["launches"][4]["label"] = "#4 something else"
    with pytest.raises(FusecError, match="first difference at launch 4") as e:
        staged_for(bad, "bad.fplan")
    assert "\n" not in str(e.value)


# ---- the CLI ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, msg", [
    (["--bisect"], "--bisect needs --check"),
    (["--json"], "--json and --bisect-rows apply to --bisect"),
    (["--check", "ort", "--bisect"], "use --check, not --check ort"),
    (["--check", "--bisect", "--cuda-graph"], "drop --cuda-graph"),
    (["--check", "--bisect", "--compare", "x.npz"], "drop --compare"),
    (["--check", "--bisect", "--backend", "reference"], "drop --backend reference"),
    (["--check", "--bisect", "--bisect-rows", "-1"], "--bisect-rows must be >= 0"),
])
def test_cli_flags_are_checked_in_one_line(capsys, argv, msg) -> None:
    code, out, err = call(capsys, ["run", MODEL, *argv])
    assert code != 0 and msg in err and len(err.strip().splitlines()) == 1, err


def test_cli_without_a_gpu_says_so_after_checking_the_plan(capsys, monkeypatch, tmp_path) -> None:
    from fusec import toolchain

    monkeypatch.setattr(toolchain, "gpu_missing_reason", lambda *a, **k: "no GPU found (test)")
    code, _, err = call(capsys, ["run", MODEL, "--check", "--bisect"])
    assert code != 0 and err.strip() == "fusec: error: --bisect runs the plan launch by launch on the GPU: no GPU found (test)"
    mem = tmp_path / "mem.fplan"
    fusec.compile(load_graph(MODEL), dtype="fp32", arch="sm_90").save(mem)
    code, _, err = call(capsys, ["run", str(mem), "--check", "--bisect"])
    assert code != 0 and "does not record a source model that can be rebuilt" in err
    assert "fusec run MODEL --check --bisect" in err and len(err.strip().splitlines()) == 1


# ---- GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-4), ("fp16", 1e-2)])
def test_gpt2_tiny_bisects_clean_on_the_gpu(dtype: str, tol: float) -> None:
    inputs = random_inputs(load_graph(MODEL), seed=0)
    rep = bisect(MODEL, inputs, atol=tol, rtol=tol, dtype=dtype)
    assert not rep.diverged, rep.table() + "\n" + rep.verdict()
    assert all(r.status == "ok" and not r.stale for r in rep.rows) and rep.rows[-1].value == "logits"


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["nan", "off"])
def test_a_perturbed_launch_is_found_on_the_gpu(monkeypatch, how: str) -> None:
    """Launch k's output is overwritten on the GPU right after it runs (a wrong kernel)."""
    from fusec.runtime.executor import Executor

    plan = fusec.compile(MODEL, dtype="fp32")
    st = staged_for(plan, "p")
    slots = launch_map(st.graph, plan.manifest["launches"], st.memory.offsets, st.memory.state)
    k = 6
    target, (v, (_, off)) = plan.manifest["launches"][k], slots[k].values[0]
    orig = Executor._prepare

    def prepare(self, L):
        fn = orig(self, L)
        if L is not target:
            return fn

        def perturbed(stream):
            fn(stream)
            with stream:
                view = self._view(off, v.shape, v.dtype).reshape(-1)
                view[3] = np.nan if how == "nan" else view[3] + 1.0

        return perturbed

    monkeypatch.setattr(Executor, "_prepare", prepare)
    rep = bisect(plan, random_inputs(load_graph(MODEL), seed=0), atol=1e-4, rtol=1e-4)
    first = rep.rows[rep.first]
    assert first.index == k and first.status == ("NONFINITE" if how == "nan" else "DIVERGES"), rep.verdict()
    assert all(r.status == "ok" for r in rep.rows[:rep.first])


def test_an_input_overwritten_before_its_use_is_named(replay, compiled) -> None:
    """The bytes of a value change between the launch that made it and the node that reads it (what
    an overlap in the memory plan does): the reading node's row and the verdict name it."""
    _, st, slots = compiled
    k = 2  # t2 (the residual stream) and t8: read again by later nodes
    rep = replay({k: "stale"})
    made = {v.name for v, _ in slots[k].values}
    hit = [r for r in rep.rows if r.stale]
    assert hit and all(set(r.stale) <= made for r in hit)
    users = {i for i, n in enumerate(st.graph.nodes) if any(v.name in made for v in n.inputs)}
    assert {r.node for r in hit} == users
    assert not rep.diverged  # the fake's outputs stay right: the stale bytes are reported, not invented errors
    j = next(s.index for s in slots if s.node == min(users) and s.values)
    rep = replay({k: "stale", j: "nan"})
    r = rep.rows[rep.first]
    assert r.index == j and r.stale and "overwritten in the arena before it ran (memory plan?)" in rep.verdict()
    assert [d["status"] for d in rep.inputs_off if d["name"] in r.stale] == ["overwritten before use"] * len(r.stale)


# ---- bisect() and the CLI end to end over a fake device (the GPU's glue, on the CPU) -------------

class _FakeExec:
    """Stands in for Executor + Device: a host arena; each 'launch' writes the reference's values of
    the launch's outputs at their planned offsets (launch ``bad``: one element NaN)."""

    def __init__(self, plan, bad: int | None):
        st = staged_for(plan, "fake")
        self.slots = launch_map(st.graph, plan.manifest["launches"], st.memory.offsets, st.memory.state)
        self.graph, self.bad, self.offsets = st.graph, bad, st.memory.offsets
        self.arena = np.zeros(int(plan.manifest["memory"]["arena_bytes"]), np.uint8)
        self.state = np.zeros(1, np.uint8)
        self.device = self

    def view(self, buf, off, shape, dtype):
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

        class Host:
            def get(_):
                return buf[off:off + n].view(dtype.np if dtype.value != "bf16" else np.uint16).reshape(shape).copy()

        return Host()

    def _put(self, off: int, arr: np.ndarray) -> None:
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        self.arena[off:off + raw.size] = raw

    def step(self, feeds, after) -> None:
        for v in self.graph.inputs:
            self._put(self.offsets[v.name], feeds[v.name])
        ref = reference_values(self.graph, feeds)
        for i, s in enumerate(self.slots):
            for v, (_, off) in s.values:
                x = ref[v.name].copy()
                if i == self.bad:
                    x.reshape(-1)[1] = np.nan
                self._put(off, x)
            after(i)


@pytest.fixture
def fake_gpu(monkeypatch):
    """Plans 'run' on _FakeExec; the CLI believes a GPU is there. Returns {"bad": launch or None}."""
    from fusec import toolchain

    bad = {"bad": None}

    class Eager:
        def __init__(self, plan):
            self.plan = plan

        def _exec(self):
            return _FakeExec(self.plan, bad["bad"])

    monkeypatch.setattr(Plan, "with_cuda_graph", lambda self, g: Eager(self))
    monkeypatch.setattr(toolchain, "gpu_missing_reason", lambda *a, **k: None)
    return bad


def test_bisect_over_the_fake_device_reads_every_value_back(compiled, fake_gpu) -> None:
    plan = compiled[0]
    inputs = {k: v.astype(np.int32) for k, v in random_inputs(load_graph(MODEL), seed=1).items()}  # cast to i64
    rep = bisect(plan, inputs, model=MODEL)
    assert not rep.diverged and all(r.status == "ok" and not r.stale for r in rep.rows), rep.table()
    fake_gpu["bad"] = 11
    rep = bisect(plan, inputs, model=MODEL)
    assert rep.rows[rep.first].index == 11 and rep.rows[rep.first].status == "NONFINITE"
    later = [r for r in rep.rows if r.index > 11]
    assert later and all(r.status == "ok" for r in later)  # the fake writes right values after it


def test_cli_bisect_prints_the_table_and_exits_3_naming_the_launch(capsys, fake_gpu, tmp_path) -> None:
    base = ["run", MODEL, "--dtype", "fp32", "--arch", "sm_90", "--check", "--bisect"]
    code, out, err = call(capsys, base)
    assert code == 0, err
    assert out.splitlines()[-1].startswith("no divergence: 18 of 18 launches compared")
    fake_gpu["bad"] = 5
    code, out, err = call(capsys, base + ["--bisect-rows", "1"])
    assert code == 3
    lines = out.splitlines()
    assert [ln.split()[0] for ln in lines[2:5]] == ["4", "5", "6"] and "<== FIRST" in lines[3]
    assert err.startswith("fusec: error: first divergence at launch 5 (#5 fused") and "[fused: matmul add add]" in err
    code, out, err = call(capsys, base + ["--json"])
    doc = json.loads(out)
    assert code == 3 and doc["first"] == 5 and doc["first_nonfinite"] == 5 and len(doc["launches"]) == 19


def test_an_input_read_through_a_view_is_checked_at_its_storage() -> None:
    """qwen3-tiny's per-head norms read reshape views (launch-less nodes) of the QKV products: the
    check before such a node re-reads the viewed product's bytes, so an overwrite of the product
    between its launch and the norm is named, not skipped."""
    plan = fusec.compile("qwen3-tiny", dtype="fp32", arch="sm_90")
    st = staged_for(plan, "qwen3-tiny plan")
    slots = launch_map(st.graph, plan.manifest["launches"], st.memory.offsets, st.memory.state)
    launched = {s.node for s in slots}
    views = {n.outputs[0].name: n.inputs[0].name for k, n in enumerate(st.graph.nodes) if k not in launched}
    assert views  # the model has them, or this test checks nothing
    readers = [s for s in slots if s.node is not None and s.reads
               and any(v.name in views for v in st.graph.nodes[s.node].inputs)]
    assert readers
    for s in readers:
        viewed = {views[v.name] for v in st.graph.nodes[s.node].inputs if v.name in views}
        assert viewed <= {v.name for v, _ in s.reads}, s.label
        for v, addr in s.reads:
            assert addr == ("arena", st.memory.offsets[v.name])
        for root, names in s.views.items():  # what a stale report of the viewed value names besides it
            assert names and all(views[x] == root for x in names)
