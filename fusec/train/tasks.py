"""From what ``fusec train`` is given (a built-in model name or a Hugging Face BERT checkpoint
directory, and training records) to a model, its data encoder and its initial weights; and back
from a trained model to a directory that ``fusec compile``/``run`` (``fusec_task.json`` +
``model.safetensors``) and, for a BERT classifier, ``transformers`` (``config.json`` of a
BertForSequenceClassification, the tokenizer files) read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fusec.errors import InputError, ModelError
from fusec.models.train_bert import EncoderConfig
from fusec.models.train_tasks import IntentSlotModel, SequenceClassifier, TaskModel, from_description
from fusec.train.data import IntentSlotData, TextClassData

BUILTIN = "intent-slot"
TASK_FILE = "fusec_task.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def record_fields(model_arg: str) -> dict[str, type]:
    if model_arg == BUILTIN:
        return IntentSlotData.fields
    if os.path.isdir(model_arg):
        return TextClassData.fields
    raise InputError(f"MODEL must be {BUILTIN!r} or a Hugging Face BERT checkpoint directory, got {model_arg!r}")


def bert_config(model_dir: str | os.PathLike[str]) -> EncoderConfig:
    """The encoder dims of a BERT checkpoint directory's config.json (checked as fusec's BERT
    builder checks them)."""
    from fusec.models.hf_weights import config_from_hf
    from fusec.models.registry import get_config

    cfg = config_from_hf(get_config("bert-tiny"), model_dir)
    if cfg.activation != "gelu":
        raise ModelError(f"{os.fspath(model_dir)!r}: training supports BERT's erf GELU, not {cfg.activation!r}")
    return EncoderConfig(vocab_size=cfg.vocab_size, hidden=cfg.hidden_size, layers=cfg.num_layers, heads=cfg.num_heads,
                         ffn=cfg.intermediate_size, max_positions=cfg.max_positions, type_vocab_size=cfg.type_vocab_size,
                         eps=float(cfg.norm_eps))


def setup(model_arg: str, records: Sequence[Mapping[str, Any]], seq: int | None, vocab_size: int = 1000,
          held: Sequence[Mapping[str, Any]] = ()) -> tuple[TaskModel, Any, dict[str, np.ndarray]]:
    """(model, data encoder, initial weights by name: the checkpoint's, for a fine-tune). The
    vocabulary comes from ``records``; the label sets from them and the held-out ``held``."""
    if model_arg == BUILTIN:
        cfg = EncoderConfig(vocab_size=vocab_size, max_positions=seq or 50)
        data = IntentSlotData.fit(records, vocab_size, cfg.max_positions, held)
        return IntentSlotModel(cfg, len(data.intents), len(data.slots)), data, {}
    cfg = bert_config(model_arg)
    seq = seq or min(128, cfg.max_positions)
    if seq > cfg.max_positions:
        raise InputError(f"--seq {seq} exceeds the checkpoint's {cfg.max_positions} positions")
    data = TextClassData.from_dir(model_arg, list(records) + list(held), seq)
    model = SequenceClassifier(cfg, len(data.labels), seq)
    return model, data, checkpoint_weights(model, model_arg)


def checkpoint_weights(model: TaskModel, model_dir: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The parameters a BERT checkpoint holds (HF names; the classification head usually not)."""
    from fusec.models.hf_weights import HFWeights
    from fusec.models.registry import get_config

    hf = HFWeights(model_dir, get_config("bert-tiny"))
    out = {}
    for s in model.specs:
        name = s.name[len("bert."):] if s.name.startswith("bert.") else s.name
        if hf.has(name):
            out[s.name] = hf.get(name, s.shape, "matrix")
    return out


def data_from_meta(model: TaskModel, meta: Mapping[str, Any]) -> Any:
    """The data encoder a checkpoint or a trained directory records (``task`` metadata)."""
    try:
        if model.kind == IntentSlotModel.kind:
            return IntentSlotData.from_meta(meta)
        return TextClassData(meta["tokenizer_json"], meta["labels"], int(meta["seq"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"the checkpoint's task description is malformed ({e})") from None


def data_meta(data: Any) -> dict[str, Any]:
    if isinstance(data, IntentSlotData):
        return data.meta()
    return {"labels": data.labels, "seq": data.seq, "tokenizer_json": data.tokenizer_json}


def write_model_dir(out: str | os.PathLike[str], model: TaskModel, params: Mapping[str, np.ndarray], data: Any,
                    source_dir: str | os.PathLike[str] | None = None) -> None:
    """The trained model as a directory: weights by name, the task description, and for a BERT
    classifier what transformers needs (config.json, the tokenizer files)."""
    from safetensors.numpy import save

    from fusec.fsutil import atomic_write

    os.makedirs(out, exist_ok=True)
    meta = {k: v for k, v in data_meta(data).items() if k != "tokenizer_json"}
    task = {"model": model.describe(), "task": meta}
    with atomic_write(os.path.join(out, WEIGHTS_FILE), what="weights") as f:
        f.write(save({k: np.ascontiguousarray(v, np.float32) for k, v in params.items()}, metadata={"format": "pt"}))
    if isinstance(model, SequenceClassifier) and source_dir is not None:
        _write_hf(out, model, data, source_dir)
    with atomic_write(os.path.join(out, TASK_FILE), what="task description") as f:
        f.write(json.dumps(task, indent=1, sort_keys=True).encode("utf-8"))


def _write_hf(out: str | os.PathLike[str], model: SequenceClassifier, data: TextClassData,
              source_dir: str | os.PathLike[str]) -> None:
    from fusec.fsutil import atomic_write
    from fusec.modelfiles import read_in_dir, read_json_in_dir

    cfg = read_json_in_dir(source_dir, "config.json") or {}
    cfg.update({"architectures": ["BertForSequenceClassification"], "model_type": "bert",
                "id2label": {str(i): lab for i, lab in enumerate(data.labels)},
                "label2id": {lab: i for i, lab in enumerate(data.labels)},
                "problem_type": "single_label_classification"})
    with atomic_write(os.path.join(out, "config.json"), what="config") as f:
        f.write(json.dumps(cfg, indent=2, sort_keys=True).encode("utf-8"))
    for name in TOKENIZER_FILES:
        raw = read_in_dir(source_dir, name, missing_ok=True)
        if raw is not None:
            with atomic_write(os.path.join(out, name), what="tokenizer file") as f:
                f.write(bytes(raw))


def read_model_dir(path: str | os.PathLike[str]) -> tuple[TaskModel, dict[str, np.ndarray], dict[str, Any]]:
    """(model, weights, task metadata) of a directory ``write_model_dir`` wrote."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    from fusec.modelfiles import read_in_dir, read_json_in_dir

    task = read_json_in_dir(path, TASK_FILE)
    if not isinstance(task, dict) or "model" not in task:
        raise ModelError(f"{os.path.join(os.fspath(path), TASK_FILE)!r} does not describe a trained model")
    model = from_description(task["model"])
    raw = read_in_dir(path, WEIGHTS_FILE, limit=1 << 40)
    try:
        weights = load(bytes(raw))
    except SafetensorError as e:
        raise ModelError(f"cannot read {os.path.join(os.fspath(path), WEIGHTS_FILE)!r}: {e}") from None
    missing = [s.name for s in model.specs if s.name not in weights]
    if missing:
        raise ModelError(f"{os.path.join(os.fspath(path), WEIGHTS_FILE)!r} lacks {', '.join(map(repr, missing[:3]))}")
    return model, weights, dict(task.get("task") or {})


def build_trained(path: str | os.PathLike[str], shapes: Mapping[str, Sequence[int]] | None = None) -> Any:
    """The inference graph of a trained model directory (``fusec compile``/``run`` load it): inputs
    ``input_ids``/``attention_mask`` [B, S] (default [1, the trained length]), outputs
    ``logits.<label>`` per head, the weights as constants."""
    from fusec.train.graphs import inference_graph

    model, weights, _ = read_model_dir(path)
    bsz, seq = 1, model.seq
    if shapes:
        dims = {tuple(int(d) for d in v) for v in shapes.values()}
        if set(shapes) - {"input_ids", "attention_mask"} or len(dims) != 1 or len(next(iter(dims))) != 2:
            raise InputError("a trained model takes input_ids and attention_mask of one shape [batch, seq]")
        bsz, seq = next(iter(dims))
        if not 1 <= seq <= model.cfg.max_positions or bsz < 1:
            raise InputError(f"shape [{bsz}, {seq}] does not fit the model (1 to {model.cfg.max_positions} positions)")
    desc = dict(model.describe(), seq=seq)
    graph = inference_graph(from_description(desc), weights, bsz)
    graph.meta["model"] = {"name": os.path.basename(os.path.normpath(os.fspath(path))), "family": model.kind,
                           "weights": "checkpoint"}
    return graph
