"""GGUF metadata and tensor names -> fusec's ModelConfig and HF names, as tables per architecture.

``general.architecture`` picks a family (``models/families.py``: llama, qwen2, qwen3, gemma,
gemma2, gemma3, phi3; Mistral ships as llama). Every key is ``{arch}.<suffix>``; ``KEYS`` maps the
suffixes to ModelConfig fields for every architecture alike. Tensor names map through
``tensor_names(arch)``: the llama table, with the Gemma 2/3 norms and Phi-3's fused tensors
replacing entries. What the converter did to the numbers is undone when a tensor is read
(``models/gguf.py``): q/k rows interleaved for RoPE (``llama`` only) and Gemma's ``1 + w`` norm
weights.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fusec.errors import ModelError

from .families import BY_GGUF_ARCH, Family, refusal
from .registry import ModelConfig
from .rope import RopeScaling

# {arch}.<suffix> -> (ModelConfig field, kind); "int": an integer > 0, "int0": >= 0, "float": finite > 0
KEYS: dict[str, tuple[str, str]] = {
    "context_length": ("max_positions", "int"), "embedding_length": ("hidden_size", "int"),
    "block_count": ("num_layers", "int"), "feed_forward_length": ("intermediate_size", "int"),
    "attention.head_count": ("num_heads", "int"), "attention.head_count_kv": ("num_kv_heads", "int"),
    "attention.key_length": ("head_dim", "int"), "attention.layer_norm_rms_epsilon": ("norm_eps", "float"),
    "rope.freq_base": ("rope_theta", "float"), "rope.freq_base_swa": ("rope_local_theta", "float"),
    "rope.dimension_count": ("rotary_dim", "int"), "attention.sliding_window": ("sliding_window", "int0"),
    "attn_logit_softcapping": ("attn_softcap", "float"), "final_logit_softcapping": ("final_softcap", "float"),
}
REQUIRED = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
            "attention.layer_norm_rms_epsilon")

# GGUF tensor name -> HF name (without "model."); per layer "blk.{i}.<gguf>" -> "layers.{i}.<hf>"
GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                "output.weight": "lm_head.weight"}
_LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_SANDWICH = {"post_attention_norm.weight": "post_attention_layernorm.weight",
             "ffn_norm.weight": "pre_feedforward_layernorm.weight",
             "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_FUSED = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# tensors read for the RoPE scaling (not weights of the graph)
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")


def tensor_names(arch: str) -> dict[str, str]:
    """The layer tensor table of ``arch`` (GGUF suffix -> HF suffix)."""
    fam = BY_GGUF_ARCH[arch]
    table = dict(_LLAMA_LAYER)
    if fam.sandwich_norms:
        table.update(_SANDWICH)
    if fam.fused_projections:
        for k in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight"):
            table.pop(k)
        table.update(_FUSED)
    return table


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name (without ``model.``) of a GGUF tensor of ``arch``, or None for a name fusec does not know."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    table = tensor_names(arch)
    if m and m.group(2) in table:
        return f"layers.{int(m.group(1))}.{table[m.group(2)]}"
    return None


class Meta:
    """Typed access to required/optional metadata keys, with errors naming the file and key."""

    def __init__(self, md: Mapping[str, Any], path: Path):
        self.md, self.path = md, path

    def get(self, key: str, kind: type, default: Any = None, required: bool = True, least: int = 1) -> Any:
        if key not in self.md:
            if required:
                raise ModelError(f"GGUF file {os.fspath(self.path)!r} has no metadata key {key!r}")
            return default
        v = self.md[key]
        numeric = (int, float) if kind is float else (int,) if kind is int else (kind,)
        if not isinstance(v, numeric) or (kind in (int, float) and isinstance(v, bool)):
            raise ModelError(f"GGUF file {os.fspath(self.path)!r}: metadata key {key!r} is {v!r:.60}, "
                             f"expected {kind.__name__}")
        if kind is int and v < least:
            raise ModelError(f"GGUF file {os.fspath(self.path)!r}: metadata key {key!r} must be "
                             f"{'positive' if least == 1 else f'>= {least}'}, got {v}")
        return float(v) if kind is float else v

    def positive(self, key: str, default: float | None = None) -> float:
        """A float key that must be finite and > 0 (an epsilon, a RoPE base)."""
        v = self.get(key, float, default, required=default is None)
        if not (math.isfinite(v) and v > 0):
            raise ModelError(f"GGUF file {os.fspath(self.path)!r}: metadata key {key!r} is {v!r}, "
                             "expected a finite number > 0")
        return v

    def fail(self, key: str, why: str) -> ModelError:
        return ModelError(f"GGUF file {os.fspath(self.path)!r}: metadata key {key!r} {why}")


def architecture(md: Mapping[str, Any], path: Path) -> Family:
    """The family of a GGUF file, or one ModelError naming the architecture it cannot run."""
    m = Meta(md, path)
    arch = m.get("general.architecture", str)
    if md.get("split.count", 1) not in (0, 1):
        raise ModelError(f"GGUF file {os.fspath(path)!r} is one of {md['split.count']} parts of a split model; "
                         "merge them first (llama-gguf-split --merge)")
    experts = md.get(f"{arch}.expert_count", 0)
    why = refusal(arch, gguf=True, experts=experts if isinstance(experts, int) and not isinstance(experts, bool) else 1)
    if why is not None:
        raise ModelError(f"GGUF file {os.fspath(path)!r} holds a {arch!r:.60} model: {why}")
    return BY_GGUF_ARCH[arch]


def gguf_config(md: Mapping[str, Any], path: Path, tensors: Mapping[str, Any]) -> ModelConfig:
    """The ModelConfig of a GGUF file's metadata (and the shapes of ``tensors``, by GGUF name)."""
    fam = architecture(md, path)
    a, m = fam.gguf_arch, Meta(md, path)
    assert a is not None
    got: dict[str, Any] = {}
    for suffix, (field, kind) in KEYS.items():
        key = f"{a}.{suffix}"
        if kind == "float":
            v = m.positive(key) if suffix in REQUIRED else (m.positive(key, 1.0) if key in md else None)
        else:
            v = m.get(key, int, None, required=suffix in REQUIRED, least=0 if kind == "int0" else 1)
        if v is not None:
            got[field] = v
    hidden, heads, layers = got["hidden_size"], got["num_heads"], got["num_layers"]
    kv_heads = got.setdefault("num_kv_heads", heads)
    if heads % kv_heads:
        raise m.fail(f"{a}.attention.head_count_kv", f"is {kv_heads}, which does not divide "
                     f"{a}.attention.head_count {heads}")
    if "head_dim" not in got and hidden % heads:
        raise m.fail(f"{a}.attention.head_count", f"is {heads}, which does not divide {a}.embedding_length "
                     f"{hidden} (and there is no {a}.attention.key_length)")
    head_dim = got.setdefault("head_dim", hidden // heads)
    if head_dim % 2:  # RoPE rotates pairs; the q/k unpermute splits each head in halves
        if f"{a}.attention.key_length" in md:
            raise m.fail(f"{a}.attention.key_length", f"gives a head size of {head_dim}, which is odd "
                         "(RoPE needs an even head size)")
        raise m.fail(f"{a}.attention.head_count", f"{heads} and {a}.embedding_length {hidden} give a head size "
                     f"of {head_dim}, which is odd (RoPE needs an even head size)")
    per_layer = 6 if fam.fused_projections else 9 + 2 * fam.sandwich_norms + 2 * fam.qk_norm
    if layers > (len(tensors) - 2) // per_layer:
        raise m.fail(f"{a}.block_count", f"is {layers}, but the file holds only {len(tensors)} tensors "
                     f"(a {a} layer has {per_layer})")
    if m.get(f"{a}.attention.value_length", int, head_dim, required=False) != head_dim:
        raise ModelError(f"GGUF file {os.fspath(path)!r}: attention.value_length differs from key_length")
    rot = got.pop("rotary_dim", head_dim)
    if rot > head_dim or rot % 2 or (a == "llama" and rot != head_dim):
        raise ModelError(f"GGUF file {os.fspath(path)!r}: RoPE over {rot} of head size {head_dim} dims "
                         f"({a}.rope.dimension_count) is not supported{' for llama' if a == 'llama' else ''}")
    if rot != head_dim:
        got["rotary_dim"] = rot
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ModelError(f"GGUF file {os.fspath(path)!r} has no tensor 'token_embd.weight'")
    vocab = int(emb.shape[1]) if len(emb.shape) == 2 else -1
    if vocab <= 0 or int(emb.shape[0]) != hidden:
        raise ModelError(f"GGUF tensor 'token_embd.weight' in {os.fspath(path)!r} has shape "
                         f"{hf_shape(emb)}, expected [vocab, {hidden}]")
    declared = m.get(f"{a}.vocab_size", int, vocab, required=False)
    tokens = md.get("tokenizer.ggml.tokens")
    if declared != vocab or (isinstance(tokens, list) and len(tokens) > vocab):
        raise ModelError(f"GGUF file {os.fspath(path)!r}: vocabulary size {vocab} (token_embd.weight) disagrees "
                         f"with {a}.vocab_size / tokenizer.ggml.tokens")
    window = got.pop("sliding_window", 0)  # () below: every layer has it
    pattern = md.get(f"{a}.attention.sliding_window_pattern")
    sliding: tuple[bool, ...] = ()
    if window:
        if isinstance(pattern, list) and len(pattern) == layers and all(isinstance(x, bool) for x in pattern):
            sliding = tuple(pattern)
        elif pattern is not None and not (isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0):
            raise m.fail(f"{a}.attention.sliding_window_pattern", f"is {pattern!r:.60}, not a layer count or "
                         f"{layers} booleans")
        else:
            rule = Family(fam.name, (), None, window_layers=pattern) if pattern else fam
            sliding = rule.sliding(layers)
    width_scale = layers in fam.gguf_scale_by_width
    qpas = (hidden / heads) if width_scale else (fam.query_pre_attn_scalar and head_dim)
    local_theta = got.pop("rope_local_theta", fam.rope_local_theta)
    got.setdefault("rope_theta", fam.rope_theta)
    scaling = rope_scaling(m, a, tensors, got)
    try:
        return ModelConfig(
            name=f"gguf-{re.sub(r'[^A-Za-z0-9_.-]', '_', path.stem)}", family=fam.name,
            description=f"GGUF file {path.name} ({a})", vocab_size=vocab, activation=fam.activation,
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_output.bias" in tensors,
            qkv_bias="blk.0.attn_q.bias" in tensors and "blk.0.attn_output.bias" not in tensors,
            qk_norm=fam.qk_norm, norm_offset=fam.norm_offset, sandwich_norms=fam.sandwich_norms,
            embed_scale=math.sqrt(hidden) if fam.embed_scale else 1.0, fused_projections=fam.fused_projections,
            sliding_window=window if window and (not sliding or any(sliding)) else 0,
            sliding_layers=sliding if any(sliding) else (),
            query_scale=qpas ** -0.5 if qpas else 0.0,
            rope_local_theta=local_theta, rope_scaling=scaling, **got)
    except ModelError as e:
        raise ModelError(f"GGUF file {os.fspath(path)!r}: {e}") from None


def rope_scaling(m: Meta, a: str, tensors: Mapping[str, Any], got: Mapping[str, Any]) -> RopeScaling | None:
    """The RoPE scaling of a GGUF file: ``rope.scaling.*`` keys, Llama 3.1's ``rope_freqs``
    tensor (per-frequency divisors), Phi-3's ``rope_factors_short``/``_long`` tensors."""
    try:
        scaling = _rope_scaling(m, a, tensors, got)
    except ModelError as e:  # RopeScaling's own checks do not name the file
        raise e if str(e).startswith("GGUF") else ModelError(f"GGUF file {os.fspath(m.path)!r}: {e}") from None
    if scaling is not None:
        try:
            scaling.check(got.get("rotary_dim", got["head_dim"]))
        except ModelError as e:
            raise ModelError(f"GGUF file {os.fspath(m.path)!r}: {e}") from None
    return scaling


def _rope_scaling(m: Meta, a: str, tensors: Mapping[str, Any], got: Mapping[str, Any]) -> RopeScaling | None:
    where = os.fspath(m.path)
    kind = m.get(f"{a}.rope.scaling.type", str, "none", required=False)
    factor = m.get(f"{a}.rope.scaling.factor", float, 0.0, required=False)
    old_linear = m.get(f"{a}.rope.scale_linear", float, 1.0, required=False)  # the older key
    orig = m.get(f"{a}.rope.scaling.original_context_length", int, 0, required=False)
    attn = m.get(f"{a}.rope.scaling.attn_factor", float, 0.0, required=False)
    if "rope_factors_short.weight" in tensors or "rope_factors_long.weight" in tensors:
        short, long = (_factors(tensors, n, where) for n in ("rope_factors_short.weight", "rope_factors_long.weight"))
        if not orig:
            raise ModelError(f"GGUF file {where!r}: Phi-3 RoPE factors need {a}.rope.scaling.original_context_length")
        return RopeScaling("longrope", factor=got["max_positions"] / orig, original_max_positions=orig,
                           attention_factor=attn, short_factor=short, long_factor=long)
    if "rope_freqs.weight" in tensors:
        if kind not in ("none", "linear") or (factor and factor != 1.0):
            raise ModelError(f"GGUF file {where!r}: RoPE scaling {kind!r} together with per-frequency factors "
                             "(tensor 'rope_freqs.weight') is not supported")
        return RopeScaling("factors", freq_factors=_factors(tensors, "rope_freqs.weight", where),
                           attention_factor=attn)
    if kind == "none" and old_linear != 1.0:
        kind, factor = "linear", old_linear
    if kind == "none" or (kind == "linear" and factor in (0.0, 1.0)):
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "yarn":
        if not factor or not orig:
            raise ModelError(f"GGUF file {where!r}: yarn RoPE scaling needs {a}.rope.scaling.factor and "
                             f"{a}.rope.scaling.original_context_length")
        extra = {}
        for suffix, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            v = m.get(f"{a}.rope.scaling.{suffix}", float, 0.0, required=False)
            if v:
                extra[field] = v
        # llama.cpp multiplies YaRN's own 0.1 ln(factor) + 1 by attn_factor (default 1)
        mult = (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0) * (attn or 1.0)
        return RopeScaling("yarn", factor=factor, original_max_positions=orig, attention_factor=mult, **extra)
    raise ModelError(f"GGUF file {where!r}: RoPE scaling {kind!r:.60} ({a}.rope.scaling.type) is not supported "
                     "(supported: none, linear, yarn; Llama 3.1's rope_freqs and Phi-3's rope_factors tensors)")


def _factors(tensors: Mapping[str, Any], name: str, where: str) -> tuple[float, ...]:
    t = tensors.get(name)
    if t is None:
        raise ModelError(f"GGUF file {where!r} has no tensor {name!r}")
    if t.tensor_type.name != "F32" or len(t.shape) != 1:
        raise ModelError(f"GGUF tensor {name!r} in {where!r} must be a 1-D F32 tensor, got {t.tensor_type.name} "
                         f"{hf_shape(t)}")
    vals = np.asarray(t.data, np.float32)
    if not (np.isfinite(vals).all() and (vals > 0).all()):
        raise ModelError(f"GGUF tensor {name!r} in {where!r} holds values that are not finite numbers > 0")
    return tuple(float(x) for x in vals)


def hf_shape(t: Any) -> list[int]:
    return [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost first


def expected(cfg: ModelConfig, arch: str) -> dict[str, tuple[int, ...]]:
    """Every tensor a GGUF file of ``cfg`` holds, by GGUF name, with its HF (row-major) shape."""
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,)})
        if cfg.fused_projections:
            out.update({p + "attn_qkv.weight": (q + 2 * kv, d), p + "attn_output.weight": (d, q),
                        p + "ffn_up.weight": (2 * f, d)})
        else:
            out.update({p + "attn_q.weight": (q, d), p + "attn_k.weight": (kv, d), p + "attn_v.weight": (kv, d),
                        p + "attn_output.weight": (d, q), p + "ffn_gate.weight": (f, d), p + "ffn_up.weight": (f, d)})
        out[p + "ffn_down.weight"] = (d, f)
        if cfg.attention_bias or cfg.qkv_bias:
            out.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)})
        if cfg.attention_bias:
            out[p + "attn_output.bias"] = (d,)
        if cfg.qk_norm:
            out.update({p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
        if cfg.sandwich_norms:
            out.update({p + "post_attention_norm.weight": (d,), p + "post_ffw_norm.weight": (d,)})
    return out
