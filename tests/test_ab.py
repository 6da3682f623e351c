"""fusec.ab on the CPU: decision rule, numerical gate, ledger format, the whole decision flow with
an injected (fake) runner, --decisions reproducibility, region extraction, candidate overrides,
kernel-choice lowering and the CLI's errors without a GPU."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

import fusec
import fusec.ab
from fusec import reference
from fusec.ab import regions as R
from fusec.ab.decide import FUSED, NOT_MEASURED, UNFUSED, decide, rel_error
from fusec.ab.ledger import Ledger, LedgerError
from fusec.builder import GraphBuilder
from fusec.cli import main
from fusec.dtypes import DType
from fusec.ir import Graph, verify
from fusec.loader import load_graph
from fusec.ops import Op
from fusec.passes.base import PassOptions
from fusec.passes.pipeline import optimize
from fusec.plan import Plan

RNG = np.random.default_rng(20261123)
MODEL = "gpt2-tiny"


def _t(median: float, p10: float, p90: float) -> dict[str, float]:
    return {"median_ms": median, "p10_ms": p10, "p90_ms": p90}


# ---- decision rule ------------------------------------------------------------------------------

def test_decide_accepts_only_beyond_noise_and_margin() -> None:
    d, why = decide(_t(0.80, 0.79, 0.81), _t(1.0, 0.98, 1.02), 1e-4, 2e-3)
    assert d == FUSED and "faster" in why
    d, why = decide(_t(0.95, 0.90, 1.00), _t(1.0, 0.90, 1.10), 1e-4, 2e-3)  # gain 0.05 < spread 0.2
    assert d == UNFUSED and "within noise" in why
    d, why = decide(_t(0.98, 0.979, 0.981), _t(1.0, 0.999, 1.001), 1e-4, 2e-3)  # 2% beyond noise, below 3%
    assert d == UNFUSED and "below margin" in why
    d, why = decide(_t(0.98, 0.979, 0.981), _t(1.0, 0.999, 1.001), 1e-4, 2e-3, margin=0.01)
    assert d == FUSED
    d, why = decide(_t(1.3, 1.29, 1.31), _t(1.0, 0.99, 1.01), 0.0, 2e-3)
    assert d == UNFUSED and "slower" in why


def test_decide_rejects_wrong_numerics_whatever_the_speed() -> None:
    fast, slow = _t(0.1, 0.09, 0.11), _t(1.0, 0.99, 1.01)
    for err in (3e-3, math.inf, math.nan, None):
        d, why = decide(fast, slow, err, 2e-3)
        assert d == UNFUSED and "numerics" in why, (err, why)
    d, why = decide(fast, slow, 1e-3, 2e-3, failure="LoweringError: boom")
    assert d == UNFUSED and "boom" in why


def test_rel_error_gate() -> None:
    b = {"y": RNG.uniform(0.5, 1.5, (4, 8)).astype(np.float32)}
    assert rel_error(b, b) == 0.0
    a = {"y": b["y"] * (1 + 1e-3)}
    assert rel_error(a, b) == pytest.approx(1e-3, rel=1e-3)
    nan = {"y": b["y"].copy()}
    nan["y"][1, 2] = np.nan
    assert rel_error(nan, b) == math.inf and rel_error(b, nan) == math.inf
    assert rel_error({"z": b["y"]}, b) == math.inf
    assert rel_error({"y": b["y"][:2]}, b) == math.inf


# ---- a fake runner: real compiles (NVRTC needs no GPU), reference outputs, synthetic timings ----

class FakePlan:
    def __init__(self, plan: Any, graph: Any, kw: dict[str, Any]):
        self.manifest, self.graph, self.kw = plan.manifest, graph, kw


class FakeRunner:
    """Region timings: fused is 30% faster for gemm_epilogue/kernel choices, slower otherwise;
    ``wrong`` rules get fused outputs off by +1.0 (and look 10x faster)."""

    def __init__(self, wrong: tuple[str, ...] = ("reduce_fusion",), whole: dict[str, float] | None = None,
                 region: dict[str | None, float] | None = None):
        self.wrong, self.whole = wrong, whole or {"rule_based": 1.0, "unfused": 1.5, "assembled": 0.9}
        self.region = {None: 1.0, "gemm_epilogue": 0.7, "choice": 0.7, "reduce_fusion": 0.1, **(region or {})}
        self.built: list[dict[str, Any]] = []

    def environment(self) -> dict[str, Any]:
        return {"gpu": "fake", "fusec": fusec.__version__}

    def build(self, model: Any, *, dtype: str, cuda_graph: bool, shapes: Any = None, overrides: Any = None,
              choices: Any = None, disabled: Any = ()) -> FakePlan:
        kw = {"overrides": dict(overrides or {}), "choices": dict(choices or {}), "disabled": tuple(disabled),
              "region": isinstance(model, Graph)}
        self.built.append(kw)
        plan = fusec.compile(model, shapes=shapes, dtype=dtype, cuda_graph=cuda_graph, disabled_fusions=disabled,
                             fusion_overrides=overrides, choices=choices, arch="sm_90")
        return FakePlan(plan, model if isinstance(model, Graph) else None, kw)

    def inputs(self, plan: FakePlan, seed: int) -> dict[str, np.ndarray]:
        from fusec.inputs import random_inputs_for

        return random_inputs_for(plan.manifest["inputs"], seed)

    def _fused(self, plan: FakePlan) -> str | None:
        if any(plan.kw["overrides"].values()):
            return next(k for k, v in plan.kw["overrides"].items() if v).split(":")[0]
        if any(v != "cublas" for v in plan.kw["choices"].values()):
            return "choice"
        return None

    def outputs(self, plan: FakePlan, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {k: v.astype(np.float32) for k, v in reference.run(plan.graph, inputs).items()}
        if self._fused(plan) in self.wrong:
            out = {k: v + 1.0 for k, v in out.items()}  # the injected off-by-one epilogue
        return out

    def time(self, plan: FakePlan, cuda_graph: bool, iters: int) -> dict[str, Any]:
        if not plan.kw["region"]:
            kind = "unfused" if plan.kw["disabled"] else "assembled" if plan.kw["overrides"] or plan.kw["choices"] else "rule_based"
            m = self.whole[kind]
        else:
            rule = self._fused(plan)
            m = self.region.get(rule, 1.2)
        return {"median_ms": m, "p10_ms": m * 0.99, "p90_ms": m * 1.01, "runs": iters}


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Ledger:
    mp = pytest.MonkeyPatch()
    mp.setenv("FUSEC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    seen: list[tuple[int, int, str]] = []
    try:
        led = fusec.ab.run(MODEL, dtype="fp16", runner=FakeRunner(), progress=lambda i, n, s: seen.append((i, n, s)))
        again = fusec.ab.run(MODEL, dtype="fp16", runner=FakeRunner(), whole_plan=False)
    finally:
        mp.undo()
    assert [s for _, _, s in seen][-1] == "done" and len(seen) == len(led.entries) + 2
    assert all(e.cached for e in again.entries) and [e.decision for e in again.entries] == [e.decision for e in led.entries]
    return led


def test_flow_decides_every_candidate(ledger: Ledger) -> None:
    by_rule: dict[str, list[Any]] = {}
    for e in ledger.entries:
        by_rule.setdefault(e.rule, []).append(e)
        assert e.decision in (FUSED, UNFUSED) and e.fused and e.unfused and e.tolerance == 2e-3, e
    (norm,) = by_rule["reduce_fusion"]
    assert norm.decision == UNFUSED and "numerics" in norm.reason and norm.max_error > 0.1  # faster but wrong
    assert norm.fused["median_ms"] < norm.unfused["median_ms"] and len(norm.applies_to) == 1
    assert all(e.decision == FUSED and e.max_error == 0.0 for e in by_rule["gemm_epilogue"])
    assert by_rule["elementwise"] and all(e.decision == UNFUSED and "slower" in e.reason for e in by_rule["elementwise"])
    # the whole MLP is one kernel (fusec.lower.mlp): one experiment for both layers' identical MLPs,
    # measured (fused slower here) and rejected on that evidence; a norm + GEMM is no kernel at M = 16
    (mlp,) = by_rule["mlp"]
    assert mlp.decision == UNFUSED and "slower" in mlp.reason and mlp.count == 2 and mlp.rule_default == "unfused"
    assert mlp.ops.count("matmul") == 2 and mlp.max_error == 0.0
    assert "norm_gemm" not in by_rule
    # fusec's GEMM: each layer pair's fused products (2 a candidate), and the LM head's plain product (its stream form)
    ours = by_rule["choice:fusec_gemm"]
    assert all(e.decision == FUSED and e.count == (1 if e.key.startswith("matmul:") else 2) for e in ours)
    assert [e.key.split(":")[0] for e in ours].count("matmul") == 1
    assert all(e.count == len(e.applies_to) for e in ledger.entries if e.kind == "fusion")
    w = ledger.whole_plan
    assert w is not None and w["kept"] == "assembled" and w["unfused"]["median_ms"] == 1.5
    assert ledger.overrides() and ledger.choices()


def test_ledger_json_round_trip_and_table(ledger: Ledger) -> None:
    text = ledger.to_json()
    back = Ledger.from_json(text)
    assert back.to_dict() == json.loads(text) and back.overrides() == ledger.overrides()
    table = ledger.to_table()
    for e in ledger.entries:
        assert e.candidate[:30] in table
    assert "whole plan rule_based" in table and "numerics" in table
    assert len(table.splitlines()) == len(ledger.entries) + 2 + 1 + 3 + 1


def test_budget_measures_largest_first_and_records_the_rest(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import time

    class SlowRunner(FakeRunner):
        def build(self, model: Any, **kw: Any) -> FakePlan:
            time.sleep(0.2)  # each experiment outlasts the budget
            return super().build(model, **kw)

    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    none = fusec.ab.run(MODEL, dtype="fp16", runner=FakeRunner(), budget_s=0.0, whole_plan=False)
    assert none.entries and all(e.decision == NOT_MEASURED and e.fused is None for e in none.entries)
    led = fusec.ab.run(MODEL, dtype="fp16", runner=SlowRunner(), budget_s=0.1, whole_plan=False)
    measured = [e for e in led.entries if e.decision != NOT_MEASURED]
    rest = [e for e in led.entries if e.decision == NOT_MEASURED]
    assert len(measured) == 1 and rest and all(e.reason == "not measured (budget)" for e in rest)
    top = max(led.entries, key=lambda e: e.cost_estimate * e.count)
    assert measured[0] is top
    assert not led.overrides().keys() & {k for e in rest for k in e.applies_to}


def test_whole_plan_slower_keeps_rule_based(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    runner = FakeRunner(whole={"rule_based": 1.0, "unfused": 1.5, "assembled": 1.2})
    led = fusec.ab.run(MODEL, dtype="fp16", runner=runner, candidates=["gemm_epilogue"])
    assert led.entries and all(e.rule == "gemm_epilogue" for e in led.entries)
    assert led.whole_plan["kept"] == "rule_based" and "SLOWER" in led.whole_plan["note"]
    assert led.overrides() == {} and led.choices() == {}


# ---- --decisions reproducibility and CLI errors ---------------------------------------------------

def test_compile_with_decisions_reproduces_them(ledger: Ledger, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "ledger.json"
    path.write_text(ledger.to_json())
    plans = []
    for i in range(2):
        out = tmp_path / f"p{i}.fplan"
        assert main(["compile", MODEL, "-o", str(out), "--decisions", str(path), "--arch", "sm_90"]) == 0
        plans.append(Plan.load(out))
    recs = {r["key"]: r for r in plans[0].manifest["report"]["fusions"]}
    overrides = ledger.overrides()
    flipped = [k for k, v in overrides.items() if k in recs and (recs[k]["decision"] == "applied") != v]
    assert not flipped
    assert any(not v for v in overrides.values()) and any(v for v in overrides.values())
    applied = plans[0].manifest["report"]["lowering"]["choices"]["applied"]
    assert applied == ledger.choices() and plans[0].manifest["report"]["lowering"]["by_template"].get("gemm", 0) >= len(applied)
    assert plans[0].manifest["launches"] == plans[1].manifest["launches"]
    assert plans[0].manifest["ab"]["unmatched"] == []
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "p0.fplan"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert Ledger.from_dict({k: v for k, v in info["ab"].items() if k != "unmatched"}).overrides() == overrides


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d["entries"][0].pop("applies_to"), "applies_to"),
    (lambda d: d["entries"][0].__setitem__("decision", "maybe"), "decision"),
    (lambda d: d.__setitem__("version", 99), "version"),
    (lambda d: d.__setitem__("dtype", "bf16"), "dtype"),
])
def test_malformed_decisions_exit_1_naming_the_problem(ledger, tmp_path, capsys, mutate, needle) -> None:  # type: ignore[no-untyped-def]
    data = ledger.to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert main(["compile", MODEL, "-o", str(tmp_path / "x.fplan"), "--decisions", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fusec: error:") and needle in err and "bad.json" in err
    assert not (tmp_path / "x.fplan").exists()


def test_decisions_not_json_exit_1(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    assert main(["compile", MODEL, "-o", str(tmp_path / "x.fplan"), "--decisions", str(path)]) == 1
    assert "not valid JSON" in capsys.readouterr().err


def test_ab_without_gpu_exits_1_with_one_line(capsys) -> None:  # type: ignore[no-untyped-def]
    from fusec import device

    if device.gpu_available():
        pytest.skip("this machine has a GPU")
    assert main(["ab", MODEL, "--cuda-graph"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fusec: error:") and "GPU" in err


# ---- regions and overrides ---------------------------------------------------------------------

def test_regions_are_verified_and_compute_the_original_values() -> None:
    graph = load_graph(MODEL, None)
    pre, cands = R.candidates(graph, "f16")
    assert {c.rule for c in cands} >= {"gemm_prologue", "gemm_epilogue", "reduce_fusion", "elementwise"}
    assert "mlp" in {c.rule for c in cands} and "norm_gemm" not in {c.rule for c in cands}
    assert all([n.op for n in c.region.graph.nodes].count(Op.MATMUL) == 2 for c in cands if c.rule == "mlp")
    from fusec.inputs import random_inputs

    feeds = random_inputs(pre, int(RNG.integers(1 << 30)))
    for c in cands:
        region = c.region.graph
        verify(region)
        assert not any(v.is_const for v in region.inputs) and region.outputs
        by_name = {v.name: v for v in pre.values()}  # a region has Value objects of its own
        wanted = [by_name[v.name] for v in region.inputs + region.outputs if by_name[v.name] not in pre.inputs]
        probe = Graph(pre.inputs, list(pre.outputs) + [v for v in wanted if v not in pre.outputs], pre.nodes, pre.constants)
        values = reference.run(probe, feeds)
        values.update(feeds)
        got = reference.run(region, {v.name: values[v.name] for v in region.inputs})
        assert got.keys() == {v.name for v in region.outputs}
        for name, arr in got.items():
            assert np.array_equal(arr, values[name], equal_nan=True), (c.name, name)


def test_override_flips_exactly_the_named_candidate() -> None:
    graph = load_graph(MODEL, None)
    base, _ = optimize(graph, PassOptions(storage_dtype="f16"))
    again, _ = optimize(graph, PassOptions(storage_dtype="f16"))
    recs = {r["key"]: r for r in base.meta["fusions"]}
    assert list(recs) == [r["key"] for r in again.meta["fusions"]] and len(recs) == len(base.meta["fusions"])
    epi = [k for k, r in recs.items() if r["rule"] == "gemm_epilogue" and r["decision"] == "applied"]
    off, _ = optimize(graph, PassOptions(storage_dtype="f16", fusion_overrides={epi[0]: False}))
    new = {r["key"]: r for r in off.meta["fusions"]}
    assert new[epi[0]]["decision"] == "rejected" and "A/B decision" in new[epi[0]]["reason"]
    changed = [k for k in recs if k in new and new[k]["decision"] != recs[k]["decision"]]
    assert changed == [epi[0]]
    # an override turns on the (off by default) whole-MLP candidate: it takes the two products and their
    # epilogues; only the records of groups it overlaps change
    mlp = next(k for k, r in recs.items() if r["rule"] == "mlp")
    assert recs[mlp]["decision"] == "candidate" and recs[mlp]["legal"]
    on, _ = optimize(graph, PassOptions(storage_dtype="f16", fusion_overrides={mlp: True}))
    new = {r["key"]: r for r in on.meta["fusions"]}
    assert new[mlp]["decision"] == "applied" and "A/B decision" in new[mlp]["reason"]
    assert sum(1 for n in on.nodes if n.op == Op.FUSED and n.attrs.rule == "mlp") == 1
    changed = [k for k in recs if k not in new or new[k]["decision"] != recs[k]["decision"]]
    assert mlp in changed and all(k == mlp or set(recs[k]["members"]) & set(recs[mlp]["members"]) for k in changed)


# ---- kernel choices in the lowering ------------------------------------------------------------

def _small_m_graph() -> Graph:
    b = GraphBuilder("gemv")
    x = b.input("x", (2, 64), DType.F32)
    w = b.const(RNG.standard_normal((64, 128)).astype(np.float32), name="w")
    bias = b.const(RNG.standard_normal(128).astype(np.float32), name="bias")
    y = b.emit(Op.GELU, b.emit(Op.ADD, b.emit(Op.MATMUL, x, w), bias), approximate="none")
    b.output(y, "y")
    return b.build()


def test_kernel_choices_select_the_variant_and_default_is_unchanged() -> None:
    g = _small_m_graph()
    default = fusec.compile(g, dtype="fp16", arch="sm_90")
    same = fusec.compile(g, dtype="fp16", arch="sm_90", choices={"unrelated:key": "gemv"})
    assert default.manifest["launches"] == same.manifest["launches"]
    # two rows: the rule-based default is the skinny product, its epilogue inside (one kernel)
    assert [L["type"] for L in default.manifest["launches"]] == ["kernel"]
    assert [m["template"] for m in default.manifest["modules"]] == ["gemv.cu.jinja"]
    key = "gemm_epilogue:f16:2x128x64:bias+gelu"
    for variant, template in (("fusec_gemm", "gemm"), ("gemv", "gemv")):
        p = fusec.compile(g, dtype="fp16", arch="sm_90", choices={key: variant})
        assert p.manifest["report"]["lowering"]["choices"]["applied"] == {key: variant}
        assert [L["type"] for L in p.manifest["launches"]] == ["kernel"]
        assert [m["template"] for m in p.manifest["modules"]] == [f"{template}.cu.jinja"]
    cublas = fusec.compile(g, dtype="fp16", arch="sm_90", choices={key: "cublas"})  # the product, then the epilogue
    assert [L["type"] for L in cublas.manifest["launches"]] == ["gemm", "kernel"]
    bad = fusec.compile(g, dtype="fp16", arch="sm_90", choices={key: "nonsense"})
    assert "nonsense" in bad.manifest["report"]["lowering"]["choices"]["declined"][key]
    assert bad.manifest["launches"] == default.manifest["launches"]


def test_from_json_raises_ledger_error_naming_the_entry(ledger: Ledger) -> None:
    data = ledger.to_dict()
    data["entries"][1]["fused"] = {"median_ms": "fast"}
    with pytest.raises(LedgerError, match=r"entries\[1\]: field 'fused'"):
        Ledger.from_dict(data)
    with pytest.raises(LedgerError, match="format"):
        Ledger.from_dict({**ledger.to_dict(), "format": "other"})


def test_accepted_kernel_choice_keeps_its_gemm_epilogue_fused(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    runner = FakeRunner(region={"gemm_epilogue": 1.0})  # epilogue fusion ties (kept unfused); fusec GEMM wins
    led = fusec.ab.run(MODEL, dtype="fp16", runner=runner, candidates=["gemm_epilogue", "choice"], whole_plan=False)
    epi = [e for e in led.entries if e.rule == "gemm_epilogue"]
    choice = [e for e in led.entries if e.kind == "kernel_choice"]
    assert epi and all(e.decision == UNFUSED and "noise" in e.reason for e in epi)
    assert choice and all(e.decision == FUSED for e in choice)
    # a fused GEMM's choice needs its group; a plain MATMUL's (the tied lm_head's layout) needs none
    assert all(len(e.requires) == (e.count if e.key.startswith("gemm_epilogue") else 0) for e in choice)
    overrides = led.overrides()
    assert all(overrides[k] for e in choice for k in e.requires)
    plan = fusec.compile(MODEL, dtype="fp16", arch="sm_90", fusion_overrides=overrides, choices=led.choices())
    recs = {r["key"]: r for r in plan.manifest["report"]["fusions"]}
    assert all(recs[k]["decision"] == "applied" for e in choice for k in e.requires)
    applied = plan.manifest["report"]["lowering"]["choices"]["applied"]
    # the tied attention-layout epilogue turned off frees its layout ops; they cannot join the next
    # GEMM (a matrix product takes no prologue: the codegen declines it), so every choice point stays
    assert applied == led.choices()
