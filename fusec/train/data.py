"""Labelled text for training: JSON-lines files, their encoding into fixed-shape integer arrays,
batches, and the metrics reported per epoch.

Two record formats, one per task:

- intent/slot (``intent-slot``): ``{"tokens": [...], "intent": "...", "slots": ["O", "B-x", ...]}``,
  one BIO tag per token. Words map through a vocabulary fitted on the training file
  (``[PAD]`` 0, ``[UNK]`` 1, ``[CLS]`` 2, then the most frequent words); a sequence is
  ``[CLS]`` + tokens, padded; slot labels are -100 on ``[CLS]`` and padding.
- sequence classification: ``{"text": "...", "label": "..."}``, tokenized by the checkpoint's
  tokenizer.json (``[CLS] ... [SEP]``, truncated to the sequence length).

Every problem is a one-line ``InputError`` naming the file, the line and the field.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from fusec.errors import InputError

SPECIALS = ("[PAD]", "[UNK]", "[CLS]")
MAX_LINE = 1 << 20
MAX_RECORDS = 10_000_000


def read_jsonl(path: str | os.PathLike[str], fields: Mapping[str, type]) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, each an object with ``fields`` of the given types."""
    where = os.fspath(path)
    if not os.path.isfile(where):
        raise InputError(f"no such data file: {where!r}")
    out = []
    try:
        with open(where, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if len(line) > MAX_LINE:
                    raise InputError(f"{where}:{n}: line longer than {MAX_LINE} characters")
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{where}:{n}: not JSON ({e.msg})") from None
                if not isinstance(rec, dict):
                    raise InputError(f"{where}:{n}: expected a JSON object")
                for key, typ in fields.items():
                    if not isinstance(rec.get(key), typ):
                        raise InputError(f"{where}:{n}: field {key!r} must be a {typ.__name__}")
                rec["_where"] = f"{where}:{n}"
                out.append(rec)
                if len(out) > MAX_RECORDS:
                    raise InputError(f"{where}: more than {MAX_RECORDS} records")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not UTF-8 text ({e.reason})") from None
    if not out:
        raise InputError(f"{where}: no records")
    return out


class IntentSlotData:
    """Vocabulary and label sets of the intent/slot task, fitted on training records or restored
    from a checkpoint's metadata (``meta``)."""

    fields = {"tokens": list, "intent": str, "slots": list}

    def __init__(self, vocab: Sequence[str], intents: Sequence[str], slots: Sequence[str], seq: int):
        self.vocab, self.intents, self.slots, self.seq = list(vocab), list(intents), list(slots), seq
        self.word_id = {w: i for i, w in enumerate(self.vocab)}
        self.intent_id = {w: i for i, w in enumerate(self.intents)}
        self.slot_id = {w: i for i, w in enumerate(self.slots)}

    @classmethod
    def fit(cls, records: Sequence[Mapping[str, Any]], vocab_size: int, seq: int,
            more_labels: Sequence[Mapping[str, Any]] = ()) -> IntentSlotData:
        """Words from ``records``; intents and slot tags from them and ``more_labels`` (the
        held-out records: a label seen only there still gets an output, never a crash)."""
        words = Counter(w.lower() for r in records for w in _tokens(r))
        vocab = list(SPECIALS) + [w for w, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0]))]
        both = list(records) + list(more_labels)
        slots = sorted({t for r in both for t in r["slots"] if isinstance(t, str)} - {"O"})
        return cls(vocab[:vocab_size], sorted({r["intent"] for r in both}), ["O"] + slots, seq)

    def meta(self) -> dict[str, Any]:
        return {"vocab": self.vocab, "intents": self.intents, "slots": self.slots, "seq": self.seq}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> IntentSlotData:
        return cls(meta["vocab"], meta["intents"], meta["slots"], int(meta["seq"]))

    def encode(self, records: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        n, s = len(records), self.seq
        ids = np.zeros((n, s), np.int64)
        mask = np.zeros((n, s), np.int64)
        intents = np.zeros(n, np.int64)
        slots = np.full((n, s), -100, np.int64)
        for i, r in enumerate(records):
            toks, tags = _tokens(r), r["slots"]
            if len(tags) != len(toks):
                raise InputError(f"{r['_where']}: {len(toks)} tokens but {len(tags)} slot tags")
            if r["intent"] not in self.intent_id:
                raise InputError(f"{r['_where']}: intent {r['intent']!r:.60} is not one the model was trained on")
            intents[i] = self.intent_id[r["intent"]]
            toks, tags = toks[:s - 1], tags[:s - 1]
            ids[i, 0] = SPECIALS.index("[CLS]")
            mask[i, :len(toks) + 1] = 1
            for j, (w, t) in enumerate(zip(toks, tags), 1):
                ids[i, j] = self.word_id.get(w.lower(), 1)
                if not isinstance(t, str) or t not in self.slot_id:
                    raise InputError(f"{r['_where']}: slot tag {t!r:.60} is not one the model was trained on")
                slots[i, j] = self.slot_id[t]
        return {"input_ids": ids, "attention_mask": mask, "intent_labels": intents, "slot_labels": slots}


def _tokens(r: Mapping[str, Any]) -> list[str]:
    toks = r["tokens"]
    if not all(isinstance(t, str) and t for t in toks):
        raise InputError(f"{r['_where']}: tokens must be non-empty strings")
    return list(toks)


class TextClassData:
    """Labels of a sequence-classification task and the checkpoint's tokenizer."""

    fields = {"text": str, "label": str}

    def __init__(self, tokenizer_json: str, labels: Sequence[str], seq: int):
        import tokenizers

        self.tokenizer_json, self.labels, self.seq = tokenizer_json, list(labels), seq
        self.label_id = {w: i for i, w in enumerate(self.labels)}
        self.tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        self.tok.no_padding()
        self.tok.enable_truncation(max_length=seq)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str], records: Sequence[Mapping[str, Any]], seq: int) -> TextClassData:
        """The checkpoint's tokenizer; the labels of ``records`` (training and held-out)."""
        from fusec.errors import ModelError
        from fusec.modelfiles import read_text_in_dir

        text = read_text_in_dir(model_dir, "tokenizer.json", missing_ok=True)
        if text is None:
            raise ModelError(f"checkpoint directory {os.fspath(model_dir)!r} has no tokenizer.json")
        return cls(text, sorted({r["label"] for r in records}), seq)

    def encode(self, records: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        n, s = len(records), self.seq
        ids = np.zeros((n, s), np.int64)
        mask = np.zeros((n, s), np.int64)
        labels = np.zeros(n, np.int64)
        for i, r in enumerate(records):
            if r["label"] not in self.label_id:
                raise InputError(f"{r['_where']}: label {r['label']!r:.60} is not one the model was trained on")
            labels[i] = self.label_id[r["label"]]
            enc = self.tok.encode(r["text"]).ids
            ids[i, :len(enc)] = enc
            mask[i, :len(enc)] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def batches(arrays: Mapping[str, np.ndarray], batch: int, seed: int | None = None
            ) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """(batch, number of real rows) over every record (shuffled with ``seed``; in order without);
    the last batch is filled with padding rows (ids 0, mask 0, labels -100: no loss, no metric)."""
    n = len(next(iter(arrays.values())))
    order = np.random.default_rng(seed).permutation(n) if seed is not None else np.arange(n)
    for start in range(0, n, batch):
        idx = order[start:start + batch]
        out = {}
        for k, a in arrays.items():
            part = a[idx]
            if len(idx) < batch:
                fill = 0 if k in ("input_ids", "attention_mask") else -100
                pad = np.full((batch - len(idx),) + a.shape[1:], fill, a.dtype)
                part = np.concatenate([part, pad])
            out[k] = np.ascontiguousarray(part)
        yield out, len(idx)


def spans(tags: Sequence[str]) -> set[tuple[str, int, int]]:
    """Entity spans (type, start, end) of a BIO sequence, as conlleval reads it (an I- that does
    not continue a span of its type starts one)."""
    out, cur = set(), None
    for i, t in enumerate(list(tags) + ["O"]):
        kind = t[2:] if t[:2] in ("B-", "I-") else None
        if cur is not None and (kind is None or t.startswith("B-") or kind != cur[0]):
            out.add((cur[0], cur[1], i))
            cur = None
        if kind is not None and cur is None:
            cur = (kind, i)
    return out


def bio_f1(true: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> float:
    """Entity-level F1 over sequences of BIO tags (1.0 when neither side has an entity)."""
    tp = fp = fn = 0
    for t, p in zip(true, pred):
        st, sp = spans(t), spans(p)
        tp += len(st & sp)
        fp += len(sp - st)
        fn += len(st - sp)
    return 1.0 if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)


def intent_slot_metrics(data: IntentSlotData):  # noqa: ANN201
    """``TrainingPlan.evaluate``'s metrics for the intent/slot task: intent accuracy and slot F1."""
    def metrics(preds: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray]) -> dict[str, float]:
        acc = float((preds["intent_labels"] == labels["intent_labels"]).mean())
        true, pred = [], []
        for py, ty in zip(preds["slot_labels"], labels["slot_labels"]):
            keep = ty != -100
            true.append([data.slots[j] for j in ty[keep]])
            pred.append([data.slots[j] for j in py[keep]])
        return {"intent_accuracy": acc, "slot_f1": bio_f1(true, pred)}
    return metrics


def classification_metrics(preds: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray]) -> dict[str, float]:
    """``TrainingPlan.evaluate``'s metric for sequence classification: accuracy."""
    return {"accuracy": float((preds["labels"] == labels["labels"]).mean())}
