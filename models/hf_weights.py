"""Real weights from a local Hugging Face checkpoint directory (config.json + *.safetensors).

``config_from_hf`` maps the checkpoint's config.json onto a built-in ModelConfig (its dims win);
``hf_decoder_config`` reads a Llama-style decoder's directory on its own (models/hf_config.py);
``HFWeights`` hands out the checkpoint's tensors by HF name as fp32, checking shapes, and at the
end reports tensors the graph never used. HF names in a checkpoint carry the wrapper prefix of
the class that saved them (``transformer.`` for GPT2LMHeadModel, ``model.`` for *ForCausalLM,
``bert.`` for BertFor*); fusec's builders ask for names without it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from fusec.errors import InputError, ModelError
from fusec.modelfiles import fd_path, open_file, read_json_in_dir
from fusec.shapes import check_size
from fusec.text import config_token_ids

from .hf_config import _bool, _int, _opt, _positive_float, _str, decoder_config
from .registry import LLAMA_STYLE, ModelConfig

_PREFIXES = ("transformer.", "model.", "bert.")

# Tensors a checkpoint may hold that the graph has no use for: persistent buffers (GPT-2's causal
# "attn.bias", BERT's position/token-type id buffers, old RoPE inv_freq) and task heads that sit
# outside the graph (BERT pooler and MLM/NSP heads). Anything else left over is an error.
_IGNORED = re.compile(r"(^|\.)attn\.(masked_)?bias$|^embeddings\.(position_ids|token_type_ids)$"
                      r"|rotary_emb\.inv_freq$|^pooler\.|^cls\.")

# HF config.json keys per family -> ModelConfig fields (Llama-style decoders: models/hf_config.py).
_KEYS: dict[str, dict[str, str]] = {
    "gpt2": {"vocab_size": "vocab_size", "n_embd": "hidden_size", "n_layer": "num_layers", "n_head": "num_heads",
             "n_positions": "max_positions", "layer_norm_epsilon": "norm_eps",
             "activation_function": "activation"},
    "bert": {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_layers",
             "num_attention_heads": "num_heads", "intermediate_size": "intermediate_size",
             "max_position_embeddings": "max_positions", "layer_norm_eps": "norm_eps", "hidden_act": "activation",
             "type_vocab_size": "type_vocab_size"},
}
_ACTIVATIONS = {"gpt2": ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu"), "bert": ("gelu", "gelu_new", "relu")}


_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors dtypes HFWeights reads (as fp32)

# How each family names its layers (after the wrapper prefix): the layer count of config.json must
# match the layers the checkpoint holds.
_LAYER = {"gpt2": re.compile(r"h\.(\d+)\."), "bert": re.compile(r"encoder\.layer\.(\d+)\."),
          **{f: re.compile(r"layers\.(\d+)\.") for f in LLAMA_STYLE}}

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


def config_from_hf(base: ModelConfig, weights_dir: str | os.PathLike[str]) -> ModelConfig:
    """``base`` with the dims of ``weights_dir/config.json``; ModelError for another model family
    or a feature fusec's builder for that family does not implement. Every key that is used is
    checked by type (sizes are ints > 0, flags are bools, eps/theta finite numbers > 0) and the
    layer count against the layers the checkpoint's tensors hold: one ModelError naming the key."""
    hf = _read_config(weights_dir)
    where = _label(weights_dir)
    family = base.family
    if family in LLAMA_STYLE:
        from .families import BY_HF_TYPE

        fam = BY_HF_TYPE.get(hf.get("model_type"))  # type: ignore[arg-type]
        if fam is None or fam.name != family:
            raise ModelError(f"checkpoint in {os.fspath(weights_dir)!r} is model_type {hf.get('model_type')!r:.60}, "
                             f"but {base.name!r} is a {family} model")
        _early_layer_check(hf, family, weights_dir, where)  # before anything is made per layer
        return _checked(decoder_config(hf, where, base, base.name), weights_dir, where)
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
    if changes.get("activation", base.activation) not in _ACTIVATIONS[family]:
        raise ModelError(f"activation {changes['activation']!r} is not supported for {family} models")
    try:
        cfg = dataclasses.replace(base, **changes)
    except ModelError as e:
        raise ModelError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ModelError(f"config.json in {os.fspath(weights_dir)!r} does not fit {base.name!r}: {e}") from None
    return _checked(cfg, weights_dir, where)


def hf_decoder_config(weights_dir: str | os.PathLike[str]) -> ModelConfig:
    """The ModelConfig of a Llama-style decoder's checkpoint directory (any family of
    models/families.py), named after the directory; the same checks as ``config_from_hf``."""
    from .hf_config import family_of

    name = Path(weights_dir).resolve().name or "checkpoint"
    where = _label(weights_dir)
    hf = _read_config(weights_dir)
    _early_layer_check(hf, family_of(hf, where).name, weights_dir, where)  # before anything is made per layer
    return _checked(decoder_config(hf, where, None, name), weights_dir, where)


def _early_layer_check(hf: dict[str, Any], family: str, weights_dir: str | os.PathLike[str], where: str) -> None:
    if hf.get("num_hidden_layers") is not None:
        _check_layer_count(family, _int(hf["num_hidden_layers"], f"{where}: num_hidden_layers"), weights_dir, where)


def _checked(cfg: ModelConfig, weights_dir: str | os.PathLike[str], where: str) -> ModelConfig:
    _check_sizes(cfg, where)
    _check_layers(cfg, weights_dir, where)
    return cfg


def _check_sizes(cfg: ModelConfig, where: str) -> None:
    if cfg.family in LLAMA_STYLE and cfg.head_dim % 2:
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
    _check_layer_count(cfg.family, cfg.num_layers, weights_dir, where)


def _check_layer_count(family: str, layers: int, weights_dir: str | os.PathLike[str], where: str) -> None:
    """config.json's layer count against the checkpoint (its safetensors headers): a count no
    tensors back (num_hidden_layers = 10**12) would build layers until memory runs out."""
    pattern = _LAYER[family]
    held: set[int] = set()
    for name in _safetensors_names(weights_dir):
        with _open_safetensors(weights_dir, name) as handle:
            for key in handle.keys():
                m = pattern.match(_canonical(key))
                if m:
                    held.add(int(m.group(1)))
    if len(held) != layers or (held and (min(held), max(held)) != (0, layers - 1)):
        key = next((k for k, f in _KEYS.get(family, {}).items() if f == "num_layers"), "num_hidden_layers")
        if not held:
            holds = "no layers"
        elif held == set(range(len(held))):
            holds = f"{len(held)} layers"
        else:
            holds = f"layers {sorted(held)[:8]}{'...' if len(held) > 8 else ''}"
        raise ModelError(f"{where}: {key} is {layers}, but the checkpoint's tensors hold {holds}")


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
