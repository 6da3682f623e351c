"""Training on the reference backend: the intent/slot encoder's whole-model gradient against finite
differences, training steps against PyTorch fp32 on the CPU, checkpoints, and bad input."""

from __future__ import annotations

import numpy as np
import pytest

import fusec
from fusec import reference
from fusec.autodiff import grad_graph
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.errors import InputError, ModelError
from fusec.models.train_bert import EncoderConfig
from fusec.models.train_tasks import IntentSlotModel, SequenceClassifier
from fusec.ops import Op
from fusec.passes import precision
from fusec.passes.base import PassOptions
from fusec.train.blocks import TrainBlocks, layout
from fusec.train.graphs import OptimConfig, num_params

CFG = EncoderConfig(vocab_size=40, hidden=16, layers=2, heads=2, ffn=24, max_positions=7)
OPT = OptimConfig(lr=1e-2, total_steps=8, warmup_steps=2, schedule="linear", max_grad_norm=0.5)


def make_batch(rng: np.random.Generator, bsz: int = 3, seq: int = 7, vocab: int = 40) -> dict[str, np.ndarray]:
    ids = rng.integers(3, vocab, (bsz, seq))
    mask = np.ones((bsz, seq), np.int64)
    mask[1, 4:] = 0
    ids[1, 4:] = 0
    slots = rng.integers(0, 5, (bsz, seq))
    slots[:, 0] = -100
    slots[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "intent_labels": rng.integers(0, 3, bsz), "slot_labels": slots}


@pytest.fixture(scope="module")
def model() -> IntentSlotModel:
    return IntentSlotModel(CFG, 3, 5)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # precision's clip limit for f64
def test_intent_slot_whole_model_gradient_matches_finite_differences(model: IntentSlotModel) -> None:
    """d loss / d params of the whole encoder (float64): the backward graph against central
    differences along random directions and at single coordinates of every kind of parameter."""
    bsz = 2
    b = GraphBuilder("loss")
    flat = b.input("params", (num_params(model),), DType.F32)
    feats = {n: b.input(n, s, d) for n, s, d in model.feature_inputs(bsz)}
    labels = {n: b.input(n, s, d) for n, s, d in model.label_inputs(bsz)}
    m = TrainBlocks(b, model.specs, flat=flat)
    b.output(model.loss(m, model.forward(m, feats), labels), "loss")
    g64 = precision.run(b.build(), PassOptions(storage_dtype="f64")).graph
    gg, names = grad_graph(g64, "loss", ["params"])
    rng = np.random.default_rng(5)
    batch = {k: v[:bsz] for k, v in make_batch(rng).items()}
    p = rng.standard_normal(num_params(model)) * 0.3
    grad = reference.run(gg, {"params": p, **batch})[names["params"]]

    def loss(x: np.ndarray) -> float:
        return float(reference.run(g64, {"params": x, **batch})["loss"])

    eps = 1e-6
    for _ in range(6):
        u = rng.standard_normal(p.shape)
        fd = (loss(p + eps * u) - loss(p - eps * u)) / (2 * eps)
        assert grad @ u == pytest.approx(fd, rel=1e-6, abs=1e-9)
    at = {name: off for name, (off, _) in layout(model.specs).items()}
    for s_off in [at["embeddings.word_embeddings.weight"] + 16 * 5 + 1, at["embeddings.position_embeddings.weight"] + 3,
                  at["encoder.layer.1.attention.self.key.weight"] + 5, at["encoder.layer.0.output.LayerNorm.weight"],
                  at["slot_classifier.bias"] + 2, at["intent_classifier.weight"]]:
        e = np.zeros_like(p)
        e[s_off] = 1.0
        fd = (loss(p + eps * e) - loss(p - eps * e)) / (2 * eps)
        assert grad[s_off] == pytest.approx(fd, rel=1e-5, abs=1e-9)


def test_reference_training_matches_pytorch_fp32_on_the_cpu(model: IntentSlotModel) -> None:
    torch = pytest.importorskip("torch")
    from fusec.train import torch_model as TM

    torch.manual_seed(0)
    plan = fusec.compile_training(model, batch=3, optim=OPT, backend="reference")
    assert plan.backend == "reference"
    plan.init(11)
    module = TM.build(model, plan.params())
    adam, sched = TM.optimizer(module, model, OPT)
    rng = np.random.default_rng(3)
    batches = [make_batch(rng) for _ in range(2)] * 3
    want = []
    for bt in batches:
        plan.step(bt)
        want.append(float(TM.train_step(module, adam, sched, {k: torch.from_numpy(v) for k, v in bt.items()}, OPT).detach()))
    got = plan.losses()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[4] < got[0] and got[5] < got[1]  # it learns: the same two batches, a lower loss each time
    params = plan.params()
    for s in model.specs:
        np.testing.assert_allclose(params[s.name], module.p(s.name).detach().numpy(), rtol=1e-4, atol=2e-5,
                                   err_msg=s.name)
    assert plan.steps_taken == 6


def test_init_is_seeded_and_follows_the_specs(model: IntentSlotModel) -> None:
    plan = fusec.compile_training(model, batch=3, optim=OPT, backend="reference")
    plan.init(1)
    a = plan.params()
    plan.init(1)
    b = plan.params()
    plan.init(2)
    c = plan.params()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    w = a["encoder.layer.0.attention.self.query.weight"]
    assert not np.array_equal(w, c["encoder.layer.0.attention.self.query.weight"])
    assert abs(w.std() - 0.02) < 0.004 and np.abs(w).max() <= 0.02 * np.sqrt(3) + 1e-7
    assert np.all(a["embeddings.LayerNorm.weight"] == 1) and np.all(a["slot_classifier.bias"] == 0)


def test_checkpoint_resume_continues_exactly(model: IntentSlotModel, tmp_path) -> None:
    rng = np.random.default_rng(4)
    batches = [make_batch(rng) for _ in range(4)]
    straight = fusec.compile_training(model, batch=3, optim=OPT, backend="reference")
    straight.init(3)
    for bt in batches:
        straight.step(bt)
    first = fusec.compile_training(model, batch=3, optim=OPT, backend="reference")
    first.init(3)
    for bt in batches[:2]:
        first.step(bt)
    first.save(tmp_path / "ck.safetensors", meta={"note": "half way"})
    second = fusec.compile_training(model, batch=3, optim=OPT, backend="reference")
    info = second.load(tmp_path / "ck.safetensors")
    assert info["note"] == "half way" and second.steps_taken == 2
    for bt in batches[2:]:
        second.step(bt)
    np.testing.assert_array_equal(second.losses(), straight.losses()[2:])
    assert all(np.array_equal(v, straight.params()[k]) for k, v in second.params().items())


def test_bf16_training_on_the_reference_is_close_to_fp32(model: IntentSlotModel) -> None:
    rng = np.random.default_rng(6)
    batches = [make_batch(rng) for _ in range(3)]
    losses = {}
    for dt in ("fp32", "bf16"):
        plan = fusec.compile_training(model, batch=3, dtype=dt, optim=OPT, backend="reference")
        plan.init(5)
        for bt in batches:
            plan.step(bt)
        losses[dt] = plan.losses()
    assert np.all(np.isfinite(losses["bf16"]))
    np.testing.assert_allclose(losses["bf16"], losses["fp32"], rtol=3e-2)


# ---- bad input: one line naming what is wrong ----------------------------------------------------

@pytest.fixture(scope="module")
def plan(model: IntentSlotModel):  # noqa: ANN201
    p = fusec.compile_training(model, batch=3, optim=OPT, backend="reference")
    p.init(0)
    return p


def test_labels_out_of_range(plan) -> None:  # noqa: ANN001
    bt = make_batch(np.random.default_rng(0))
    bt["slot_labels"][2, 3] = 5
    with pytest.raises(InputError, match=r"batch 'slot_labels': label out of range \[0, 5\) \(or -100 to ignore\): 5"):
        plan.step(bt)
    bt = make_batch(np.random.default_rng(0))
    bt["input_ids"][0, 1] = 40
    with pytest.raises(InputError, match=r"batch 'input_ids': token id out of range \[0, 40\): 40"):
        plan.step(bt)


def test_batch_of_the_wrong_shape(plan) -> None:  # noqa: ANN001
    bt = make_batch(np.random.default_rng(0), bsz=4)
    with pytest.raises(InputError, match=r"batch 'input_ids': expected shape \[3, 7\], got \[4, 7\]"):
        plan.step(bt)
    bt = make_batch(np.random.default_rng(0))
    del bt["intent_labels"]
    with pytest.raises(InputError, match="missing 'intent_labels'"):
        plan.step(bt)
    bt = make_batch(np.random.default_rng(0))
    bt["attention_mask"] = bt["attention_mask"].astype(np.float32)
    with pytest.raises(InputError, match="batch 'attention_mask': expected integers"):
        plan.step(bt)


def test_checkpoint_of_another_model(plan, tmp_path) -> None:  # noqa: ANN001
    other = IntentSlotModel(EncoderConfig(vocab_size=40, hidden=8, layers=1, heads=2, ffn=8, max_positions=7), 3, 5)
    op = fusec.compile_training(other, batch=3, optim=OPT, backend="reference")
    op.init(0)
    op.save(tmp_path / "other.safetensors")
    with pytest.raises(ModelError, match=r"is of another model \(config.ffn: 8 in the checkpoint, 24 in the plan\)"):
        plan.load(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ModelError, match="is not a fusec training checkpoint"):
        plan.load(tmp_path / "junk.safetensors")


class _NoLabels(IntentSlotModel):
    labels = ()


class _RopeModel(IntentSlotModel):
    def forward(self, m, feats):  # noqa: ANN001, ANN201
        out = super().forward(m, feats)
        x = out["slot_labels"]
        cos = m.b.const(np.ones((1, 1, x.shape[-1] - 1), np.float32), "cos")
        return {**out, "slot_labels": m.op(Op.ROPE, x, cos, cos, rotary_dim=x.shape[-1] - 1)}


def test_a_model_with_no_loss_and_an_op_without_a_gradient_rule() -> None:
    nl = _NoLabels(CFG, 3, 5)
    nl.labels = ()
    with pytest.raises(ModelError, match="has no loss: it declares no labels"):
        fusec.compile_training(nl, batch=3, optim=OPT, backend="reference")
    with pytest.raises(ModelError, match=r"op rope has no gradient rule, and the loss depends on node rope"):
        fusec.compile_training(_RopeModel(EncoderConfig(vocab_size=40, hidden=16, layers=1, heads=2, ffn=8,
                                                        max_positions=7), 3, 5), batch=3, optim=OPT, backend="reference")


def test_sequence_classifier_trains_on_the_reference() -> None:
    cfg = EncoderConfig(vocab_size=30, hidden=8, layers=1, heads=2, ffn=8, max_positions=12, type_vocab_size=2)
    clf = SequenceClassifier(cfg, 2, seq=6)
    plan = fusec.compile_training(clf, batch=4, optim=OptimConfig(lr=3e-2, schedule="constant", max_grad_norm=0),
                                  backend="reference")
    plan.init(0)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 30, (4, 6))
    bt = {"input_ids": ids, "attention_mask": np.ones((4, 6), np.int64), "labels": np.array([0, 1, 0, 1])}
    for _ in range(15):
        plan.step(bt)
    losses = plan.losses()
    assert losses[-1] < 0.5 * losses[0]
    assert plan.evaluate([(bt, 4)])["labels.accuracy"] == 1.0
