"""fusec.ab on a GPU: an injected wrong kernel is rejected on numerics even when it looks faster, a
deliberately slowed variant is rejected on time, the whole-MLP candidate of gpt2-tiny is measured
(and decided on the measurement),
and the kernel-choice variants (fusec GEMM with fused epilogue, GEMV) agree with cuBLAS."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import fusec
import fusec.ab
from fusec.ab.decide import FUSED, TOLERANCE, UNFUSED, rel_error
from fusec.ab.runner import GpuRunner
from fusec.plan import Plan

pytestmark = pytest.mark.gpu
MODEL = "gpt2-tiny"


def _is_fused(kw: dict[str, Any]) -> bool:
    return any((kw.get("overrides") or {}).values()) or any(v != "cublas" for v in (kw.get("choices") or {}).values())


def _add_one_to_outputs(plan: Plan) -> Plan:
    """The plan plus one more kernel per output: out = out * 1.25 + 1 in place (a wrong epilogue).

    Wrong relative to the output's own scale: a plain ``+ 1`` is invisible on outputs such as an
    attention mask (0 or -65504 in fp16: relative error ~1e-5, under fp16's tolerance)."""
    from fusec.codegen import specs as S
    from fusec.codegen.elementwise import Apply, Const, In
    from fusec.codegen.kernels import build
    from fusec.dtypes import DType
    from fusec.ops import Op

    m = dict(plan.manifest)
    blobs = plan.blobs()
    modules, kernels, launches = list(m["modules"]), list(m["kernels"]), list(m["launches"])
    for out in m["outputs"]:
        dt, shape = DType(out["dtype"]), tuple(out["shape"])
        wrong = Apply(Op.ADD, (Apply(Op.MUL, (In(0), Const(1.25, dt))), Const(1.0, dt)))
        spec = S.elementwise_spec(wrong, [shape], [dt], shape, vectorize=False)
        ck = build(spec, plan.arch)
        mid = f"m{len(modules)}"
        blobs[f"cubin/{mid}"], blobs[f"source/{mid}"] = ck.cubin, ck.source.encode()
        modules.append({"id": mid, "cubin": f"cubin/{mid}", "source": f"source/{mid}", "entry": ck.name, "template": ck.template})
        kernels.append({"module": mid, "entry": ck.name, "smem": ck.shared_mem})
        ptr = ["ptr", "arena", out["offset"]]
        launches.append({"type": "kernel", "kernel": len(kernels) - 1, "grid": list(ck.grid), "block": list(ck.block),
                         "smem": ck.shared_mem, "args": [ptr, ptr], "label": "injected wrong epilogue"})
    m.update(modules=modules, kernels=kernels, launches=launches)
    return Plan(m, blobs, cuda_graph=plan.cuda_graph)


class WrongRunner(GpuRunner):
    """The fused variant gets an injected wrong kernel and reports a 1000x better time than measured
    (10x was not enough: a tiny transpose-flag GEMM measured 11x slower than its default on an H100)."""

    def build(self, model: Any, **kw: Any) -> Any:
        plan = super().build(model, **kw)
        if _is_fused(kw):
            plan = _add_one_to_outputs(plan)
            plan.wrong = True  # on the object, not in the manifest (which is validated strictly)
        return plan

    def time(self, plan: Any, cuda_graph: bool, iters: int) -> dict[str, Any]:
        t = super().time(plan, cuda_graph, iters)
        if getattr(plan, "wrong", False):
            t = {**t, **{k: t[k] * 1e-3 for k in ("median_ms", "p10_ms", "p90_ms")}}
        return t


class SlowRunner(GpuRunner):
    """The fused variant runs its whole launch list 32 times (same results: region inputs are
    pinned, every intermediate is recomputed), so it is correct and clearly slower. 8 times was
    not always enough: a 16x64x256 product with its epilogue in one fusec GEMM launch, run 8 times
    in a CUDA graph, once measured 0.029 ms against the unfused cuBLAS product and epilogue's 0.037
    (H200, twenty-eighth session)."""

    def build(self, model: Any, **kw: Any) -> Any:
        plan = super().build(model, **kw)
        if _is_fused(kw):
            m = dict(plan.manifest)
            m["launches"] = list(m["launches"]) * 32
            plan = Plan(m, plan.blobs(), cuda_graph=plan.cuda_graph)
        return plan


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_wrong_kernel_rejected_on_numerics_even_when_faster(cuda_graph: bool) -> None:
    led = fusec.ab.run(MODEL, dtype="fp16", cuda_graph=cuda_graph, candidates=["choice", "elementwise"],
                       runner=WrongRunner(), use_cache=False, whole_plan=False, iters=30)
    assert led.entries
    for e in led.entries:
        assert e.fused is not None and e.unfused is not None, (e.key, e.decision, e.reason)
        assert e.fused["median_ms"] < e.unfused["median_ms"], e  # it looks faster ...
        assert e.decision == UNFUSED and "numerics" in e.reason and e.max_error > TOLERANCE["fp16"], e  # ... and loses


def test_slowed_variant_rejected_on_time() -> None:
    led = fusec.ab.run(MODEL, dtype="fp16", cuda_graph=True, candidates=["choice", "elementwise"],
                       runner=SlowRunner(), use_cache=False, whole_plan=False, iters=50)
    assert led.entries
    for e in led.entries:
        assert e.max_error is not None and e.max_error <= TOLERANCE["fp16"], e
        assert e.decision == UNFUSED and "slower" in e.reason and e.fused["median_ms"] > e.unfused["median_ms"], e


def test_gpt2_tiny_ledger_measures_the_fusions_that_are_one_kernel(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    led = fusec.ab.run(MODEL, dtype="fp16")
    # the whole MLP (fusec.lower.mlp: one kernel) is measured against the unfused form and decided on
    # that evidence; a norm + GEMM has no kernel at M = 16 (the skinny product's, M <= 16, takes it
    # only where the norm is an RMSNorm): declined at fusion, never measured
    (mlp,) = [e for e in led.entries if e.rule == "mlp"]
    assert mlp.count == 2 and mlp.ops.count("matmul") == 2 and mlp.rule_default == "unfused", mlp
    assert mlp.decision in (FUSED, UNFUSED) and mlp.fused and mlp.unfused, mlp
    assert mlp.max_error is not None and mlp.max_error <= TOLERANCE["fp16"], mlp
    assert ("faster" in mlp.reason) == (mlp.decision == FUSED), mlp.reason
    assert not [e for e in led.entries if e.rule == "norm_gemm"]
    epi = [e for e in led.entries if e.rule == "gemm_epilogue"]
    assert epi and any(len(e.applies_to) == 2 for e in epi)
    for e in epi:
        assert e.decision in (FUSED, UNFUSED) and e.fused and e.unfused and e.max_error is not None, e
    assert all(e.decision in (FUSED, UNFUSED) for e in led.entries), [e.reason for e in led.entries]
    w = led.whole_plan
    assert w and all(w[k]["median_ms"] > 0 for k in ("rule_based", "unfused", "assembled"))
    assert w["kept"] in ("assembled", "rule_based") and "gemm_epilogue" in led.to_table()
    # the decisions compile into a plan that computes what the rule-based plan computes
    runner = GpuRunner()
    rule = runner.build(MODEL, dtype="fp16", cuda_graph=True)
    asm = runner.build(MODEL, dtype="fp16", cuda_graph=True, overrides=led.overrides(), choices=led.choices())
    inputs = runner.inputs(rule, int(np.random.default_rng(20261123).integers(1 << 30)))
    assert rel_error(runner.outputs(asm, inputs), runner.outputs(rule, inputs)) <= 2e-2


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_kernel_choice_variants_match_cublas(dtype: str) -> None:
    from fusec.builder import GraphBuilder
    from fusec.dtypes import DType
    from fusec.ops import Op

    rng = np.random.default_rng(20261124)
    b = GraphBuilder("choice")
    x = b.input("x", (4, 96), DType.F32)
    r = b.input("r", (4, 160), DType.F32)
    w = b.const((rng.standard_normal((96, 160)) * 0.1).astype(np.float32), name="w")
    bias = b.const(rng.standard_normal(160).astype(np.float32), name="bias")
    y = b.emit(Op.ADD, b.emit(Op.SILU, b.emit(Op.ADD, b.emit(Op.MATMUL, x, w), bias)), r)
    b.output(y, "y")
    g = b.build()
    runner = GpuRunner()
    base = runner.build(g, dtype=dtype, cuda_graph=False)
    inputs = runner.inputs(base, int(rng.integers(1 << 30)))
    want = runner.outputs(base, inputs)
    storage = {"fp16": "f16", "bf16": "bf16", "fp32": "f32"}[dtype]
    key = f"gemm_epilogue:{storage}:4x160x96:bias+silu+res"
    for variant in ("fusec_gemm", "gemv"):
        plan = runner.build(g, dtype=dtype, cuda_graph=False, choices={key: variant})
        assert plan.manifest["report"]["lowering"]["choices"]["applied"] == {key: variant}
        assert rel_error(runner.outputs(plan, inputs), want) <= TOLERANCE[dtype] * 5, variant
