"""The trainable task models: a forward (logits per head), a loss and predictions, over the
BERT encoder of ``models.train_bert``.

- ``IntentSlotModel`` (``intent-slot``): the joint intent/slot encoder of issue 23's seed: a small
  BERT (vocab ~1000, d 128, 2 layers, 4 heads, ffn 512, sequence 50); the intent head reads the
  first token, the slot head every token; loss = mean intent CE + mean slot CE over real tokens
  (label -100: padding and the first token, ignored).
- ``SequenceClassifier`` (``sequence-classification``): BertForSequenceClassification: a
  checkpoint's encoder (``bert.`` names), its pooler (tanh dense over the first token) and a linear
  classifier; loss = mean CE.

Inputs of every model: ``input_ids`` and ``attention_mask`` [B, S] i64; labels are i64 inputs
of the train entry only (-100 = ignored).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fusec.dtypes import DType
from fusec.errors import ModelError
from fusec.ir import Value
from fusec.ops import Op
from fusec.train.blocks import ParamSpec, TrainBlocks

from .train_bert import EncoderConfig, _linear_specs, encoder, encoder_specs, first_token, linear, mean_ce

IGNORE = -100


@dataclasses.dataclass(frozen=True)
class LabelInput:
    name: str
    per_token: bool  # [B, S] (else [B])
    classes: int


class TaskModel:
    """The interface ``fusec.train.graphs`` builds entry points from."""

    kind: str = ""
    cfg: EncoderConfig
    seq: int
    specs: list[ParamSpec]
    labels: tuple[LabelInput, ...]

    def feature_inputs(self, batch: int) -> list[tuple[str, tuple[int, ...], DType]]:
        return [("input_ids", (batch, self.seq), DType.I64), ("attention_mask", (batch, self.seq), DType.I64)]

    def label_inputs(self, batch: int) -> list[tuple[str, tuple[int, ...], DType]]:
        return [(lab.name, (batch, self.seq) if lab.per_token else (batch,), DType.I64) for lab in self.labels]

    def forward(self, m: TrainBlocks, feats: dict[str, Value]) -> dict[str, Value]:
        raise NotImplementedError

    def loss(self, m: TrainBlocks, logits: dict[str, Value], labels: dict[str, Value]) -> Value:
        if not self.labels:
            raise ModelError(f"model {self.kind!r} has no loss: it declares no labels to train on")
        total: Value | None = None
        for lab in self.labels:
            part = mean_ce(m, logits[lab.name], labels[lab.name])
            total = part if total is None else m.op(Op.ADD, total, part)
        assert total is not None
        return total

    def predictions(self, m: TrainBlocks, logits: dict[str, Value]) -> dict[str, Value]:
        return {name: m.op(Op.ARGMAX, x, axis=len(x.shape) - 1, keepdims=False) for name, x in logits.items()}

    def describe(self) -> dict[str, Any]:
        """What identifies the model in a checkpoint (JSON)."""
        return {"kind": self.kind, "config": dataclasses.asdict(self.cfg), "seq": self.seq,
                "labels": [dataclasses.asdict(lab) for lab in self.labels]}


class IntentSlotModel(TaskModel):
    kind = "intent-slot"

    def __init__(self, cfg: EncoderConfig, n_intents: int, n_slots: int, seq: int | None = None):
        if n_intents < 1 or n_slots < 1:
            raise ModelError(f"intent-slot model: needs at least one intent and one slot label, got {n_intents} and {n_slots}")
        self.cfg, self.seq = cfg, cfg.max_positions if seq is None else seq
        d = cfg.hidden
        self.specs = encoder_specs(cfg) + _linear_specs("intent_classifier", d, n_intents, cfg.init_std) \
            + _linear_specs("slot_classifier", d, n_slots, cfg.init_std)
        self.labels = (LabelInput("intent_labels", False, n_intents), LabelInput("slot_labels", True, n_slots))

    def forward(self, m: TrainBlocks, feats: dict[str, Value]) -> dict[str, Value]:
        x = encoder(m, self.cfg, feats["input_ids"], feats["attention_mask"])
        return {"intent_labels": linear(m, first_token(m, x), "intent_classifier"),
                "slot_labels": linear(m, x, "slot_classifier")}


class SequenceClassifier(TaskModel):
    kind = "sequence-classification"

    def __init__(self, cfg: EncoderConfig, n_labels: int, seq: int):
        if n_labels < 2:
            raise ModelError(f"sequence classifier: needs at least two labels, got {n_labels}")
        self.cfg, self.seq = cfg, seq
        d = cfg.hidden
        self.specs = encoder_specs(cfg, prefix="bert.") + _linear_specs("bert.pooler.dense", d, d, cfg.init_std) \
            + _linear_specs("classifier", d, n_labels, cfg.init_std)
        self.labels = (LabelInput("labels", False, n_labels),)

    def forward(self, m: TrainBlocks, feats: dict[str, Value]) -> dict[str, Value]:
        x = encoder(m, self.cfg, feats["input_ids"], feats["attention_mask"], prefix="bert.")
        pooled = m.op(Op.TANH, linear(m, first_token(m, x), "bert.pooler.dense"))
        return {"labels": linear(m, pooled, "classifier")}


def from_description(desc: dict[str, Any]) -> TaskModel:
    """The model a checkpoint describes (``TaskModel.describe``); ModelError naming what is wrong."""
    try:
        cfg = EncoderConfig(**desc["config"])
        labels = [LabelInput(**lab) for lab in desc["labels"]]
        kind, seq = desc["kind"], int(desc["seq"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"the checkpoint's model description is malformed ({e})") from None
    if kind == IntentSlotModel.kind and len(labels) == 2:
        return IntentSlotModel(cfg, labels[0].classes, labels[1].classes, seq)
    if kind == SequenceClassifier.kind and len(labels) == 1:
        return SequenceClassifier(cfg, labels[0].classes, seq)
    raise ModelError(f"the checkpoint describes an unknown model kind {kind!r}")
