"""Real weights from a local Hugging Face checkpoint directory (config.json + *.safetensors).

``config_from_hf`` maps the checkpoint's config.json onto a built-in ModelConfig (its dims win);
``HFWeights`` hands out the checkpoint's tensors by HF name as fp32, checking shapes, and at the
end reports tensors the graph never used. HF names in a checkpoint carry the wrapper prefix of
the class that saved them (``transformer.`` for GPT2LMHeadModel, ``model.`` for *ForCausalLM,
``bert.`` for BertFor*); fusec's builders ask for names without it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from fusec.errors import ModelError

from .registry import ModelConfig

_PREFIXES = ("transformer.", "model.", "bert.")

# Tensors a checkpoint may hold that the graph has no use for: persistent buffers (GPT-2's causal
# "attn.bias", BERT's position/token-type id buffers, old RoPE inv_freq) and task heads that sit
# outside the graph (BERT pooler and MLM/NSP heads). Anything else left over is an error.
_IGNORED = re.compile(r"(^|\.)attn\.(masked_)?bias$|^embeddings\.(position_ids|token_type_ids)$"
                      r"|rotary_emb\.inv_freq$|^pooler\.|^cls\.")

# HF config.json keys per family -> ModelConfig fields.
_KEYS: dict[str, dict[str, str]] = {
    "gpt2": {"vocab_size": "vocab_size", "n_embd": "hidden_size", "n_layer": "num_layers", "n_head": "num_heads",
             "n_positions": "max_positions", "layer_norm_epsilon": "norm_eps",
             "activation_function": "activation"},
    "bert": {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
             "num_attention_heads": "num_heads", "intermediate_size": "intermediate_size",
             "max_position_embeddings": "max_positions", "layer_norm_eps": "norm_eps", "hidden_act": "activation",
             "type_vocab_size": "type_vocab_size"},
    "llama": {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
              "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
              "intermediate_size": "intermediate_size", "max_position_embeddings": "max_positions",
              "rms_norm_eps": "norm_eps", "hidden_act": "activation", "tie_word_embeddings": "tie_word_embeddings",
              "attention_bias": "attention_bias", "mlp_bias": "mlp_bias"},
}
_KEYS["qwen3"] = {k: v for k, v in _KEYS["llama"].items() if k != "mlp_bias"}
_ACTIVATIONS = {"gpt2": ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu"), "bert": ("gelu", "gelu_new", "relu"),
                "llama": ("silu",), "qwen3": ("silu",)}


def _read_config(weights_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(weights_dir) / "config.json"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelError(f"checkpoint directory {os.fspath(weights_dir)!r} has no config.json") from None
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {os.fspath(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{os.fspath(path)!r} does not hold a JSON object")
    return data


def config_from_hf(base: ModelConfig, weights_dir: str | os.PathLike[str]) -> ModelConfig:
    """``base`` with the dims of ``weights_dir/config.json``; ModelError for another model family
    or a feature fusec's builder for that family does not implement."""
    hf = _read_config(weights_dir)
    family = base.family
    if hf.get("model_type") != family:
        raise ModelError(f"checkpoint in {os.fspath(weights_dir)!r} is model_type {hf.get('model_type')!r}, "
                         f"but {base.name!r} is a {family} model")
    changes: dict[str, Any] = {}
    for key, field in _KEYS[family].items():
        if hf.get(key) is not None:
            changes[field] = hf[key]
    if family in ("gpt2", "bert"):
        changes.update(head_dim=0, num_kv_heads=0)  # derived again from hidden_size / heads
    if family == "gpt2":
        changes["intermediate_size"] = hf.get("n_inner") or 4 * int(changes.get("hidden_size", base.hidden_size))
        if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
            raise ModelError("GPT-2 checkpoints with unscaled or layer-scaled attention are not supported")
        changes["tie_word_embeddings"] = True  # GPT2LMHeadModel always ties lm_head to wte
    if family == "bert" and hf.get("position_embedding_type", "absolute") != "absolute":
        raise ModelError(f"BERT position_embedding_type {hf['position_embedding_type']!r} is not supported")
    if family in ("llama", "qwen3"):
        changes.update(_rope(hf, family))
        if "head_dim" not in hf:  # the HF defaults: Llama derives it, Qwen3 fixes 128
            changes["head_dim"] = 0 if family == "llama" else 128
        if family == "qwen3" and hf.get("use_sliding_window"):
            raise ModelError("Qwen3 sliding-window attention is not supported")
        if "tie_word_embeddings" not in hf:
            changes["tie_word_embeddings"] = False  # the HF config default for both families
        if "num_key_value_heads" not in hf:
            changes["num_kv_heads"] = 0  # HF: same as num_attention_heads
    if changes.get("activation", base.activation) not in _ACTIVATIONS[family]:
        raise ModelError(f"activation {changes['activation']!r} is not supported for {family} models")
    try:
        return dataclasses.replace(base, **changes)
    except (TypeError, ValueError) as e:
        raise ModelError(f"config.json in {os.fspath(weights_dir)!r} does not fit {base.name!r}: {e}") from None


def _rope(hf: dict[str, Any], family: str) -> dict[str, Any]:
    # transformers >= 5 writes rope_parameters={"rope_type", "rope_theta"}; 4.x wrote rope_theta
    # at the top level and rope_scaling for non-default variants.
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ModelError(f"{family} RoPE type {rope_type!r} is not supported (only the default)")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    return {"rope_theta": float(theta)} if theta is not None else {}


class HFWeights:
    """The tensors of ``weights_dir/*.safetensors`` by HF name (wrapper prefix stripped), as fp32."""

    def __init__(self, weights_dir: str | os.PathLike[str], cfg: ModelConfig):
        from safetensors import safe_open

        self.dir = Path(weights_dir)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise ModelError(f"checkpoint directory {os.fspath(weights_dir)!r} has no *.safetensors file")
        self._handles = []
        self._where: dict[str, tuple[Any, str]] = {}  # canonical name -> (open file, key in file)
        for path in files:
            try:
                handle = safe_open(os.fspath(path), framework="numpy")
                keys = list(handle.keys())
            except Exception as e:  # safetensors raises its own error types for corrupt files
                raise ModelError(f"cannot read {os.fspath(path)!r}: {e}") from None
            self._handles.append(handle)
            for key in keys:
                name = _canonical(key)
                if name in self._where:
                    raise ModelError(f"checkpoint holds tensor {name!r} twice ({key!r} in {path.name})")
                self._where[name] = (handle, key)
        self._used: set[str] = set()
        if cfg.tie_word_embeddings:
            self._used.add("lm_head.weight")  # a tied checkpoint may still store the copy

    def get(self, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        entry = self._where.get(name)
        if entry is None:
            raise ModelError(f"checkpoint in {os.fspath(self.dir)!r} has no tensor {name!r} "
                             f"(expected shape {list(shape)})")
        handle, key = entry
        got = tuple(handle.get_slice(key).get_shape())
        if got != tuple(shape):
            raise ModelError(f"checkpoint tensor {key!r} has shape {list(got)}, the config implies {list(shape)}")
        arr = handle.get_tensor(key)
        if not (arr.dtype.kind == "f" or arr.dtype.name == "bfloat16"):
            raise ModelError(f"checkpoint tensor {key!r} has dtype {arr.dtype}, expected a float type")
        self._used.add(name)
        return np.ascontiguousarray(arr.astype(np.float32, copy=False))

    def finish(self) -> None:
        extra = sorted(n for n in self._where if n not in self._used and not _IGNORED.search(n))
        if extra:
            more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
            raise ModelError(f"checkpoint in {os.fspath(self.dir)!r} holds tensors the model does not use: "
                             f"{', '.join(repr(n) for n in extra[:5])}{more}")


def _canonical(key: str) -> str:
    for p in _PREFIXES:
        if key.startswith(p):
            return key[len(p):]
    return key
