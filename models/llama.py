"""Llama-style decoders (HF *ForCausalLM of Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 1/2/3, Phi-3),
op by op as their modeling_*.py compute them: one layer builder whose options (ModelConfig's
fields) are what differs between the families:

- attention biases (Qwen2: q/k/v; Llama's attention_bias: q/k/v/o), q/k RMSNorm (Qwen3, Gemma 3);
- sliding-window attention on all layers (Mistral, Phi-3) or on some (Gemma 2: every other one,
  Gemma 3: five of six), each layer's window a mask here and a bound in the decode step;
- attention-logit and final-logit soft-capping (Gemma 2), the attention scale
  (query_pre_attn_scalar ** -0.5: Gemma 2/3);
- embeddings times sqrt(hidden_size), the (1 + w) RMSNorm, norms after attention and MLP
  (Gemma; 2/3), local and global RoPE bases (Gemma 3), RoPE scaling (models/rope.py), partial
  rotary dims (Phi-3), GELU-tanh or SiLU gates, tied or separate LM heads.

Fused checkpoint tensors (Phi-3's qkv_proj, gate_up_proj) are split when loaded
(``models.weights.SplitFused``), so the graph is the same for every family.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fusec.dtypes import DType
from fusec.ir import Graph, Value
from fusec.ops import Op

from .layers import (
    F32_MIN,
    Blocks,
    Embedding,
    activation,
    apply_rope,
    eager_attention,
    linear,
    padding_mask,
    rms_norm,
    to_heads,
)
from .registry import ModelConfig
from .rope import cos_sin
from .weights import WeightSource


def norm(m: Blocks, cfg: ModelConfig, x: Value, prefix: str, dim: int) -> Value:
    """The decoder's RMSNorm: weight * normalized x, Gemma's (1 + weight) where ``cfg.norm_offset``."""
    return rms_norm(m, x, prefix, dim, cfg.norm_eps, offset=cfg.norm_offset)


def decoder_layer(m: Blocks, cfg: ModelConfig, x: Value, i: int, rope: tuple[Value, Value],
                  attend: Callable[[Value, Value, Value], Value]) -> Value:
    """Layer ``i`` of a Llama-style decoder on hidden states x [B, S, D], as HF computes it:
    RMSNorm, q/k/v projections to [B, H, S, hd] heads (q/k RMSNorm before the head transpose:
    Qwen3, Gemma 3), RoPE on q and k (the first ``rotary_dim`` dims: Phi-3), ``attend(q, k, v) ->
    [B, S, H * hd]``, o-projection (+ Gemma 2/3's post-attention norm) + residual, the pre-MLP
    norm, the gated MLP (SiLU or GELU-tanh gate; + Gemma 2/3's post-MLP norm) + residual. ``rope``
    is this layer's (cos, sin); the callers pass an ``attend`` that knows the layer's window and,
    in generation, writes the KV cache (models/generate.py). Norm names are HF's: in Gemma 2/3
    ``post_attention_layernorm`` follows attention and ``pre_feedforward_layernorm`` precedes the MLP."""
    d, hd, p = cfg.hidden_size, cfg.head_dim, f"layers.{i}"
    cos, sin = rope
    h = norm(m, cfg, x, f"{p}.input_layernorm", d)
    heads = []
    for n, count in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
        proj = linear(m, h, f"{p}.self_attn.{n}_proj", d, count * hd, cfg.attention_bias or cfg.qkv_bias)
        t = to_heads(m, proj, count, hd)
        if cfg.qk_norm and n != "v":
            t = norm(m, cfg, t, f"{p}.self_attn.{n}_norm", hd)
        t = m.op(Op.TRANSPOSE, t, perm=(0, 2, 1, 3))
        if n != "v":
            t = apply_rope(m, t, cos, sin)
        heads.append(t)
    a = attend(*heads)
    a = linear(m, a, f"{p}.self_attn.o_proj", cfg.num_heads * hd, d, cfg.attention_bias)
    if cfg.sandwich_norms:
        a = norm(m, cfg, a, f"{p}.post_attention_layernorm", d)
    x = m.op(Op.ADD, x, a)  # residual + hidden_states
    h = norm(m, cfg, x, f"{p}.{'pre_feedforward' if cfg.sandwich_norms else 'post_attention'}_layernorm", d)
    gate = activation(m, linear(m, h, f"{p}.mlp.gate_proj", d, cfg.intermediate_size, cfg.mlp_bias), cfg.activation)
    up = linear(m, h, f"{p}.mlp.up_proj", d, cfg.intermediate_size, cfg.mlp_bias)
    h = linear(m, m.op(Op.MUL, gate, up), f"{p}.mlp.down_proj", cfg.intermediate_size, d, cfg.mlp_bias)
    if cfg.sandwich_norms:
        h = norm(m, cfg, h, f"{p}.post_feedforward_layernorm", d)
    return m.op(Op.ADD, x, h)


def embed(m: Blocks, cfg: ModelConfig, table: Embedding, ids: Value) -> Value:
    """The token embeddings, times Gemma's sqrt(hidden_size) (HF rounds it to the dtype first)."""
    x = table.lookup(ids)
    return x if cfg.embed_scale == 1.0 else m.op(Op.MUL, x, m.scalar(cfg.embed_scale))


def lm_head(m: Blocks, cfg: ModelConfig, x: Value, table: Value) -> Value:
    """Final norm, LM head (tied to the embedding table or its own), Gemma 2's final soft-cap."""
    x = norm(m, cfg, x, "norm", cfg.hidden_size)
    if cfg.tie_word_embeddings:
        logits = table.project(x)
    else:
        logits = linear(m, x, "lm_head", cfg.hidden_size, cfg.vocab_size, bias=False)
    if cfg.final_softcap:  # HF: logits / cap; tanh; * cap
        cap = m.scalar(cfg.final_softcap)
        logits = m.op(Op.MUL, m.op(Op.TANH, m.op(Op.DIV, logits, cap)), cap)
    return logits


def layer_ropes(m: Blocks, cfg: ModelConfig, length: int,
                make: Callable[[np.ndarray, np.ndarray, str], tuple[Value, Value]]) -> list[tuple[Value, Value]]:
    """Every layer's (cos, sin): the [length, rotary_dim] tables of its RoPE (models/rope.py) made
    into graph values by ``make(cos, sin, suffix)``, once per distinct (base, scaling)."""
    made: dict[tuple[float, object], tuple[Value, Value]] = {}
    out = []
    for i in range(cfg.num_layers):
        key = cfg.rope(i)
        if key not in made:
            cos, sin = cos_sin(key[0], cfg.rope_dims, key[1], length)
            made[key] = make(cos, sin, "" if not made else f"_{len(made)}")
        out.append(made[key])
    return out


def window_mask(seq: int, window: int) -> np.ndarray:
    """[1, 1, S, S] additive mask: 0 where key j is causal and within the window of query i
    (i - window < j <= i, HF's sliding_window_overlay), finfo.min elsewhere; window 0: causal only."""
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    keep = (j <= i) & ((j > i - window) if window else True)
    return np.where(keep, np.float32(0), np.float32(F32_MIN)).astype(np.float32)[None, None]


def window_masks(m: Blocks, cfg: ModelConfig, mask_in: Value, causal_alone: bool = False) -> dict[int, Value]:
    """{window: [B,1,S,S] additive mask} for the windows ``cfg``'s layers use (0: causal only; a
    window of S keys or more is the causal mask, and is keyed 0: ``masks[w if w < S else 0]``):
    the constant causal (windowed) mask combined with the padding mask of ``mask_in`` [B, S]
    (1 = token) by MIN, which keeps masked entries at finfo.min instead of overflowing.
    ``causal_alone``: window 0 is the constant causal mask [1,1,S,S] by itself (right-padded
    prompts: ``models.generate.prompt_masks`` says why that is exact)."""
    seq = mask_in.shape[1]
    windows = sorted({w if w < seq else 0 for w in (cfg.window(i) for i in range(cfg.num_layers))})
    consts = {w: m.b.const(window_mask(seq, w), name=f"window_mask_{w}" if w else "causal_mask") for w in windows}
    padded = [w for w in windows if w or not causal_alone]
    pad = padding_mask(m, mask_in) if padded else None
    return {w: m.op(Op.MIN, consts[w], pad) if w in padded else consts[w] for w in windows}


def build_llama(cfg: ModelConfig, batch: int, seq: int, weights: WeightSource) -> Graph:
    """The logits graph of a Llama-style decoder (every family of LLAMA_STYLE) for one (B, S)."""
    m = Blocks(cfg.name, weights)
    ids = m.b.input("input_ids", (batch, seq), DType.I64)
    mask_in = m.b.input("attention_mask", (batch, seq), DType.I64)

    table = Embedding(m, "embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    x = embed(m, cfg, table, ids)
    masks = window_masks(m, cfg, mask_in)
    ropes = layer_ropes(m, cfg, seq, lambda c, s, suffix: (m.b.const(c[None, None], name="rope_cos" + suffix),
                                                          m.b.const(s[None, None], name="rope_sin" + suffix)))
    for i in range(cfg.num_layers):
        w = cfg.window(i)
        mask = masks[w if w < seq else 0]
        x = decoder_layer(m, cfg, x, i, ropes[i],
                          lambda q, k, v, mask=mask: eager_attention(m, q, k, v, mask, scale=cfg.attention_scale,
                                                                     softcap=cfg.attn_softcap))
    return m.finish(lm_head(m, cfg, x, table), "logits")
