"""Tiny random HF decoders exported to ONNX **with a KV cache**, for the ONNX generation tests.

API
---
``export_kv(family, exporter, out_dir=None, *, layout="bhsd", attn="eager", dtype="fp32") -> (onnx_path, hf_model)``

- ``family``: ``"llama"`` or ``"qwen3"`` (``FAMILIES``); the model is ``hf_models.build_model``'s
  (``attn``: the HF attention implementation, eager by default; deterministic non-zero random
  weights; ``dtype="fp16"`` halves it), with a ``config.json`` and ``generation_config.json``
  (eos id ``EOS``) next to the file, as in an Optimum export folder.
- ``exporter``: ``"legacy"`` (``torch.onnx.export(dynamo=False, opset_version=17)``) or
  ``"dynamo"`` (``torch.onnx.export(dynamo=True)``).
- The graph's inputs are ``input_ids`` [batch, seq], ``attention_mask`` [batch, past + seq],
  ``position_ids`` [batch, seq] and, per layer i, ``past_key_values.i.key`` /
  ``past_key_values.i.value`` [batch, kv_heads, past, head_dim]; its outputs are ``logits``
  [batch, seq, vocab] and ``present.i.key`` / ``present.i.value`` [batch, kv_heads, past + seq,
  head_dim] (the cache after the step: ``Concat(past, new, axis=2)`` inside). batch, seq and past
  are symbolic. The wrapper builds a ``transformers.DynamicCache`` from the past tensors.
- ``layout="bshd"`` exports the cache as [batch, past, kv_heads, head_dim] instead (transposed in
  the wrapper): a layout fusec must refuse.
- ``check_export(path, model)``: a right-padded prompt batch (past length 0), then one step fed the
  returned ``present.*`` as the past, through onnxruntime, against torch; returns the largest
  absolute logits difference.

Caching: one export per ``(family, exporter, layout, attn, dtype)`` per process, in a temporary directory
removed at exit (or ``out_dir`` on the first call). An exporter failure calls ``pytest.skip`` with
the error summarized (cached too).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = ("llama", "qwen3")
EXPORTERS = ("legacy", "dynamo")
EOS = 7  # the eos id written into config.json / generation_config.json next to the file

_CACHE: dict[tuple[str, ...], tuple[str, Any] | str] = {}
_TMP: str | None = None


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def make_wrapper(model: Any, layout: str = "bhsd") -> Any:
    """A module: (input_ids, attention_mask, position_ids, *past) -> (logits, *present)."""
    import torch
    from transformers import DynamicCache

    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"unknown cache layout {layout!r}")

    class KVWrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, input_ids: Any, attention_mask: Any, position_ids: Any, *past: Any) -> Any:
            if layout == "bshd":
                past = tuple(p.transpose(1, 2) for p in past)
            pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
            cache = DynamicCache(pairs, config=self.m.config)
            out = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
            present = []
            for layer in out.past_key_values.layers:
                k, v = layer.keys, layer.values
                if layout == "bshd":
                    k, v = k.transpose(1, 2), v.transpose(1, 2)
                present += [k, v]
            return (out.logits, *present)

    return KVWrapper().eval()


def example_inputs(model: Any, batch: int, seq: int, past: int, seed: int = 0,
                   layout: str = "bhsd") -> dict[str, np.ndarray]:
    """Feeds for the wrapper: random ids and caches (in the model's dtype), all-ones mask."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    hkv = cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (batch, hkv, past, hd) if layout == "bhsd" else (batch, past, hkv, hd)
    feeds = {"input_ids": rng.integers(3, cfg.vocab_size, size=(batch, seq), dtype=np.int64),
             "attention_mask": np.ones((batch, past + seq), np.int64),
             "position_ids": np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1))}
    for name in io_names(cfg.num_hidden_layers)[0][3:]:
        feeds[name] = rng.standard_normal(shape).astype(np.float16 if model.dtype == _torch_fp16() else np.float32)
    return feeds


def _torch_fp16() -> Any:
    import torch

    return torch.float16


def _export(model: Any, exporter: str, layout: str, path: Path) -> None:
    import torch

    wrapper = make_wrapper(model, layout)
    ins, outs = io_names(model.config.num_hidden_layers)
    feeds = example_inputs(model, 2, 3, 4, layout=layout)
    args = tuple(torch.from_numpy(feeds[n]) for n in ins)
    past_axis = 2 if layout == "bhsd" else 1
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            axes: dict[str, dict[int, str]] = {"input_ids": {0: "batch", 1: "seq"},
                                               "attention_mask": {0: "batch", 1: "total"},
                                               "position_ids": {0: "batch", 1: "seq"},
                                               "logits": {0: "batch", 1: "seq"}}
            for n in ins[3:]:
                axes[n] = {0: "batch", past_axis: "past"}
            for n in outs[1:]:
                axes[n] = {0: "batch", past_axis: "total"}
            torch.onnx.export(wrapper, args, str(path), input_names=ins, output_names=outs, dynamo=False,
                              opset_version=17, dynamic_axes=axes)
        elif exporter == "dynamo":
            d = torch.export.Dim.DYNAMIC
            # the signature is (input_ids, attention_mask, position_ids, *past): past is one tuple
            dyn = ({0: d, 1: d}, {0: d, 1: d}, {0: d, 1: d}, tuple({0: d, past_axis: d} for _ in ins[3:]))
            torch.onnx.export(wrapper, args, str(path), input_names=ins, output_names=outs, dynamo=True,
                              dynamic_shapes=dyn, external_data=False, verbose=False)
        else:
            raise ValueError(f"unknown exporter {exporter!r} (known: {', '.join(EXPORTERS)})")


def _out_root(out_dir: str | None) -> Path:
    global _TMP
    if out_dir is not None:
        return Path(out_dir)
    if _TMP is None:
        _TMP = tempfile.mkdtemp(prefix="fusec-hf-kv-")
        atexit.register(shutil.rmtree, _TMP, True)
    return Path(_TMP)


def export_kv(family: str, exporter: str, out_dir: str | None = None, *, layout: str = "bhsd", attn: str = "eager",
              dtype: str = "fp32") -> tuple[str, Any]:
    """Export (once per process) the tiny ``family`` decoder with a KV cache; see the module doc."""
    import hf_models
    import pytest

    key = (family, exporter, layout, attn, dtype)
    if key not in _CACHE:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
        folder = _out_root(out_dir) / f"{family}-{exporter}-{layout}-{attn}-{dtype}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "model.onnx"
        model = hf_models.build_model(family, attn)
        if dtype == "fp16":
            model = model.half()
        elif dtype != "fp32":
            raise ValueError(f"unknown dtype {dtype!r} (fp32, fp16)")
        model.generation_config.eos_token_id = EOS
        model.config.eos_token_id = EOS
        try:
            _export(model, exporter, layout, path)
        except Exception as e:  # the exporter's own failure: report it, don't hide it in a traceback
            msg = str(e).strip().splitlines()
            _CACHE[key] = (f"{exporter} export of {family} ({attn}, {dtype}) with a KV cache failed: "
                           f"{type(e).__name__}: {msg[0][:300] if msg else ''}")
        else:
            (folder / "config.json").write_text(json.dumps({"model_type": family, "eos_token_id": EOS}))
            (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
            _CACHE[key] = (str(path), model)
    got = _CACHE[key]
    if isinstance(got, str):
        pytest.skip(got)
    return got


def check_export(path: str, model: Any, layout: str = "bhsd") -> float:
    """Prompt (right-padded batch, past 0) then one cached step: onnxruntime vs torch (max |diff|)."""
    import onnxruntime as ort
    import torch

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    ins, outs = io_names(model.config.num_hidden_layers)
    wrapper = make_wrapper(model, layout)
    feeds = example_inputs(model, 2, 5, 0, seed=1, layout=layout)
    feeds["attention_mask"][1, 3:] = 0  # row 1: a 3-token prompt, right-padded
    worst = 0.0
    for step in range(2):
        got = dict(zip(outs, sess.run(outs, feeds)))
        with torch.no_grad():
            want = wrapper(*(torch.from_numpy(feeds[n]) for n in ins))
        want = dict(zip(outs, (w.numpy() for w in want)))
        rows = [0, 1] if step else [0]  # step 0: row 1's padded positions are garbage in both
        worst = max(worst, float(np.abs(got["logits"][rows] - want["logits"][rows]).max()))
        for n in outs[1:]:
            worst = max(worst, float(np.abs(got[n] - want[n]).max()))
        past = feeds["attention_mask"].shape[1]
        nxt = got["logits"][:, -1].argmax(-1)
        feeds = {"input_ids": nxt[:, None].astype(np.int64),
                 "attention_mask": np.concatenate([feeds["attention_mask"], np.ones((2, 1), np.int64)], 1),
                 "position_ids": np.full((2, 1), past, np.int64),
                 **{p: got[q] for p, q in zip(ins[3:], outs[1:])}}
    return worst
