"""Issue 12's vision/audio families, tiny random HF models exported by both torch exporters
(tests/vision_models.py): ViT, CLIP's vision and text towers, Whisper's encoder; and two
convolutional networks (ResNet, ConvNeXt) for the conv and pooling lowerings.

On the CPU: fusec's numpy reference matches onnxruntime and torch; the model compiles for sm_90
(NVRTC) with attention recognized once per layer; the patch-embedding Conv is a GEMM (no im2col
gather) and Whisper's Conv1d an im2col gather + GEMM. On a GPU (``gpu`` mark): the compiled plan
matches onnxruntime in fp32 and fp16."""

from __future__ import annotations

import numpy as np
import pytest
from graph_checks import run_plan
from vision_models import EXPORTERS, FAMILIES, export_family, torch_forward

import fusec
from fusec import reference
from fusec.loader import load_graph
from fusec.ops import Op

TOL = {"fp32": 1e-4, "fp16": 2e-2}
# (family, exporter, attention implementation): sdpa only where the family has attention
CASES = [(f, ex, attn) for f, fam in FAMILIES.items() for ex in EXPORTERS
         for attn in (("eager", "sdpa") if fam.layers else ("eager",))]


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _keep(inputs: dict[str, np.ndarray]) -> np.ndarray | None:
    """Positions to compare: the text tower's padded tokens are not meaningful outputs."""
    return inputs["attention_mask"].astype(bool) if "attention_mask" in inputs else None


def _ort(path: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"]).run(None, inputs)[0]


@pytest.mark.parametrize("family,exporter,attn", CASES)
def test_reference_matches_onnxruntime_and_torch(family: str, exporter: str, attn: str) -> None:
    path, inputs, model = export_family(family, exporter, attn)
    graph = load_graph(path, {k: v.shape for k, v in inputs.items()})
    got = reference.run(graph, inputs)[FAMILIES[family].output]
    keep = _keep(inputs)
    for name, want in (("onnxruntime", _ort(path, inputs)), ("torch", torch_forward(family, model, inputs))):
        assert got.shape == want.shape, name
        a, b = (got[keep], want[keep]) if keep is not None else (got, want)
        assert _rel(a, b) < 1e-5, f"{family}/{exporter} vs {name}: relative error {_rel(a, b):.2e}"
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("family,exporter,attn", CASES)
def test_compiles_for_sm90_with_attention_once_per_layer(family: str, exporter: str, attn: str) -> None:
    path, inputs, _ = export_family(family, exporter, attn)
    shapes = {k: v.shape for k, v in inputs.items()}
    graph = load_graph(path, shapes)
    ops = [n.op for n in graph.nodes]
    if family in ("vit", "clip_vision"):  # patch embedding: reshape/transpose + GEMM, no im2col
        assert Op.GATHER not in ops
    if family == "whisper_encoder":  # two Conv1d (k=3, padding 1): im2col gathers
        assert ops.count(Op.GATHER) == 2
    if not FAMILIES[family].layers:  # CNNs: every conv is a GEMM (3x3 ones after an im2col gather)
        assert ops.count(Op.MATMUL) >= 4 and Op.GATHER in ops
    plan = fusec.compile(path, shapes=shapes, dtype="fp16", arch="sm_90")
    assert [d["name"] for d in plan.info()["inputs"]] == list(FAMILIES[family].inputs)
    assert plan.info()["launches"] > 0
    patterns = plan.manifest["report"].get("patterns", {})
    assert patterns.get("attention", 0) == FAMILIES[family].layers, f"{family}/{exporter}: {patterns}"


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_optimized_planned_graph_keeps_the_numbers(family: str, exporter: str) -> None:
    """The graph the GPU plan is lowered from (passes, fusion, memory plan: every value in one
    arena at its planned offset) computes what the imported graph does."""
    from fusec.passes.memory_plan import plan_memory
    from fusec.passes.pipeline import optimize

    path, inputs, _ = export_family(family, exporter)
    graph = load_graph(path, {k: v.shape for k, v in inputs.items()})
    opt, _ = optimize(graph)
    out = FAMILIES[family].output
    got = reference.run_planned(opt, inputs, plan_memory(opt))[out]
    assert _rel(got, reference.run(graph, inputs)[out]) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_runs_on_the_gpu(family: str, exporter: str, dtype: str) -> None:
    import cupy

    path, inputs, _ = export_family(family, exporter)
    want = _ort(path, inputs)
    plan = fusec.compile(path, shapes={k: v.shape for k, v in inputs.items()}, dtype=dtype)
    got = cupy.asnumpy(run_plan(plan, inputs)[FAMILIES[family].output]).astype(np.float32)
    keep = _keep(inputs)
    if keep is not None:
        got, want = got[keep], want[keep]
    assert np.isfinite(got).all(), f"{family}/{exporter} {dtype}: non-finite values"
    err = _rel(got, want)
    assert err < TOL[dtype], f"{family}/{exporter} {dtype}: relative error {err:.2e} against onnxruntime"
