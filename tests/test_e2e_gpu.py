"""End to end on a GPU: compiled plans of the built-in models match the numpy reference, CUDA-graph
replay is bitwise equal to eager launches, and a run allocates, syncs and copies nothing beyond
the caller's inputs."""

from __future__ import annotations

import numpy as np
import pytest

import fusec
from fusec import reference
from fusec.inputs import random_inputs
from fusec.loader import load_graph

pytestmark = pytest.mark.gpu

TOL = {"fp32": 1e-4, "tf32": 5e-3, "fp16": 2e-2, "bf16": 5e-2}
MODELS = ["gpt2-tiny", "bert-tiny", "llama-tiny", "qwen3-tiny"]


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _to_host(arr, dtype: str) -> np.ndarray:
    import cupy

    host = cupy.asnumpy(arr)
    if dtype == "bf16":
        from fusec.dtypes import DType

        host = host.view(DType.BF16.np)
    return host.astype(np.float32)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_model_matches_reference(model: str, dtype: str) -> None:
    graph = load_graph(model)
    inputs = random_inputs(graph, seed=int(np.random.default_rng(20261123).integers(1 << 30)))
    if "attention_mask" in inputs:  # pad the end of the first row
        mask = inputs["attention_mask"].copy()
        mask[0, mask.shape[1] // 2:] = 0
        inputs["attention_mask"] = mask
    want = reference.run(graph, inputs)
    plan = fusec.compile(model, dtype=dtype)
    got = plan.run(inputs, measure=True)
    for name, ref in want.items():
        out = _to_host(got[name], dtype)
        if "attention_mask" in inputs and out.ndim >= 2:
            keep = inputs["attention_mask"].astype(bool)  # padded query rows are unspecified
            out, ref = out[keep], ref[keep]
        assert np.isfinite(out).all(), f"{model} {dtype} {name}: non-finite values"
        err = _rel(out, ref)
        assert err < TOL[dtype], f"{model} {dtype} {name}: relative error {err:.2e}"
    s = plan.stats()
    staged = sum(np.asarray(v).nbytes for v in inputs.values())
    assert s["pool_allocations"] == 0 and s["staged_h2d_bytes"] == staged
    if s["counters"] == "cupti":
        assert s["syncs"] == 0 and s["allocations"] == 0 and s["d2h_bytes"] == 0 and s["h2d_bytes"] == staged


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_cuda_graph_replay_is_bitwise_equal_to_eager(model: str) -> None:
    import cupy

    graph = load_graph(model)
    inputs = random_inputs(graph, seed=3)
    eager = fusec.compile(model, dtype="fp16")
    replay = fusec.compile(model, dtype="fp16", cuda_graph=True)
    a = {k: cupy.asnumpy(v) for k, v in eager.run(inputs).items()}
    b = {k: cupy.asnumpy(v) for k, v in replay.run(inputs).items()}
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{model}: output {k} differs between graph replay and eager"
    assert replay.stats()["graph_replays"] == 1 and replay.stats()["pool_allocations"] == 0


def test_saved_plan_runs_after_load(tmp_path) -> None:
    import cupy

    plan = fusec.compile("bert-tiny", dtype="fp32")
    path = tmp_path / "b.fplan"
    plan.save(path)
    graph = load_graph("bert-tiny")
    inputs = random_inputs(graph, seed=5)
    a = cupy.asnumpy(plan.run(inputs)["last_hidden_state"])
    b = cupy.asnumpy(fusec.load(path).run(inputs)["last_hidden_state"])
    assert np.array_equal(a, b)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "gemma",
                                    "bert", "roberta", "distilbert"])
def test_hf_export_runs_on_the_gpu(family: str, exporter: str, dtype: str) -> None:
    from hf_models import export_hf

    path, inputs, _ = export_hf(family, exporter)
    shapes = {k: v.shape for k, v in inputs.items()}
    graph = load_graph(path, shapes)
    want = reference.run(graph, inputs)
    got = fusec.compile(path, shapes=shapes, dtype=dtype).run(inputs)
    keep = inputs["attention_mask"].astype(bool)
    for name, ref in want.items():
        out = _to_host(got[name], dtype)[keep]
        assert np.isfinite(out).all(), f"{family}/{exporter} {dtype}: non-finite values"
        err = _rel(out, ref[keep])
        assert err < TOL[dtype], f"{family}/{exporter} {dtype} {name}: relative error {err:.2e}"


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("fp16", 2e-3)])
def test_padded_odd_n_gemm_matches_reference(dtype: str, tol: float) -> None:
    from test_lowering import _odd_n_graph

    from fusec.dtypes import DType

    dt = DType.F32 if dtype == "fp32" else DType.F16
    graph = _odd_n_graph(dt)
    x = np.random.default_rng(20261124).standard_normal(graph.inputs[0].shape).astype(dt.np)
    want = reference.run(graph, {"x": x})["y"].astype(np.float32)
    got = _to_host(fusec.compile(graph, dtype=dtype).run({"x": x})["y"], dtype)
    assert _rel(got, want) < tol


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-5), ("fp16", 2e-3)])
def test_standalone_attention_with_a_fully_masked_row(dtype: str, tol: float) -> None:
    from test_lowering import _attention_graph

    from fusec.dtypes import DType

    dt = DType.F32 if dtype == "fp32" else DType.F16
    graph = _attention_graph(dt)
    rng = np.random.default_rng(20261125)
    x = {n: rng.standard_normal(s).astype(dt.np) for n, s in (("q", (2, 4, 8, 32)), ("k", (2, 2, 8, 32)),
                                                             ("v", (2, 2, 8, 32)))}
    want = reference.run(graph, x)["o"].astype(np.float32)
    got = _to_host(fusec.compile(graph, dtype=dtype).run(x)["o"], dtype)
    assert np.isfinite(got).all() and (got[1, :, 3] == 0).all()
    assert _rel(got, want) < tol
