"""The ``fusec train`` loop: data in, a trained model directory out.

Per epoch: shuffled batches (seed + epoch, so a resumed run sees the batches it would have),
one ``TrainingPlan.step`` each; every ``log_every`` steps the losses are read back once and the
mean loss and tokens/s reported; after the epoch, the held-out metrics, a checkpoint
(``OUT/checkpoint.safetensors``: parameters, AdamW's state, the task, the epoch) and the model
directory (``fusec.train.tasks.write_model_dir``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fusec.errors import InputError
from fusec.train import tasks
from fusec.train.data import IntentSlotData, batches, classification_metrics, intent_slot_metrics, read_jsonl
from fusec.train.graphs import OptimConfig
from fusec.train.plan import TrainingPlan, read_checkpoint

CHECKPOINT = "checkpoint.safetensors"


@dataclasses.dataclass
class TrainOptions:
    model: str
    data: str
    out: str
    eval: str | None = None
    epochs: int = 3
    batch: int = 32
    lr: float | None = None  # default: 5e-4 for the built-in model, 5e-5 for a fine-tune
    dtype: str = "fp32"
    seed: int = 0
    seq: int | None = None
    resume: str | None = None
    backend: str = "auto"
    warmup: float = 0.1  # fraction of the steps
    schedule: str = "linear"
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    holdout: float = 0.1  # fraction of --data held out when there is no --eval
    vocab_size: int = 1000
    log_every: int = 20

    def check(self) -> None:
        for name in ("epochs", "batch", "log_every", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.seq is not None and self.seq < 2:
            raise InputError(f"--seq must be at least 2, got {self.seq}")
        if not 0 <= self.warmup < 1 or not 0 < self.holdout < 1:
            raise InputError("--warmup must be in [0, 1) and --holdout in (0, 1)")


def run(opts: TrainOptions, say: Callable[[str], None], status: Callable[[str], None] | None = None,
        progress: Callable[[str, str], None] | None = None) -> dict[str, Any]:
    """Train as ``opts`` says; ``say`` prints a line, ``status`` a progress line that the next
    replaces. Returns the last epoch's held-out metrics."""
    opts.check()
    fields = tasks.record_fields(opts.model)
    records = read_jsonl(opts.data, fields)
    if opts.eval is not None:
        train_recs, held_recs = records, read_jsonl(opts.eval, fields)
    else:
        order = list(range(len(records)))
        random.Random(opts.seed).shuffle(order)
        cut = max(1, int(round(len(records) * opts.holdout)))
        if cut >= len(records):
            raise InputError(f"{opts.data}: too few records to hold {opts.holdout:.0%} out; give --eval")
        held_recs, train_recs = [records[i] for i in order[:cut]], [records[i] for i in order[cut:]]
    start_epoch, info = 0, None
    if opts.resume is not None:
        info, _ = read_checkpoint(opts.resume)
        from fusec.models.train_tasks import from_description

        model = from_description(info["model"])
        data, init_weights = tasks.data_from_meta(model, info.get("task") or {}), {}
        start_epoch = int(info.get("epoch", 0))
    else:
        model, data, init_weights = tasks.setup(opts.model, train_recs, opts.seq, opts.vocab_size, held_recs)
    train_arr, held_arr = data.encode(train_recs), data.encode(held_recs)
    steps_per_epoch = math.ceil(len(train_recs) / opts.batch)
    total = steps_per_epoch * opts.epochs
    lr = opts.lr if opts.lr is not None else (5e-4 if isinstance(data, IntentSlotData) else 5e-5)
    optim = OptimConfig(lr=lr, weight_decay=opts.weight_decay, schedule=opts.schedule,
                        warmup_steps=int(round(opts.warmup * total)), total_steps=max(total, 1),
                        max_grad_norm=opts.max_grad_norm)
    from fusec.train.plan import gpu_available

    if opts.backend == "cuda" or (opts.backend == "auto" and gpu_available()):
        say(f"compiling the training step ({model.kind}, batch {opts.batch}, {opts.dtype}) for the GPU")
    from fusec.runtime.counters import off_while_timing

    with off_while_timing():  # the driver counters' tracing would slow every step's graph launch
        plan = TrainingPlan(model, opts.batch, dtype=opts.dtype, optim=optim, backend=opts.backend, progress=progress)
    if plan.backend == "reference":
        say("fusec: no GPU found: training on the reference backend (numpy; the same arithmetic, much slower)")
    if info is not None:
        plan.load(opts.resume)  # type: ignore[arg-type]
        say(f"resumed from {opts.resume} after epoch {start_epoch} (step {plan.steps_taken})")
    else:
        plan.init(opts.seed)
        if init_weights:
            plan.set_params(init_weights, strict=False)
            say(f"loaded {len(init_weights)} of {len(model.specs)} parameters from {opts.model}; "
                f"the rest ({', '.join(s.name for s in model.specs if s.name not in init_weights)}) seeded")
    metric_fn = intent_slot_metrics(data) if isinstance(data, IntentSlotData) else classification_metrics
    say(f"training {model.kind} ({plan.numel:,} parameters) on {len(train_recs)} records, {len(held_recs)} held out: "
        f"{opts.epochs} epochs x {steps_per_epoch} steps of {opts.batch}, {opts.dtype}, {plan.backend}")
    metrics: dict[str, Any] = {}
    for epoch in range(start_epoch, opts.epochs):
        t0, tokens, seen, losses = time.perf_counter(), 0, 0, []
        for i, (bt, n) in enumerate(batches(train_arr, opts.batch, seed=opts.seed + epoch), 1):
            plan.step(bt)
            tokens += int(bt["attention_mask"][:n].sum())
            seen += 1
            if i % opts.log_every == 0 or i == steps_per_epoch:
                recent = plan.losses()  # one read for the steps since the last report
                losses += list(recent)
                dt = time.perf_counter() - t0
                line = (f"epoch {epoch + 1}/{opts.epochs} step {i}/{steps_per_epoch} loss {float(np.mean(recent)):.4f} "
                        f"{tokens / dt:,.0f} tokens/s")
                (status or say)(line)
        metrics = plan.evaluate(batches(held_arr, opts.batch), metric_fn)
        metrics = {"epoch": epoch + 1, "train_loss": float(np.mean(losses)) if losses else float("nan"), **metrics}
        say(f"epoch {epoch + 1}: train loss {metrics['train_loss']:.4f}, held-out "
            + ", ".join(f"{k.replace('_', ' ')} {v:.2%}" for k, v in metrics.items() if k not in ("epoch", "train_loss")))
        _save(plan, opts, model, data, epoch + 1, metrics)
    return metrics


def _save(plan: TrainingPlan, opts: TrainOptions, model: Any, data: Any, epoch: int, metrics: dict[str, Any]) -> None:
    os.makedirs(opts.out, exist_ok=True)
    meta = {"task": tasks.data_meta(data), "epoch": epoch, "metrics": metrics, "data": os.path.basename(opts.data)}
    plan.save(os.path.join(opts.out, CHECKPOINT), meta=meta)
    source = opts.model if os.path.isdir(opts.model) else None
    tasks.write_model_dir(opts.out, model, plan.params(), data, source_dir=source)
    with open(os.path.join(opts.out, "metrics.json"), "w", encoding="utf-8") as f:
        json.dump(metrics, f, indent=1)
