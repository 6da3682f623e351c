"""Real weights from a local Hugging Face checkpoint directory (config.json + *.safetensors).

``config_from_hf`` maps the checkpoint's config.json onto a built-in ModelConfig (its dims win);
``HFWeights`` hands out the checkpoint's tensors by HF name as fp32, checking shapes, and at the
end reports tensors the graph never used. HF names in a checkpoint carry the wrapper prefix of
the class that saved them (``transformer.`` for GPT2LMHeadModel, ``model.`` for *ForCausalLM,
``bert.`` for BertFor*); fusec's builders ask for names without it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fusec.errors import InputError, ModelError
from fusec.modelfiles import fd_path, open_file, read_json_in_dir
from fusec.shapes import check_size
from fusec.text import config_token_ids

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


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors dtypes HFWeights reads (as fp32)

# How each family names its layers (after the wrapper prefix): the layer count of config.json must
# match the layers the checkpoint holds.
_LAYER = {"gpt2": re.compile(r"h\.(\d+)\."), "bert": re.compile(r"encoder\.layer\.(\d+)\."),
          "llama": re.compile(r"layers\.(\d+)\."), "qwen3": re.compile(r"layers\.(\d+)\.")}

_INT_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "max_positions",
               "num_kv_heads", "head_dim", "type_vocab_size")
_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias")


def _label(weights_dir: str | os.PathLike[str], name: str = "config.json") -> str:
    return repr(os.path.join(os.fspath(weights_dir), name))


def _read_config(weights_dir: str | os.PathLike[str]) -> dict[str, Any]:
    data = read_json_in_dir(weights_dir, "config.json", missing_ok=True)
    if data is None:
        raise ModelError(f"checkpoint directory {os.fspath(weights_dir)!r} has no config.json")
    return data


def _int(value: Any, where: str) -> int:
    """A size from config.json: an int (not a bool, not 64.0, not "64") greater than 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelError(f"{where} is {value!r:.60}, not a positive integer")
    return value


def _of_type(kind: type, words: str) -> Callable[[Any, str], Any]:
    """A check that a config.json value is a ``kind`` (``words`` in the error: "a string")."""
    def check(value: Any, where: str) -> Any:
        if not isinstance(value, kind):
            raise ModelError(f"{where} is {value!r:.60}, not {words}")
        return value

    return check


_bool = _of_type(bool, "true or false")
_str = _of_type(str, "a string")
_object = _of_type(dict, "a JSON object")


def _positive_float(value: Any, where: str) -> float:
    """eps, RoPE theta: a finite number greater than 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelError(f"{where} is {value!r:.60}, not a number")
    try:
        f = float(value)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f) or f <= 0:
        raise ModelError(f"{where} is {value!r:.60}, not a finite number greater than 0")
    return f


def _opt(hf: dict[str, Any], key: str, check: Any, where: str, default: Any) -> Any:
    """``hf[key]`` checked, or ``default`` when it is absent or null."""
    value = hf.get(key)
    return default if value is None else check(value, f"{where}: {key}")


def config_from_hf(base: ModelConfig, weights_dir: str | os.PathLike[str]) -> ModelConfig:
    """``base`` with the dims of ``weights_dir/config.json``; ModelError for another model family
    or a feature fusec's builder for that family does not implement. Every key that is used is
    checked by type (sizes are ints > 0, flags are bools, eps/theta finite numbers > 0) and the
    layer count against the layers the checkpoint's tensors hold: one ModelError naming the key."""
    hf = _read_config(weights_dir)
    where = _label(weights_dir)
    family = base.family
    if hf.get("model_type") != family:
        raise ModelError(f"checkpoint in {os.fspath(weights_dir)!r} is model_type {hf.get('model_type')!r:.60}, "
                         f"but {base.name!r} is a {family} model")
    changes: dict[str, Any] = {}
    for key, field in _KEYS[family].items():
        value = hf.get(key)
        if value is None:
            continue
        at = f"{where}: {key}"
        if field in _INT_FIELDS:
            changes[field] = _int(value, at)
        elif field in _BOOL_FIELDS:
            changes[field] = _bool(value, at)
        elif field == "norm_eps":
            changes[field] = _positive_float(value, at)
        else:
            changes[field] = _str(value, at)
    if hf.get("eos_token_id") is not None:  # read by generation when no other file names one
        config_token_ids(hf["eos_token_id"], f"{where}: eos_token_id")
    if family in ("gpt2", "bert"):
        changes.update(head_dim=0, num_kv_heads=0)  # derived again from hidden_size / heads
    if family == "gpt2":
        changes["intermediate_size"] = _opt(hf, "n_inner", _int, where,
                                            4 * int(changes.get("hidden_size", base.hidden_size)))
        if (not _opt(hf, "scale_attn_weights", _bool, where, True)
                or _opt(hf, "scale_attn_by_inverse_layer_idx", _bool, where, False)):
            raise ModelError("GPT-2 checkpoints with unscaled or layer-scaled attention are not supported")
        changes["tie_word_embeddings"] = True  # GPT2LMHeadModel always ties lm_head to wte
    if family == "bert":
        kind = _opt(hf, "position_embedding_type", _str, where, "absolute")
        if kind != "absolute":
            raise ModelError(f"{where}: BERT position_embedding_type {kind!r:.60} is not supported")
    if family in ("llama", "qwen3"):
        changes.update(_rope(hf, family, where))
        if hf.get("head_dim") is None:  # the HF defaults: Llama derives it, Qwen3 fixes 128
            changes["head_dim"] = 0 if family == "llama" else 128
        if family == "qwen3" and _opt(hf, "use_sliding_window", _bool, where, False):
            raise ModelError("Qwen3 sliding-window attention is not supported")
        if hf.get("tie_word_embeddings") is None:
            changes["tie_word_embeddings"] = False  # the HF config default for both families
        if hf.get("num_key_value_heads") is None:
            changes["num_kv_heads"] = 0  # HF: same as num_attention_heads
    if changes.get("activation", base.activation) not in _ACTIVATIONS[family]:
        raise ModelError(f"activation {changes['activation']!r} is not supported for {family} models")
    try:
        cfg = dataclasses.replace(base, **changes)
    except ModelError as e:
        raise ModelError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ModelError(f"config.json in {os.fspath(weights_dir)!r} does not fit {base.name!r}: {e}") from None
    _check_sizes(cfg, where)
    _check_layers(cfg, weights_dir, where)
    return cfg


def _check_sizes(cfg: ModelConfig, where: str) -> None:
    if cfg.family in ("llama", "qwen3") and cfg.head_dim % 2:
        raise ModelError(f"{where}: head_dim {cfg.head_dim} is odd; rotary embeddings rotate pairs of dims")
    shapes = {"the embedding": (cfg.vocab_size, cfg.hidden_size),
              "the query projection": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
              "the MLP": (cfg.intermediate_size, cfg.hidden_size),
              "the position table": (cfg.max_positions, cfg.hidden_size if cfg.family in ("gpt2", "bert") else 1)}
    for what, shape in shapes.items():
        try:
            check_size(shape, f"{what} ({where})", 4)
        except InputError as e:
            raise ModelError(str(e)) from None


def _check_layers(cfg: ModelConfig, weights_dir: str | os.PathLike[str], where: str) -> None:
    """config.json's layer count against the checkpoint (its safetensors headers): a count no
    tensors back (num_hidden_layers = 10**12) would build layers until memory runs out."""
    pattern = _LAYER[cfg.family]
    held: set[int] = set()
    for name in _safetensors_names(weights_dir):
        with _open_safetensors(weights_dir, name) as handle:
            for key in handle.keys():
                m = pattern.match(_canonical(key))
                if m:
                    held.add(int(m.group(1)))
    if len(held) != cfg.num_layers or (held and (min(held), max(held)) != (0, cfg.num_layers - 1)):
        key = next(k for k, f in _KEYS[cfg.family].items() if f == "num_layers")
        if not held:
            holds = "no layers"
        elif held == set(range(len(held))):
            holds = f"{len(held)} layers"
        else:
            holds = f"layers {sorted(held)[:8]}{'...' if len(held) > 8 else ''}"
        raise ModelError(f"{where}: {key} is {cfg.num_layers}, but the checkpoint's tensors hold {holds}")


def _rope(hf: dict[str, Any], family: str, where: str) -> dict[str, Any]:
    # transformers >= 5 writes rope_parameters={"rope_type", "rope_theta"}; 4.x wrote rope_theta
    # at the top level and rope_scaling for non-default variants.
    params = _opt(hf, "rope_parameters", _object, where, {})
    scaling = _opt(hf, "rope_scaling", _object, where, {})
    named = [(f"rope_parameters.{k}", params.get(k)) for k in ("rope_type",)]
    named += [(f"rope_scaling.{k}", scaling.get(k)) for k in ("rope_type", "type")]
    rope_type = next((_str(v, f"{where}: {k}") for k, v in named if v is not None), "default")
    if rope_type != "default":
        raise ModelError(f"{family} RoPE type {rope_type!r:.60} is not supported (only the default)")
    key, theta = "rope_parameters.rope_theta", params.get("rope_theta")
    if theta is None:
        key, theta = "rope_theta", hf.get("rope_theta")
    return {} if theta is None else {"rope_theta": _positive_float(theta, f"{where}: {key}")}


def _safetensors_names(weights_dir: str | os.PathLike[str]) -> list[str]:
    names = sorted(p.name for p in Path(weights_dir).glob("*.safetensors"))
    if not names:
        raise ModelError(f"checkpoint directory {os.fspath(weights_dir)!r} has no *.safetensors file")
    return names


def _open_safetensors(weights_dir: str | os.PathLike[str], name: str) -> Any:
    """safetensors' handle on ``weights_dir/name``, opened through the checked descriptor
    (a regular file inside the directory, no symlink, no FIFO: fusec.modelfiles)."""
    from safetensors import safe_open

    opened = open_file(weights_dir, name)
    assert opened is not None
    fd, _ = opened
    label = os.path.join(os.fspath(weights_dir), name)
    try:
        return safe_open(fd_path(fd, label), framework="numpy")
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ModelError(f"cannot read {label!r}: {_one_line(e)}") from None
    finally:
        os.close(fd)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text[:300] + "...") if len(text) > 300 else (text or type(e).__name__)


class HFWeights:
    """The tensors of ``weights_dir/*.safetensors`` by HF name (wrapper prefix stripped), as fp32."""

    def __init__(self, weights_dir: str | os.PathLike[str], cfg: ModelConfig):
        self.dir = Path(weights_dir)
        self._handles = []
        self._where: dict[str, tuple[Any, str]] = {}  # canonical name -> (open file, key in file)
        for name in _safetensors_names(self.dir):
            handle = _open_safetensors(self.dir, name)
            try:
                keys = list(handle.keys())
            except Exception as e:
                raise ModelError(f"cannot read {os.fspath(self.dir / name)!r}: {_one_line(e)}") from None
            self._handles.append(handle)
            for key in keys:
                canonical = _canonical(key)
                if canonical in self._where:
                    raise ModelError(f"checkpoint holds tensor {canonical!r} twice ({key!r} in {name})")
                self._where[canonical] = (handle, key)
        self._used: set[str] = set()
        if cfg.tie_word_embeddings:
            self._used.add("lm_head.weight")  # a tied checkpoint may still store the copy

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds tensor ``name`` (wrapper prefix stripped)."""
        return name in self._where

    def get(self, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors hands BF16 out as it)

        entry = self._where.get(name)
        if entry is None:
            raise ModelError(f"checkpoint in {os.fspath(self.dir)!r} has no tensor {name!r} "
                             f"(expected shape {list(shape)})")
        handle, key = entry
        try:
            info = handle.get_slice(key)
            got, dtype = tuple(info.get_shape()), str(info.get_dtype())
        except Exception as e:
            raise ModelError(f"checkpoint tensor {key!r} cannot be read: {_one_line(e)}") from None
        if got != tuple(shape):
            raise ModelError(f"checkpoint tensor {key!r} has shape {list(got)}, the config implies {list(shape)}")
        if dtype not in _FLOAT_DTYPES:  # FP8/FP4/FP6, ints, bools: refused from the header, before any read
            raise ModelError(f"checkpoint tensor {key!r} has dtype {dtype}, expected a float type "
                             f"({', '.join(_FLOAT_DTYPES)})")
        try:
            arr = handle.get_tensor(key)
        except Exception as e:
            raise ModelError(f"checkpoint tensor {key!r} cannot be read: {_one_line(e)}") from None
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
