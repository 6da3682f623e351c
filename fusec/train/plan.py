"""``TrainingPlan``: a compiled training step (``fusec.compile_training``).

One plan holds three entry points over shared state (``fusec.train.graphs``): ``train_step``,
``eval`` and ``init``. On a GPU they are one fusec plan (``compile_entries``; ``train_step``
replays as one CUDA graph: the parameters, gradients, AdamW moments and step counter never leave
the device, and only the batch crosses the bus); without one, the reference engine runs the same
graphs in numpy. Both engines have one interface, so ``step``, ``evaluate``, ``save`` and ``load``
are written once, here.

A batch is a dict of integer arrays: ``input_ids`` and ``attention_mask`` [B, S], and the model's
labels (-100: ignored). Each is checked on the host before anything runs (shapes, id and label
ranges: a label out of range would otherwise be silently wrong on the device).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from fusec.dtypes import DType
from fusec.errors import InputError, ModelError
from fusec.train.blocks import layout
from fusec.train.graphs import OptimConfig, eval_graph, init_graph, num_params, train_graph

DTYPES = {"fp32": DType.F32, "bf16": DType.BF16}
FORMAT = "fusec-train-1"


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: the reference engine runs instead
        return False


class TrainingPlan:
    def __init__(self, model: Any, batch: int, dtype: str = "fp32", optim: OptimConfig | None = None,
                 backend: str = "auto", arch: str | None = None, cuda_graph: bool = True,
                 progress: Callable[[str, str], None] | None = None):
        if dtype not in DTYPES:
            raise InputError(f"unknown training dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise InputError(f"batch must be a positive integer, got {batch!r}")
        if backend not in ("auto", "cuda", "reference"):
            raise InputError(f"unknown backend {backend!r} (expected auto, cuda or reference)")
        self.model, self.batch, self.dtype = model, batch, dtype
        self.optim = optim or OptimConfig()
        self.layout = layout(model.specs)
        self.numel = num_params(model)
        cdt = DTYPES[dtype]
        if progress is not None:
            progress("build", "training graphs")
        self.graphs = {"train_step": train_graph(model, batch, self.optim, cdt), "eval": eval_graph(model, batch, cdt),
                       "init": init_graph(model)}
        use_gpu = backend == "cuda" or (backend == "auto" and gpu_available())
        if use_gpu:
            from fusec.runtime.training import CudaEngine

            self.engine: Any = CudaEngine(self.graphs, arch=arch, cuda_graph=cuda_graph, progress=progress)
        else:
            from fusec.train.engine import ReferenceEngine

            self.engine = ReferenceEngine(self.graphs)
        self.backend = self.engine.backend

    # ---- state ------------------------------------------------------------------------------------
    def init(self, seed: int = 0) -> None:
        """Seeded parameters (on the device: the ``init`` entry), zero moments, step 0."""
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise InputError(f"seed must be an integer, got {seed!r}")
        self.engine.init(int(seed))

    def params(self) -> dict[str, np.ndarray]:
        """Every parameter by name (fp32 host copies)."""
        flat = self.engine.read_state("params")
        return {name: flat[off:off + s.numel].reshape(s.shape).copy() for name, (off, s) in self.layout.items()}

    def set_params(self, weights: Mapping[str, np.ndarray], strict: bool = True) -> None:
        """Write parameters from host arrays by name (the others keep their values); ``strict``:
        every parameter must be given. Moments and step are reset."""
        flat = self.engine.read_state("params")
        missing = [n for n in self.layout if n not in weights]
        if strict and missing:
            raise ModelError(f"weights lack parameter(s) {', '.join(map(repr, missing[:5]))}")
        extra = [n for n in weights if n not in self.layout]
        if extra:
            raise ModelError(f"weights hold tensor(s) the model does not have: {', '.join(map(repr, extra[:5]))}")
        for name, arr in weights.items():
            off, s = self.layout[name]
            a = np.asarray(arr)
            if tuple(a.shape) != s.shape:
                raise ModelError(f"weight {name!r} is {list(a.shape)}, the model's parameter is {list(s.shape)}")
            flat[off:off + s.numel] = a.astype(np.float32).reshape(-1)
        self.engine.write_state("params", flat)
        for name in ("adam_m", "adam_v"):
            self.engine.write_state(name, np.zeros(self.numel, np.float32))
        self.engine.write_state("step", np.zeros(1, np.int64))

    @property
    def steps_taken(self) -> int:
        return int(self.engine.read_state("step")[0])

    # ---- running ----------------------------------------------------------------------------------
    def check_batch(self, batch: Mapping[str, Any], labels: bool = True) -> dict[str, np.ndarray]:
        """The batch as int64 host arrays, checked; InputError naming the input at fault."""
        sig = self.model.feature_inputs(self.batch) + (self.model.label_inputs(self.batch) if labels else [])
        names = [n for n, _, _ in sig]
        extra = [k for k in batch if k not in names]
        missing = [n for n in names if n not in batch]
        if missing or extra:
            raise InputError("batch: " + "; ".join(([f"missing {', '.join(map(repr, missing))}"] if missing else [])
                                                   + ([f"unexpected {', '.join(map(repr, extra))}"] if extra else []))
                             + f" (a batch holds {', '.join(map(repr, names))})")
        classes = {lab.name: lab.classes for lab in self.model.labels}
        out = {}
        for name, shape, _ in sig:
            a = np.asarray(batch[name])
            if a.dtype.kind not in "iu":
                raise InputError(f"batch {name!r}: expected integers, got {a.dtype}")
            if tuple(a.shape) != shape:
                raise InputError(f"batch {name!r}: expected shape {list(shape)}, got {list(a.shape)}")
            a = a.astype(np.int64)
            if name == "input_ids":
                bad = (a < 0) | (a >= self.model.cfg.vocab_size)
                what = f"token id out of range [0, {self.model.cfg.vocab_size})"
            elif name == "attention_mask":
                bad, what = (a != 0) & (a != 1), "mask value other than 0 or 1"
            else:
                bad = (a != -100) & ((a < 0) | (a >= classes[name]))
                what = f"label out of range [0, {classes[name]}) (or -100 to ignore)"
            if bad.any():
                raise InputError(f"batch {name!r}: {what}: {int(a[bad].reshape(-1)[0])}")
            out[name] = np.ascontiguousarray(a)
        return out

    def step(self, batch: Mapping[str, Any]) -> None:
        """One training step (forward, backward, AdamW) on ``batch``. The loss stays on the device
        until ``losses()`` reads every step's loss back at once."""
        self.engine.train_step(self.check_batch(batch))

    def losses(self) -> np.ndarray:
        """The losses of the steps since the last call (one device-to-host copy)."""
        return self.engine.losses()

    def predict(self, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """{label name: predicted class per row (per token for token labels)} for a batch of features."""
        feats = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        out = self.engine.eval(self.check_batch(feats, labels=False))
        return {name[len("pred."):]: np.asarray(v) for name, v in out.items()}

    def evaluate(self, batches: Iterable[tuple[Mapping[str, Any], int]],
                 metrics: Callable[[dict[str, np.ndarray], dict[str, np.ndarray]], dict[str, float]] | None = None
                 ) -> dict[str, float]:
        """Predictions over ``batches`` ((batch, number of real rows) pairs; padding rows last);
        ``metrics(predictions, labels)`` (default: accuracy per label over non-ignored entries)."""
        preds: dict[str, list[np.ndarray]] = {}
        labels: dict[str, list[np.ndarray]] = {}
        for batch, n in batches:
            for k, v in self.predict(batch).items():
                preds.setdefault(k, []).append(v[:n])
                labels.setdefault(k, []).append(np.asarray(batch[k])[:n])
        p = {k: np.concatenate(v) for k, v in preds.items()}
        y = {k: np.concatenate(v) for k, v in labels.items()}
        return metrics(p, y) if metrics is not None else accuracy(p, y)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    # ---- checkpoints ------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], meta: Mapping[str, Any] | None = None, optimizer: bool = True) -> None:
        """A safetensors checkpoint: every parameter by name, AdamW's state (``optimizer.*``) unless
        ``optimizer`` is False, and the model's description (metadata ``fusec``, JSON)."""
        from safetensors.numpy import save

        from fusec.fsutil import atomic_write

        tensors = dict(self.params())
        if optimizer:
            for name in ("adam_m", "adam_v", "step"):
                tensors[f"optimizer.{name}"] = self.engine.read_state(name)
        info = {"format": FORMAT, "model": self.model.describe(), "dtype": self.dtype, **(dict(meta or {}))}
        data = save(tensors, metadata={"fusec": json.dumps(info, sort_keys=True)})
        with atomic_write(path, what="checkpoint") as f:
            f.write(data)

    def load(self, path: str | os.PathLike[str], optimizer: bool = True) -> dict[str, Any]:
        """Restore a checkpoint written by ``save`` (of this model: else ModelError naming the
        difference); with ``optimizer``, AdamW's state too (training resumes where it stopped).
        Returns the checkpoint's metadata."""
        info, tensors = read_checkpoint(path)
        if info.get("model") != self.model.describe():
            raise ModelError(f"checkpoint {os.fspath(path)!r} is of another model "
                             f"({_model_diff(info.get('model'), self.model.describe())})")
        self.set_params({k: v for k, v in tensors.items() if not k.startswith("optimizer.")})
        if optimizer and "optimizer.step" in tensors:
            for name in ("adam_m", "adam_v", "step"):
                self.engine.write_state(name, tensors[f"optimizer.{name}"])
        return info


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata, tensors) of a fusec training checkpoint; ModelError naming the file otherwise."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    where = os.fspath(path)
    if not os.path.isfile(where):
        raise ModelError(f"no such checkpoint file: {where!r}")
    try:
        with open(where, "rb") as f:
            raw = f.read()
        tensors = load(raw)
        header_len = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + header_len])
        info = json.loads(header.get("__metadata__", {}).get("fusec", "null"))
    except (SafetensorError, ValueError, OSError) as e:
        raise ModelError(f"cannot read checkpoint {where!r}: {str(e).splitlines()[0] if str(e) else e!r}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ModelError(f"{where!r} is not a fusec training checkpoint (no '{FORMAT}' metadata)")
    return info, tensors


def _model_diff(a: Any, b: Any) -> str:
    if not isinstance(a, dict):
        return "it describes no model"
    for key in ("kind", "seq", "labels"):
        if a.get(key) != b.get(key):
            return f"{key}: {json.dumps(a.get(key))} here, {json.dumps(b.get(key))} in the plan"
    ca, cb = a.get("config") or {}, b.get("config") or {}
    for key in sorted(set(ca) | set(cb)):
        if ca.get(key) != cb.get(key):
            return f"config.{key}: {ca.get(key)} in the checkpoint, {cb.get(key)} in the plan"
    return "its description differs"


def accuracy(preds: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Accuracy per label over the entries whose label is not -100."""
    out = {}
    for k, p in preds.items():
        y = labels[k]
        keep = y != -100
        out[f"{k}.accuracy"] = float((p[keep] == y[keep]).mean()) if keep.any() else float("nan")
    return out
