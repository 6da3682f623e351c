"""Tiny random Hugging Face vision/audio transformers exported to ONNX (issue 12's ViT, CLIP and
Whisper-encoder families), with the same recipe as ``tests/hf_models.py``.

API
---
``export_family(family, exporter, attn="eager") -> (onnx_path, inputs, model)``: ``family`` is a
key of ``FAMILIES``, ``exporter`` ``"legacy"`` (TorchScript, opset 17) or ``"dynamo"``, ``attn``
the HF attention implementation (``"eager"`` or ``"sdpa"``). One export per
(family, exporter, attn) per process, into ``hf_models``' export directory (a temporary one removed at
exit, or ``$FUSEC_HF_EXPORT_DIR`` if set, guarded by its version stamp). An exporter that fails calls
``pytest.skip`` with its error in one line.
``torch_forward(family, model, inputs)``: the exported output computed by torch.
``FAMILIES[family]``: ``Family(inputs, output, layers)``.

Shapes are fixed (no symbolic dims): the pixel/feature inputs of these models have one valid size.
Weights are seeded per family and every parameter gets non-zero noise (a dropped bias shows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from hf_models import _out_root, _stamp  # the export directory and version stamp hf_models uses

EXPORTERS = ("legacy", "dynamo")
BATCH, IMAGE, PATCH, CHANNELS, MELS, FRAMES, SEQ, VOCAB, PAD_LEN = 2, 32, 8, 3, 16, 32, 12, 256, 4


@dataclasses.dataclass(frozen=True)
class Family:
    inputs: tuple[str, ...]
    output: str  # the HF output field exported (and the ONNX output's name)
    layers: int = 2  # attention layers (0: a convolutional network)


FAMILIES = {
    "vit": Family(("pixel_values",), "last_hidden_state"),
    "clip_vision": Family(("pixel_values",), "last_hidden_state"),
    "clip_text": Family(("input_ids", "attention_mask"), "last_hidden_state"),
    "whisper_encoder": Family(("input_features",), "last_hidden_state"),
    # convolutional networks: 3x3 and 1x1 convs, BatchNorm, MaxPool, global average pooling
    # (ResNet's pooled output); depthwise 7x7 convs and channels-last LayerNorms (ConvNeXt)
    "resnet": Family(("pixel_values",), "pooler_output", layers=0),
    "convnext": Family(("pixel_values",), "last_hidden_state", layers=0),
}
ATTENTION_FAMILIES = [f for f, fam in FAMILIES.items() if fam.layers]

_CACHE: dict[tuple[str, str, str], tuple[str, dict[str, np.ndarray], Any] | str] = {}
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def build_model(family: str, attn: str = "eager") -> Any:
    """The tiny HF model of ``family`` (``attn``: the HF attention implementation, eager or sdpa;
    eval mode, perturbed weights)."""
    import torch
    import transformers as T

    torch.manual_seed(zlib.crc32(family.encode()))
    if family == "vit":
        cfg = T.ViTConfig(**_SMALL, image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = T.ViTModel(cfg, add_pooling_layer=False)
    elif family == "clip_vision":
        cfg = T.CLIPVisionConfig(**_SMALL, image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS)
        model = T.CLIPVisionModel(cfg)
    elif family == "clip_text":
        cfg = T.CLIPTextConfig(**_SMALL, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=1,
                               bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1)
        model = T.CLIPTextModel(cfg)
    elif family == "whisper_encoder":
        cfg = T.WhisperConfig(vocab_size=VOCAB, num_mel_bins=MELS, d_model=64, encoder_layers=2, decoder_layers=1,
                              encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                              decoder_ffn_dim=128, max_source_positions=FRAMES // 2, max_target_positions=16,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
        model = T.WhisperModel(cfg).get_encoder()
    elif family == "resnet":
        model = T.ResNetModel(T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                             layer_type="basic", num_channels=CHANNELS))
    elif family == "convnext":
        model = T.ConvNextModel(T.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                                                 num_channels=CHANNELS))
    else:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    if FAMILIES[family].layers:
        model.set_attn_implementation(attn)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():  # BatchNorm statistics too
            if name.endswith("running_mean"):
                b.add_(torch.randn_like(b) * 0.1)
            elif name.endswith("running_var"):
                b.mul_(1 + torch.rand_like(b))
    return model.eval()


def make_inputs(family: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if family in ("vit", "clip_vision", "resnet", "convnext"):
        return {"pixel_values": rng.standard_normal((BATCH, CHANNELS, IMAGE, IMAGE)).astype(np.float32)}
    if family == "whisper_encoder":
        return {"input_features": rng.standard_normal((BATCH, MELS, FRAMES)).astype(np.float32)}
    ids = rng.integers(3, VOCAB - 1, size=(BATCH, SEQ), dtype=np.int64)  # CLIP pools at argmax(id): keep it away
    mask = np.ones((BATCH, SEQ), np.int64)
    mask[1, SEQ - PAD_LEN:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _wrapper(model: Any, family: str) -> Any:
    import torch

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return getattr(self.m(**dict(zip(FAMILIES[family].inputs, args))), FAMILIES[family].output)

    return Wrapper().eval()


def torch_forward(family: str, model: Any, inputs: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return _wrapper(model, family)(*[torch.from_numpy(inputs[k]) for k in FAMILIES[family].inputs]).numpy()


def _export(family: str, exporter: str, path: Path, model: Any) -> None:
    import torch

    fam = FAMILIES[family]
    feed = make_inputs(family, seed=1)
    args = tuple(torch.from_numpy(feed[k]) for k in fam.inputs)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.export(_wrapper(model, family), args, str(path), input_names=list(fam.inputs),
                              output_names=[fam.output], dynamo=False, opset_version=17)
        elif exporter == "dynamo":
            torch.onnx.export(_wrapper(model, family), args, str(path), input_names=list(fam.inputs),
                              output_names=[fam.output], dynamo=True, external_data=False, verbose=False)
        else:
            raise ValueError(f"unknown exporter {exporter!r} (known: {', '.join(EXPORTERS)})")


def export_family(family: str, exporter: str, attn: str = "eager") -> tuple[str, dict[str, np.ndarray], Any]:
    """Export (once per process) the tiny ``family`` model with ``exporter``; see the module doc."""
    import pytest

    key = (family, exporter, attn)
    if key not in _CACHE:
        root = _out_root(None)
        root.mkdir(parents=True, exist_ok=True)
        path = root / f"vision-{family}-{exporter}-{attn}.onnx"
        stamp = path.with_suffix(".stamp")
        model = build_model(family, attn)
        if not (path.exists() and stamp.exists() and stamp.read_text() == _stamp()):
            try:
                _export(family, exporter, path, model)
                stamp.write_text(_stamp())
            except Exception as e:  # the exporter's own failure, in one line
                msg = str(e).strip().splitlines()
                _CACHE[key] = f"{exporter} export of {family} failed: {type(e).__name__}: {msg[0][:300] if msg else ''}"
        if key not in _CACHE:
            _CACHE[key] = (str(path), make_inputs(family, seed=zlib.crc32(family.encode()) % 1000), model)
    got = _CACHE[key]
    if isinstance(got, str):
        pytest.skip(got)
    return got
