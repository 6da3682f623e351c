"""The GPU side of training, on the CPU: every training kernel renders and compiles with NVRTC for
sm_80 and sm_90, and a training plan lowers to a launch list whose optimizer step is three
kernels over the state region, whatever the number of parameters."""

from __future__ import annotations

import math
from typing import Any

import pytest

from fusec.codegen import kernels as K
from fusec.codegen import specs_train as T
from fusec.compiler import compile_entries
from fusec.dtypes import DType
from fusec.models.train_bert import EncoderConfig
from fusec.models.train_tasks import IntentSlotModel
from fusec.train.graphs import OptimConfig, eval_graph, init_graph, train_graph


@pytest.fixture(autouse=True, scope="module")
def _private_kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSEC_CACHE_DIR", str(tmp_path_factory.mktemp("kernels")))
        yield


def _adamw(phase: str, schedule: str, clip: float) -> T.AdamWSpec:
    return T.AdamWSpec(phase, sizes=(5000, 3, 129), grad_dtypes=(DType.F32, DType.BF16, DType.F32),
                       decay=(True, False, True), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                       schedule=schedule, warmup_steps=3 if schedule != "constant" else 0, total_steps=50,
                       max_grad_norm=clip)


SPECS = [
    T.CrossEntropySpec(37, 11, DType.F32), T.CrossEntropySpec(5, 3000, DType.BF16, DType.I32, ignore_index=-1),
    T.ScatterAddSpec(1, 96, 1000, 128, zero=True), T.ScatterAddSpec(2, 7, 5, 3, idx_dtype=DType.I32),
    T.InitSpec(((100, "uniform", 0.0346), (7, "ones", 0.0), (0, "zeros", 0.0), (9, "zeros", 0.0)), DType.F32),
    T.InitSpec(((1, "zeros", 0.0),), DType.I64),
    _adamw("norm", "linear", 1.0), _adamw("scalars", "linear", 1.0), _adamw("scalars", "cosine", 0.0),
    _adamw("scalars", "constant", 0.5), _adamw("update", "linear", 1.0), _adamw("update", "constant", 0.0),
    T.SoftmaxGradSpec(6400, 50, 1, DType.F32, 0.17677669529663687), T.SoftmaxGradSpec(3, 5, 7, DType.BF16),
    T.LayerNormGradSpec(1600, 128, DType.F32, DType.F32, 1e-12), T.LayerNormGradSpec(7, 384, DType.BF16, DType.F32, 1e-5),
    T.CrossEntropySpec(1600, 34, DType.F32, grad=True), T.CrossEntropySpec(3, 40000, DType.BF16, DType.I32, -1, grad=True),
]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("spec", SPECS, ids=[f"{type(s).__name__}-{i}" for i, s in enumerate(SPECS)])
def test_training_kernels_compile(spec: Any, arch: str) -> None:
    ck = K.build(spec, arch)
    assert ck.cubin[:4] == b"\x7fELF" and len(ck.params) >= 1
    if isinstance(spec, T.AdamWSpec) and spec.phase != "scalars":
        assert ck.grid == (spec.blocks, 1, 1) and spec.blocks == 3 + 1 + 1  # 5000 -> 3 chunks of 2048


def test_specs_refuse_what_the_kernels_cannot_do() -> None:
    with pytest.raises(ValueError, match="adamw takes 1"):
        T.AdamWSpec("update", sizes=(1,) * (T.ADAMW_MAX_SEGMENTS + 1), grad_dtypes=(DType.F32,) * (T.ADAMW_MAX_SEGMENTS + 1),
                    decay=(True,) * (T.ADAMW_MAX_SEGMENTS + 1), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.0, schedule="constant", warmup_steps=0, total_steps=0, max_grad_norm=0.0)
    with pytest.raises(ValueError, match="cross_entropy labels"):
        T.CrossEntropySpec(3, 4, DType.F32, DType.F32)


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
def test_training_plan_lowers_with_the_optimizer_as_three_kernels_over_state(dtype: DType) -> None:
    cfg = EncoderConfig(vocab_size=50, hidden=16, layers=2, heads=2, ffn=32, max_positions=8)
    model = IntentSlotModel(cfg, 3, 5)
    graphs = {"train_step": train_graph(model, 4, OptimConfig(total_steps=10), dtype), "eval": eval_graph(model, 4, dtype),
              "init": init_graph(model)}
    plan = compile_entries(graphs, dtype="fp32", arch="sm_90", cuda_graph=True)
    entries = plan.manifest["entries"]
    train = entries["train_step"]["launches"]
    kernels = plan.manifest["kernels"]
    adam = [L for L in train if L["type"] == "kernel" and kernels[L["kernel"]]["entry"].startswith("fc_adamw")]
    assert [L["label"].split(" ", 1)[1] for L in adam] == ["adamw gradient norm", "adamw step scalars", "adamw"]
    update = adam[-1]
    assert [a[1] for a in update["args"][:3]] == ["state", "state", "state"]  # params, m, v updated in place
    # one pointer per gradient, read where it lies: per layer, q/k/v weights (and biases) are one stacked tensor
    assert len(update["args"]) == 4 + len(model.specs) - 4 * cfg.layers
    assert train[-1] is update  # nothing is copied into the state after the step
    # every kernel's write set holds what it writes (the optimizer's state updated in place, its partials and
    # scalars, the layer norm's gradients): the program's dependencies are derived from them
    assert all(L["writes"] for L in train if L["type"] == "kernel"), [L["label"] for L in train if not L["writes"]]
    assert {w[0] for w in update["writes"]} == {"state"}
    assert sum(w[2] for w in update["writes"]) >= 3 * 4 * sum(math.prod(p.shape) for p in model.specs)  # params, m, v
    assert {r["name"] for r in plan.manifest["state"]} == {"params", "adam_m", "adam_v", "step"}
    assert [o["name"] for o in entries["train_step"]["outputs"]] == ["loss"]
    assert {i["name"] for i in entries["train_step"]["inputs"]} == {"input_ids", "attention_mask", "intent_labels",
                                                                     "slot_labels"}
    # products read the parameters where they are: views of the state (fp32), or of the one bf16 copy
    # of the whole vector made at the start of the step (bf16), through the transpose flag
    gemms = [L for L in train if L["type"] == "gemm"]
    assert any(L["b"][0] == ("state" if dtype == DType.F32 else "arena") and L["trans_b"] for L in gemms)
    assert not any(L["a"][0] == "weights" or L["b"][0] == "weights" for L in gemms)
    assert any(L["trans_a"] for L in gemms)  # weight gradients read the activations through the flag
    mem = plan.manifest["memory"]
    assert mem["planned_bytes"] < mem["naive_bytes"] / 2


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16])
def test_the_planned_step_computes_what_the_graph_defines(dtype: DType) -> None:
    """The optimized train_step graph (fusion, views, in-place AdamW over the state) run with every
    value at its memory-plan offset in one poisoned arena equals the unoptimized graph: no buffer
    that the backward or the optimizer still reads is reused early."""
    import numpy as np

    from fusec import reference
    from fusec.compiler import stage, state_layout

    cfg = EncoderConfig(vocab_size=50, hidden=16, layers=2, heads=2, ffn=32, max_positions=8)
    model = IntentSlotModel(cfg, 3, 5)
    graph = train_graph(model, 4, OptimConfig(total_steps=10, warmup_steps=2), dtype)
    recs, _ = state_layout(graph, "f32")
    st = stage(graph, "fp32", "sm_90", dry_run=True, state_layout={r["name"]: r["offset"] for r in recs})
    rng = np.random.default_rng(0)
    n = sum(s.numel for s in model.specs)
    ids = rng.integers(3, 50, (4, 8))
    mask = np.ones((4, 8), np.int64)
    mask[1, 5:] = 0
    slots = rng.integers(0, 5, (4, 8))
    slots[:, 0] = -100
    feed = {"input_ids": ids, "attention_mask": mask, "intent_labels": rng.integers(0, 3, 4), "slot_labels": slots,
            "params": rng.standard_normal(n).astype(np.float32) * 0.1, "adam_m": np.zeros(n, np.float32) + 1e-3,
            "adam_v": np.zeros(n, np.float32) + 1e-4, "step": np.array([4], np.int64)}
    want = reference.run(graph, feed)
    got = reference.run_planned(st.graph, feed, st.memory)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
