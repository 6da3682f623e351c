"""Tiny random-weight Hugging Face models exported to ONNX, shared by every test that needs real
exporter output (the importer tests, pattern-recognition tests, ...).

API
---
``export_hf(family, exporter, out_dir=None, *, attn="eager") -> (onnx_path, inputs, hf_model)``

- ``family``: one of ``FAMILIES`` (gpt2, llama, mistral, qwen2, qwen3, phi3, gpt_neox, gemma,
  bert, roberta, distilbert).
- ``exporter``: ``"legacy"`` (``torch.onnx.export(dynamo=False, opset_version=17)``, TorchScript)
  or ``"dynamo"`` (``torch.onnx.export(dynamo=True)``, torch.export + onnxscript). Both export with
  symbolic ``batch``/``seq`` dims on the two inputs, so an importer must bind them from shapes.
- ``attn``: the HF ``attn_implementation``, ``"eager"`` (default) or ``"sdpa"``.
- Returns the path of the ``.onnx`` file, the inputs ``{"input_ids": int64[2, SEQ],
  "attention_mask": int64[2, SEQ]}`` (row 1 is padded with zeros at the end; token ids never hit
  a special/pad id) and the ``torch.nn.Module`` that was exported (in ``eval()`` mode).
- The graph has ONE output: ``"logits"`` for decoders (``use_cache=False``), ``"last_hidden_state"``
  for encoders (bert, roberta, distilbert). ``OUTPUT_NAME[family]`` says which.
- Model weights are deterministic (seeded per family; every parameter, norms and biases included,
  gets non-zero random noise so that a dropped bias or a wrong norm shows up). The inputs are fresh
  random ids each pytest session; ``SEED`` holds the seed (set ``FUSEC_HF_SEED`` to replay one).

Caching: one export per ``(family, exporter, attn)`` per process. Files go to ``out_dir`` if given
on the first call, else to ``$FUSEC_HF_EXPORT_DIR`` if set (kept across runs: a stamp with the
torch/transformers versions guards reuse), else to a temporary directory removed at exit. Later
calls return the cached file whatever ``out_dir`` they pass. A family/exporter combination that
cannot be exported calls ``pytest.skip`` with the exporter's error summarized (also cached).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import shutil
import tempfile
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "gemma",
            "bert", "roberta", "distilbert")
DECODERS = frozenset({"gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "gemma"})
EXPORTERS = ("legacy", "dynamo")
OUTPUT_NAME = {f: ("logits" if f in DECODERS else "last_hidden_state") for f in FAMILIES}
BATCH, SEQ, VOCAB, PAD_LEN = 2, 12, 256, 4
SEED = int(os.environ.get("FUSEC_HF_SEED", np.random.SeedSequence().entropy % (2**31)))
_STAMP_VERSION = 1  # bump when the configs or the export recipe change

_CACHE: dict[tuple[str, str, str], tuple[str, dict[str, np.ndarray], Any] | str] = {}
_TMP: str | None = None


def _config(family: str) -> Any:
    import transformers as T

    dec = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64)
    if family == "gpt2":
        return T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if family == "llama":
        return T.LlamaConfig(**dec, num_key_value_heads=2)
    if family == "mistral":
        return T.MistralConfig(**dec, num_key_value_heads=2, head_dim=16, sliding_window=None)
    if family == "qwen2":
        return T.Qwen2Config(**dec, num_key_value_heads=2)
    if family == "qwen3":
        return T.Qwen3Config(**dec, num_key_value_heads=2, head_dim=16)
    if family == "phi3":
        return T.Phi3Config(**dec, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "gpt_neox":
        return T.GPTNeoXConfig(**dec, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)
    if family == "gemma":
        return T.GemmaConfig(**dec, num_key_value_heads=2, head_dim=16)
    enc = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
    if family == "bert":
        return T.BertConfig(**enc)
    if family == "roberta":
        return T.RobertaConfig(**enc, pad_token_id=1)
    if family == "distilbert":
        return T.DistilBertConfig(vocab_size=VOCAB, dim=64, hidden_dim=128, n_layers=2, n_heads=4,
                                  max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)
    raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")


def build_model(family: str, attn: str = "eager") -> Any:
    """The tiny HF model of ``family`` with deterministic, fully non-zero random weights."""
    import torch
    import transformers as T

    torch.manual_seed(zlib.crc32(family.encode()))
    cfg = _config(family)
    cls = T.AutoModelForCausalLM if family in DECODERS else T.AutoModel
    model = cls.from_config(cfg, attn_implementation=attn)
    with torch.no_grad():
        for p in model.parameters():  # norms start at 1 and biases at 0: make them all matter
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def make_inputs(seed: int = SEED) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, size=(BATCH, SEQ), dtype=np.int64)  # 0..2 are pad/bos/eos ids
    mask = np.ones((BATCH, SEQ), np.int64)
    mask[1, SEQ - PAD_LEN:] = 0
    return {"input_ids": ids, "attention_mask": mask}


class _Wrapper:  # built lazily so importing this module does not import torch
    @staticmethod
    def make(model: Any, family: str) -> Any:
        import torch

        class Wrapper(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.m = model

            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
                if family in DECODERS:
                    return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
                return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

        return Wrapper().eval()


def torch_forward(family: str, model: Any, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The exported output computed by torch itself (for a torch-vs-ONNX sanity check)."""
    import torch

    with torch.no_grad():
        out = _Wrapper.make(model, family)(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    return out.numpy()


def _export(family: str, exporter: str, attn: str, path: Path, model: Any) -> None:
    import torch

    wrapper = _Wrapper.make(model, family)
    args = tuple(torch.from_numpy(v) for v in make_inputs(0).values())
    names = ["input_ids", "attention_mask"]
    out = [OUTPUT_NAME[family]]
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            axes = {n: {0: "batch", 1: "seq"} for n in names}
            torch.onnx.export(wrapper, args, str(path), input_names=names, output_names=out, dynamo=False,
                              opset_version=17, dynamic_axes=axes)
        elif exporter == "dynamo":
            batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=64)
            dyn = {n: {0: batch, 1: seq} for n in names}
            torch.onnx.export(wrapper, args, str(path), input_names=names, output_names=out, dynamo=True,
                              dynamic_shapes=dyn, external_data=False, verbose=False)
        else:
            raise ValueError(f"unknown exporter {exporter!r} (known: {', '.join(EXPORTERS)})")


def _out_root(out_dir: str | os.PathLike | None) -> Path:
    global _TMP
    if out_dir is not None:
        return Path(out_dir)
    if os.environ.get("FUSEC_HF_EXPORT_DIR"):
        return Path(os.environ["FUSEC_HF_EXPORT_DIR"])
    if _TMP is None:
        _TMP = tempfile.mkdtemp(prefix="fusec-hf-")
        atexit.register(shutil.rmtree, _TMP, True)
    return Path(_TMP)


def _stamp() -> str:
    import torch
    import transformers

    return json.dumps({"v": _STAMP_VERSION, "torch": torch.__version__, "transformers": transformers.__version__})


def export_hf(family: str, exporter: str, out_dir: str | os.PathLike | None = None, *,
              attn: str = "eager") -> tuple[str, dict[str, np.ndarray], Any]:
    """Export (once per process) the tiny ``family`` model with ``exporter``; see the module doc."""
    import pytest

    key = (family, exporter, attn)
    if key not in _CACHE:
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
        root = _out_root(out_dir)
        root.mkdir(parents=True, exist_ok=True)
        path = root / f"{family}-{exporter}-{attn}.onnx"
        stamp = path.with_suffix(".stamp")
        model = build_model(family, attn)
        if not (path.exists() and stamp.exists() and stamp.read_text() == _stamp()):
            try:
                _export(family, exporter, attn, path, model)
                stamp.write_text(_stamp())
            except Exception as e:  # the exporter's own failure: report it, don't hide it in a traceback
                msg = str(e).strip().splitlines()
                _CACHE[key] = (f"{exporter} export of {family} ({attn}) failed: {type(e).__name__}: "
                               f"{msg[0][:300] if msg else ''}")
        if key not in _CACHE:
            _CACHE[key] = (str(path), make_inputs(), model)
    got = _CACHE[key]
    if isinstance(got, str):
        pytest.skip(got)
    return got
