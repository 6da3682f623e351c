"""config.json of a Llama-style decoder (every family of ``models/families.py``) -> ModelConfig.

One key table for every family (HF names these keys alike); the family supplies the defaults of
keys a config.json leaves out and the traits of its architecture. Every value used is checked by
type and range, and any problem is one ModelError naming the file and key. RoPE is read from
either form transformers writes: ``rope_parameters`` (5.x; Gemma 3 nests one per layer type) or
``rope_theta`` + ``rope_scaling`` (4.x).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from fusec.errors import ModelError
from fusec.text import config_token_ids

from .families import BY_HF_TYPE, Family, refusal
from .registry import ModelConfig
from .rope import RopeScaling


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


def _number(value: Any, where: str, least: float = 0.0, strict: bool = True) -> float:
    """A finite number greater than ``least`` (or equal, when not ``strict``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelError(f"{where} is {value!r:.60}, not a number")
    try:
        f = float(value)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f) or f < least or (strict and f == least):
        raise ModelError(f"{where} is {value!r:.60}, not a finite number {'>' if strict else '>='} {least:g}")
    return f


def _positive_float(value: Any, where: str) -> float:
    """eps, RoPE theta: a finite number greater than 0."""
    return _number(value, where)


def _opt(hf: dict[str, Any], key: str, check: Any, where: str, default: Any) -> Any:
    """``hf[key]`` checked, or ``default`` when it is absent or null."""
    value = hf.get(key)
    return default if value is None else check(value, f"{where}: {key}")


# config.json key -> (ModelConfig field, check); absent or null keys keep the default
_KEYS: dict[str, tuple[str, Callable[[Any, str], Any]]] = {
    "vocab_size": ("vocab_size", _int), "hidden_size": ("hidden_size", _int),
    "num_hidden_layers": ("num_layers", _int), "num_attention_heads": ("num_heads", _int),
    "num_key_value_heads": ("num_kv_heads", _int), "head_dim": ("head_dim", _int),
    "intermediate_size": ("intermediate_size", _int), "max_position_embeddings": ("max_positions", _int),
    "rms_norm_eps": ("norm_eps", _positive_float), "tie_word_embeddings": ("tie_word_embeddings", _bool),
    "attention_bias": ("attention_bias", _bool), "mlp_bias": ("mlp_bias", _bool),
    "sliding_window": ("sliding_window", _int), "attn_logit_softcapping": ("attn_softcap", _positive_float),
    "final_logit_softcapping": ("final_softcap", _positive_float),
}
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings", "rms_norm_eps")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_new", "gelu", "relu")
LAYER_TYPES = {"sliding_attention": True, "full_attention": False}


def family_of(hf: dict[str, Any], where: str) -> Family:
    """The family of a config.json, or one ModelError naming the unsupported architecture."""
    model_type = hf.get("model_type")
    if "text_config" in hf or "vision_config" in hf or "audio_config" in hf:
        raise ModelError(f"{where}: model_type {model_type!r:.60} is a multimodal model; fusec runs text "
                         "decoders only")
    why = refusal(model_type, gguf=False)
    if why is not None:
        raise ModelError(f"{where}: {why}")
    return BY_HF_TYPE[model_type]


def decoder_config(hf: dict[str, Any], where: str, base: ModelConfig | None, name: str) -> ModelConfig:
    """The ModelConfig of ``hf`` (a parsed config.json; ``where`` names it in errors). Keys it
    leaves out come from ``base`` (a built-in config, whose name and shapes are kept) or, without
    one, from the family's HF defaults; the sizes in ``REQUIRED`` must then be present."""
    fam = family_of(hf, where)
    if _opt(hf, "use_bidirectional_attention", _bool, where, False):
        raise ModelError(f"{where}: use_bidirectional_attention (an encoder) is not supported")
    changes: dict[str, Any] = {}
    for key, (field, check) in _KEYS.items():
        if hf.get(key) is not None:
            changes[field] = check(hf[key], f"{where}: {key}")
        elif base is None and key in REQUIRED:
            raise ModelError(f"{where} has no {key!r}")
    if hf.get("eos_token_id") is not None:  # read by generation when no other file names one
        config_token_ids(hf["eos_token_id"], f"{where}: eos_token_id")
    act_key = "hidden_activation" if hf.get("hidden_activation") is not None else "hidden_act"
    act = _opt(hf, act_key, _str, where, fam.activation)
    act = dict(fam.activation_aliases).get(act, act)
    if act not in ACTIVATIONS:
        raise ModelError(f"{where}: {act_key} {act!r:.60} is not supported for {fam.name} models "
                         f"(supported: {', '.join(ACTIVATIONS)})")
    changes["activation"] = act
    _opt(hf, "use_sliding_window", _bool, where, False)  # checked; Family.sliding reads it
    if hf.get("head_dim") is None:
        changes["head_dim"] = fam.head_dim
    if hf.get("num_key_value_heads") is None:
        changes["num_kv_heads"] = 0  # HF: as many as the query heads
    if hf.get("tie_word_embeddings") is None:
        changes["tie_word_embeddings"] = fam.tie
    hidden = changes.get("hidden_size", base.hidden_size if base else 0)
    layers = changes.get("num_layers", base.num_layers if base else 0)
    changes.update(family=fam.name, qkv_bias=fam.qkv_bias, qk_norm=fam.qk_norm, norm_offset=fam.norm_offset,
                   sandwich_norms=fam.sandwich_norms, fused_projections=fam.fused_projections,
                   embed_scale=math.sqrt(hidden) if fam.embed_scale else 1.0,
                   sliding_layers=_sliding_layers(hf, fam, layers, where))
    if not changes.get("sliding_window") or (changes["sliding_layers"] and not any(changes["sliding_layers"])):
        changes.update(sliding_window=0, sliding_layers=())
    qpas = _opt(hf, "query_pre_attn_scalar", _positive_float, where, fam.query_pre_attn_scalar)
    changes["query_scale"] = qpas ** -0.5 if qpas else 0.0
    changes.update(_rope(hf, fam, where, changes, base))
    try:
        if base is None:
            return ModelConfig(name=name, description=f"{fam.name} checkpoint {name}", **changes)
        return dataclasses.replace(base, **changes)
    except ModelError as e:
        raise ModelError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ModelError(f"{where} does not describe a {fam.name} model: {e}") from None


def _sliding_layers(hf: dict[str, Any], fam: Family, layers: int, where: str) -> tuple[bool, ...]:
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern")  # transformers 4.x Gemma 3: every N-th layer global
        if pattern is not None:
            pattern = _int(pattern, f"{where}: sliding_window_pattern")
            return dataclasses.replace(fam, window_layers=pattern).sliding(layers, hf)
        return fam.sliding(layers, hf)
    if not isinstance(types, list) or len(types) != layers:
        raise ModelError(f"{where}: layer_types is not a list of {layers} layer types")
    bad = next((t for t in types if t not in LAYER_TYPES), None)
    if bad is not None:
        raise ModelError(f"{where}: layer type {bad!r:.60} is not supported (supported: {', '.join(LAYER_TYPES)})")
    return tuple(LAYER_TYPES[t] for t in types)


def _rope(hf: dict[str, Any], fam: Family, where: str, changes: dict[str, Any],
          base: ModelConfig | None) -> dict[str, Any]:
    """rope_theta, rope_scaling, rope_local_theta and rotary_dim of a config.json."""
    params = _opt(hf, "rope_parameters", _object, where, {})
    out: dict[str, Any] = {}
    if "full_attention" in params or "sliding_attention" in params:  # Gemma 3, transformers 5: per layer type
        glob = _opt(params, "full_attention", _object, f"{where}: rope_parameters", {})
        local = _opt(params, "sliding_attention", _object, f"{where}: rope_parameters", {})
        theta, scaling = _rope_block(glob, hf, f"{where}: rope_parameters.full_attention", fam.rope_theta)
        ltheta, lscaling = _rope_block(local, hf, f"{where}: rope_parameters.sliding_attention", fam.rope_local_theta)
        if lscaling is not None:
            raise ModelError(f"{where}: rope_parameters.sliding_attention: scaled RoPE on the windowed layers "
                             "is not supported")
        out.update(rope_theta=theta, rope_scaling=scaling, rope_local_theta=ltheta)
        prf = 1.0
    else:
        block = dict(params)
        scaling_dict = _opt(hf, "rope_scaling", _object, where, None)
        label = "rope_parameters"
        if scaling_dict is not None and not params:
            block, label = dict(scaling_dict), "rope_scaling"
        if "rope_theta" not in block and hf.get("rope_theta") is not None:
            block["rope_theta"] = hf["rope_theta"]
            label_theta = "rope_theta"
        else:
            label_theta = f"{label}.rope_theta"
        default_theta = base.rope_theta if base is not None and base.rope_theta else fam.rope_theta
        theta, scaling = _rope_block(block, hf, f"{where}: {label}", default_theta, theta_label=f"{where}: {label_theta}")
        out.update(rope_theta=theta, rope_scaling=scaling)
        if fam.rope_local_theta:
            out["rope_local_theta"] = _opt(hf, "rope_local_base_freq", _positive_float, where, fam.rope_local_theta)
        prf = block.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    prf = _number(prf, f"{where}: partial_rotary_factor")
    if prf > 1.0:
        raise ModelError(f"{where}: partial_rotary_factor {prf} exceeds 1")
    if prf != 1.0:
        head_dim = changes.get("head_dim") or (changes.get("hidden_size", base.hidden_size if base else 0)
                                               // changes.get("num_heads", base.num_heads if base else 1))
        out["rotary_dim"] = int(head_dim * prf)
    return out


def _rope_block(d: dict[str, Any], hf: dict[str, Any], where: str, default_theta: float,
                theta_label: str | None = None) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of one rope_parameters / rope_scaling dict."""
    kind = None
    for key in ("rope_type", "type"):
        if d.get(key) is not None:
            kind = _str(d[key], f"{where}.{key}")
            break
    theta = default_theta if d.get("rope_theta") is None else _positive_float(d["rope_theta"],
                                                                                theta_label or f"{where}.rope_theta")
    if kind in (None, "default"):
        return theta, None
    if kind not in ("linear", "llama3", "yarn", "longrope"):
        raise ModelError(f"{where}.rope_type: RoPE scaling {kind!r:.60} is not supported "
                         "(supported: default, linear, llama3, yarn, longrope)")

    def num(key: str, default: float, least: float = 0.0, strict: bool = True) -> float:
        return default if d.get(key) is None else _number(d[key], f"{where}.{key}", least, strict)

    orig = d.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if orig is None and kind in ("llama3", "yarn", "longrope"):
        orig = hf.get("max_position_embeddings")  # HF's fallback
    if orig is not None:
        orig = _int(orig, f"{where}.original_max_position_embeddings")
    factor = d.get("factor")
    if factor is None and kind in ("yarn", "longrope") and orig and isinstance(hf.get("max_position_embeddings"), int):
        factor = hf["max_position_embeddings"] / orig  # HF derives it so
    kw: dict[str, Any] = dict(kind=kind, factor=_number(factor if factor is not None else 1.0, f"{where}.factor"),
                              original_max_positions=orig or 0)
    if kind == "llama3":
        kw.update(low_freq_factor=num("low_freq_factor", 1.0), high_freq_factor=num("high_freq_factor", 4.0))
    if kind == "yarn":
        kw.update(beta_fast=num("beta_fast", 32.0), beta_slow=num("beta_slow", 1.0),
                  mscale=num("mscale", 0.0, strict=False), mscale_all_dim=num("mscale_all_dim", 0.0, strict=False),
                  attention_factor=num("attention_factor", 0.0, strict=False),
                  truncate=_opt(d, "truncate", _bool, where, True))
    if kind == "longrope":
        lists = {}
        for key in ("short_factor", "long_factor"):
            v = d.get(key)
            if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                raise ModelError(f"{where}.{key} is not a list of numbers")
            lists[key] = tuple(float(x) for x in v)
        kw.update(attention_factor=num("attention_factor", 0.0, strict=False), **lists)
    try:
        return theta, RopeScaling(**kw)
    except ModelError as e:
        raise ModelError(f"{where}: {e}") from None
