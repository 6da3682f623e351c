"""The entry points of a training plan, as IR graphs over one shared state:

==========  =============  ==========================================================
state       shape, dtype   meaning
==========  =============  ==========================================================
``params``  [P] f32        every parameter end to end (``TrainBlocks`` reads views)
``adam_m``  [P] f32        AdamW's first moments
``adam_v``  [P] f32        AdamW's second moments
``step``    [1] i64        optimizer steps taken (the schedule's clock)
==========  =============  ==========================================================

* ``train_step`` (inputs: the batch: ids, mask, labels; output: ``loss``): the forward, the loss,
  the backward (``fusec.autodiff``) and one ``adamw`` node that updates the four states in place;
* ``eval`` (inputs: ids, mask; outputs: one ``pred.<label>`` per head): the forward only;
* ``init`` (input: ``seed`` [1]): ``init`` nodes write seeded parameters and zero moments and step.

Every entry declares all four states (read-only where it does not update them), so they share
one state layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from fusec.autodiff import backward
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.errors import InputError, ModelError
from fusec.ir import Graph, Value
from fusec.ops import AdamWAttrs, Op
from fusec.train.blocks import TrainBlocks, init_segments

if TYPE_CHECKING:
    from fusec.models.train_tasks import TaskModel

STATES = ("params", "adam_m", "adam_v", "step")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW and its schedule (fusec.ops_train.AdamWAttrs defines the arithmetic)."""

    lr: float = 5e-4
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    schedule: str = "linear"
    warmup_steps: int = 0
    total_steps: int = 1000
    max_grad_norm: float = 1.0

    def attrs(self, decay: tuple[bool, ...]) -> AdamWAttrs:
        try:
            return AdamWAttrs(lr=self.lr, decay=decay, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                              weight_decay=self.weight_decay, schedule=self.schedule, warmup_steps=self.warmup_steps,
                              total_steps=self.total_steps, max_grad_norm=self.max_grad_norm)
        except ValueError as e:
            raise InputError(f"optimizer: {e}") from None


def _states(b: GraphBuilder, numel: int) -> dict[str, Value]:
    return {"params": b.state("params", (numel,), DType.F32), "adam_m": b.state("adam_m", (numel,), DType.F32),
            "adam_v": b.state("adam_v", (numel,), DType.F32), "step": b.state("step", (1,), DType.I64)}


def _inputs(b: GraphBuilder, sig: list[tuple[str, tuple[int, ...], DType]]) -> dict[str, Value]:
    return {name: b.input(name, shape, dt) for name, shape, dt in sig}


def num_params(model: TaskModel) -> int:
    return sum(s.numel for s in model.specs)


def train_graph(model: TaskModel, batch: int, opt: OptimConfig, cdt: DType = DType.F32) -> Graph:
    """The ``train_step`` entry: forward, loss, backward, one AdamW step."""
    b = GraphBuilder(f"{model.kind}.train_step")
    st = _states(b, num_params(model))
    feats = _inputs(b, model.feature_inputs(batch))
    labels = _inputs(b, model.label_inputs(batch))
    m = TrainBlocks(b, model.specs, cdt, flat=st["params"])
    loss = model.loss(m, model.forward(m, feats), labels)
    units = m.trainable()
    grads = backward(b, loss, [u.view for u in units])
    dead = [n for u in units if grads[u.view] is None for n in u.names]
    if dead:
        raise ModelError(f"the loss does not depend on parameter(s) {', '.join(map(repr, dead[:5]))}")
    attrs = opt.attrs(tuple(u.decay for u in units))
    new = b.emit(Op.ADAMW, st["params"], st["adam_m"], st["adam_v"], st["step"], *[grads[u.view] for u in units],
                 attrs_record=attrs, name="adamw")
    for name, v in zip(STATES, new):
        b.update(st[name], v)
    b.output(loss, "loss")
    return b.build()


def eval_graph(model: TaskModel, batch: int, cdt: DType = DType.F32) -> Graph:
    """The ``eval`` entry: the forward and each head's predicted class."""
    b = GraphBuilder(f"{model.kind}.eval")
    st = _states(b, num_params(model))
    feats = _inputs(b, model.feature_inputs(batch))
    m = TrainBlocks(b, model.specs, cdt, flat=st["params"])
    preds = model.predictions(m, model.forward(m, feats))
    for v in st.values():
        b.update(v, v)
    for name, v in preds.items():
        b.output(v, f"pred.{name}")
    return b.build()


def init_graph(model: TaskModel) -> Graph:
    """The ``init`` entry: seeded parameters (fusec.reference_train.init), zero moments and step."""
    b = GraphBuilder(f"{model.kind}.init")
    n = num_params(model)
    st = _states(b, n)
    seed = b.input("seed", (1,), DType.I64)
    b.update(st["params"], b.emit(Op.INIT, seed, segments=init_segments(model.specs), name="params_init"))
    for name in ("adam_m", "adam_v"):
        b.update(st[name], b.emit(Op.INIT, seed, segments=((n, "zeros", 0.0),), name=f"{name}_init"))
    b.update(st["step"], b.emit(Op.INIT, seed, segments=((1, "zeros", 0.0),), dtype=DType.I64, name="step_init"))
    return b.build()


def inference_graph(model: TaskModel, weights: Mapping[str, np.ndarray], batch: int) -> Graph:
    """The forward with the trained weights as constants: ``input_ids``/``attention_mask`` in,
    ``logits.<head>`` out (what ``fusec compile``/``run`` take for a trained model directory)."""
    b = GraphBuilder(model.kind)
    feats = _inputs(b, model.feature_inputs(batch))
    m = TrainBlocks(b, model.specs, DType.F32, weights=weights)
    logits = model.forward(m, feats)
    m.trainable()
    for name, v in logits.items():
        b.output(v, f"logits.{name}")
    return b.build()
