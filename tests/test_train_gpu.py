"""Training plans on the GPU against the reference engine: the same init (bit for bit), the same
losses and parameters after several fp32 steps, bf16 sanity, predictions, and what the driver
does during a step (0 syncs, 0 allocations, only the batch copied in)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import fusec
from fusec.models.train_bert import EncoderConfig
from fusec.models.train_tasks import IntentSlotModel, SequenceClassifier
from fusec.train.graphs import OptimConfig
from fusec.train.plan import gpu_available

pytestmark = pytest.mark.gpu
if not gpu_available():
    pytest.skip("no CUDA GPU found (CuPy sees no device)", allow_module_level=True)

CFG = EncoderConfig(vocab_size=60, hidden=32, layers=2, heads=4, ffn=64, max_positions=12)
OPT = OptimConfig(lr=5e-3, total_steps=20, warmup_steps=2, schedule="cosine", max_grad_norm=1.0)


@pytest.fixture(autouse=True, scope="module")
def _private_kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSEC_CACHE_DIR", str(tmp_path_factory.mktemp("kernels")))
        yield


def make_batch(rng: np.random.Generator, bsz: int = 8, seq: int = 12, vocab: int = 60) -> dict[str, np.ndarray]:
    ids = rng.integers(3, vocab, (bsz, seq))
    lengths = rng.integers(4, seq + 1, bsz)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
    ids[mask == 0] = 0
    slots = rng.integers(0, 7, (bsz, seq))
    slots[:, 0] = -100
    slots[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "intent_labels": rng.integers(0, 5, bsz), "slot_labels": slots}


def _pair(dtype: str) -> tuple[Any, Any]:
    model = IntentSlotModel(CFG, 5, 7)
    gpu = fusec.compile_training(model, batch=8, dtype=dtype, optim=OPT, backend="cuda")
    ref = fusec.compile_training(model, batch=8, dtype=dtype, optim=OPT, backend="reference")
    gpu.init(9)
    ref.init(9)
    return gpu, ref


def test_fp32_steps_match_the_reference() -> None:
    gpu, ref = _pair("fp32")
    assert gpu.backend == "cuda"
    for k, v in ref.params().items():  # the init kernel is the reference's, bit for bit
        np.testing.assert_array_equal(gpu.params()[k], v, err_msg=k)
    rng = np.random.default_rng(1)
    batches = [make_batch(rng) for _ in range(3)] * 3
    for bt in batches:
        gpu.step(bt)
        ref.step(bt)
    np.testing.assert_allclose(gpu.losses(), ref.losses(), rtol=1e-5)
    assert gpu.steps_taken == ref.steps_taken == len(batches)
    got, want = gpu.params(), ref.params()
    for k in want:  # AdamW amplifies rounding where a gradient is near 0 (m / sqrt(v) ~ +-1): atol ~ lr / 100
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=5e-5, err_msg=k)
        if k.endswith("attention.self.key.bias"):
            # its exact gradient is 0 (q.(k + b) adds one constant to every score of a row, which the
            # softmax cancels): both sides step on rounding noise, which AdamW scales to +-lr
            continue
        assert np.mean(np.abs(got[k] - want[k]) <= 1e-6 + 1e-4 * np.abs(want[k])) > 0.99, k
    feats = {k: batches[0][k] for k in ("input_ids", "attention_mask")}
    pg, pr = gpu.predict(feats), ref.predict(feats)
    assert (pg["intent_labels"] == pr["intent_labels"]).all()
    assert (pg["slot_labels"] == pr["slot_labels"]).mean() > 0.99


def test_bf16_with_fp32_master_weights_trains() -> None:
    gpu, ref = _pair("bf16")
    rng = np.random.default_rng(2)
    batches = [make_batch(rng) for _ in range(2)] * 4
    for bt in batches:
        gpu.step(bt)
        ref.step(bt)
    lg, lr = gpu.losses(), ref.losses()
    assert np.all(np.isfinite(lg))
    np.testing.assert_allclose(lg, lr, rtol=2e-2)
    assert lg[-2] < lg[0] and lg[-1] < lg[1]
    assert gpu.params()["embeddings.word_embeddings.weight"].dtype == np.float32


def test_a_step_syncs_nothing_allocates_nothing_and_copies_only_the_batch() -> None:
    gpu, _ = _pair("fp32")
    bt = make_batch(np.random.default_rng(3))
    checked = gpu.check_batch(bt)
    gpu.engine.train_step(checked)  # warm
    gpu.engine.train_step(checked, measure=True)
    s = gpu.stats()
    if s.get("counters") != "cupti":
        pytest.skip(f"driver counters unavailable: {s.get('counters')}")
    assert s["syncs"] == 0 and s["allocations"] == 0, s
    assert s["h2d_bytes"] == sum(a.nbytes for a in checked.values()), s
    assert s["d2h_bytes"] == 0 and s["graph_launches"] == 1 and s["kernel_launches"] == 0, s
    assert s["pool_allocations"] == 0


def test_checkpoint_moves_between_backends(tmp_path) -> None:
    gpu, ref = _pair("fp32")
    bt = make_batch(np.random.default_rng(4))
    gpu.step(bt)
    gpu.save(tmp_path / "ck.safetensors")
    ref.load(tmp_path / "ck.safetensors")
    for k, v in gpu.params().items():
        np.testing.assert_array_equal(ref.params()[k], v)
    gpu.step(bt)
    ref.step(bt)
    np.testing.assert_allclose(gpu.losses()[-1], ref.losses()[-1], rtol=1e-5)


def test_sequence_classifier_on_the_gpu_matches_the_reference() -> None:
    cfg = EncoderConfig(vocab_size=80, hidden=32, layers=1, heads=2, ffn=64, max_positions=32, type_vocab_size=2)
    model = SequenceClassifier(cfg, 3, seq=16)
    opt = OptimConfig(lr=1e-3, schedule="linear", total_steps=10)
    gpu = fusec.compile_training(model, batch=4, optim=opt, backend="cuda")
    ref = fusec.compile_training(model, batch=4, optim=opt, backend="reference")
    gpu.init(0)
    ref.init(0)
    rng = np.random.default_rng(5)
    bt = {"input_ids": rng.integers(1, 80, (4, 16)), "attention_mask": np.ones((4, 16), np.int64),
          "labels": np.array([0, 1, 2, 1])}
    for _ in range(4):
        gpu.step(bt)
        ref.step(bt)
    np.testing.assert_allclose(gpu.losses(), ref.losses(), rtol=1e-5)


def test_fusec_train_on_the_gpu_writes_a_model_fusec_runs(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import os

    from fusec.cli import main
    from fusec.train import atis_like

    atis_like.main(["-o", str(tmp_path), "--train", "256", "--heldout", "64"])
    capsys.readouterr()  # the generator's own line
    out = str(tmp_path / "model")
    code = main(["train", "intent-slot", "--data", str(tmp_path / "train.jsonl"), "--eval", str(tmp_path / "heldout.jsonl"),
                 "--epochs", "2", "--batch", "32", "--backend", "cuda", "-o", out])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    assert "reference" not in err and "cuda" in err
    assert json.loads(stdout)["epoch"] == 2 and os.path.isfile(os.path.join(out, "checkpoint.safetensors"))
    assert main(["run", out, "--check"]) == 0  # the trained model compiled and run on the GPU, checked against numpy


def _op_graph(op: str) -> tuple[Any, dict[str, np.ndarray]]:
    """A small graph around one training op (or a gradient product), and inputs for it."""
    from fusec.builder import GraphBuilder
    from fusec.dtypes import DType
    from fusec.ops import Op

    rng = np.random.default_rng(7)
    b = GraphBuilder(op)
    f32, i64 = DType.F32, DType.I64
    if op.startswith("matmul"):
        ta, tb = "ta" in op, "tb" in op
        a = b.input("a", (3, 37, 29) if ta else (3, 29, 37), f32)
        w = b.input("w", (3, 41, 37) if tb else (3, 37, 41), f32)
        b.output(b.emit(Op.MATMUL, a, w, trans_a=ta, trans_b=tb), "y")
        feed = {"a": rng.standard_normal(a.shape), "w": rng.standard_normal(w.shape)}
    elif op == "cross_entropy":
        x, y = b.input("x", (6, 9, 13), f32), b.input("y", (6, 9), i64)
        g = b.input("g", (6, 9), f32)
        b.output(b.emit(Op.CROSS_ENTROPY, x, y), "loss")
        b.output(b.emit(Op.CROSS_ENTROPY_GRAD, x, y, g, ignore_index=-100), "dx")
        labels = rng.integers(0, 13, (6, 9))
        labels[0, :3] = -100
        feed = {"x": rng.standard_normal(x.shape) * 3, "y": labels, "g": rng.standard_normal(g.shape)}
    elif op == "scatter_add":
        u, i = b.input("u", (5, 11, 24), f32), b.input("i", (5, 11), i64)
        b.output(b.emit(Op.SCATTER_ADD, u, i, axis=0, size=40), "out")
        feed = {"u": rng.standard_normal(u.shape), "i": rng.integers(-40, 40, i.shape)}
    elif op == "softmax_grad":
        p, d = b.input("p", (4, 3, 17, 50), f32), b.input("d", (4, 3, 17, 50), f32)
        b.output(b.emit(Op.SOFTMAX_GRAD, p, d, axis=3, scale=0.125), "dx")
        feed = {"p": rng.random(p.shape), "d": rng.standard_normal(d.shape)}
    elif op == "layernorm_grad":
        x, s, d = b.input("x", (7, 9, 96), f32), b.input("s", (96,), f32), b.input("d", (7, 9, 96), f32)
        dx, dxh = b.emit(Op.LAYERNORM_GRAD, x, s, d, axis=2, eps=1e-5)
        b.output(dx, "dx")
        b.output(dxh, "dxhat")
        feed = {"x": rng.standard_normal(x.shape), "s": rng.standard_normal(96), "d": rng.standard_normal(d.shape)}
    else:
        raise ValueError(op)
    return b.build(), {k: np.asarray(v, np.float32 if v.dtype.kind == "f" else np.int64) for k, v in feed.items()}


@pytest.mark.parametrize("op", ["matmul", "matmul_ta", "matmul_tb", "matmul_ta_tb", "cross_entropy", "scatter_add",
                                "softmax_grad", "layernorm_grad"])
def test_training_ops_on_the_gpu_match_the_reference(op: str) -> None:
    from fusec import reference

    graph, feed = _op_graph(op)
    plan = fusec.compile(graph, dtype="fp32", fp32_gemm="sgemm")
    got = {k: v.get() for k, v in plan.run(feed).items()}
    want = reference.run(graph, feed)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=2e-5, atol=2e-5, err_msg=f"{op}: {k}")
