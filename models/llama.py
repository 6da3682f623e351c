"""Llama and Qwen3 decoders (HF *ForCausalLM), op by op as modeling_llama/qwen3.py compute them.

Qwen3 differs from Llama only in the q/k RMSNorm over head_dim (before RoPE), which
``cfg.qk_norm`` switches on; Qwen3-0.6B also ties lm_head to the embedding table.
"""

from __future__ import annotations

from collections.abc import Callable

from fusec.dtypes import DType
from fusec.ir import Graph, Value
from fusec.ops import Op

from .layers import (
    Blocks,
    Embedding,
    activation,
    apply_rope,
    causal_padding_mask,
    eager_attention,
    linear,
    rms_norm,
    rope_tables,
    to_heads,
)
from .registry import ModelConfig
from .weights import WeightSource


def decoder_layer(m: Blocks, cfg: ModelConfig, x: Value, i: int, cos: Value, sin: Value,
                  attend: Callable[[Value, Value, Value], Value]) -> Value:
    """Layer ``i`` of a Llama/Qwen3 decoder on hidden states x [B, S, D], as HF computes it:
    RMSNorm, q/k/v projections to [B, H, S, hd] heads (Qwen3's q/k RMSNorm before the head
    transpose), RoPE on q and k, ``attend(q, k, v) -> [B, S, H * hd]``, o-projection + residual,
    RMSNorm, SwiGLU MLP + residual. The generation builders pass an ``attend`` that also writes
    the KV cache (models/generate.py)."""
    d, hd, eps, p = cfg.hidden_size, cfg.head_dim, cfg.norm_eps, f"layers.{i}"
    h = rms_norm(m, x, f"{p}.input_layernorm", d, eps)
    heads = []
    for n, count in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
        t = to_heads(m, linear(m, h, f"{p}.self_attn.{n}_proj", d, count * hd, cfg.attention_bias), count, hd)
        if cfg.qk_norm and n != "v":
            t = rms_norm(m, t, f"{p}.self_attn.{n}_norm", hd, eps)
        t = m.op(Op.TRANSPOSE, t, perm=(0, 2, 1, 3))
        if n != "v":
            t = apply_rope(m, t, cos, sin)
        heads.append(t)
    a = attend(*heads)
    a = linear(m, a, f"{p}.self_attn.o_proj", cfg.num_heads * hd, d, cfg.attention_bias)
    x = m.op(Op.ADD, x, a)  # residual + hidden_states
    h = rms_norm(m, x, f"{p}.post_attention_layernorm", d, eps)
    gate = activation(m, linear(m, h, f"{p}.mlp.gate_proj", d, cfg.intermediate_size, cfg.mlp_bias), cfg.activation)
    up = linear(m, h, f"{p}.mlp.up_proj", d, cfg.intermediate_size, cfg.mlp_bias)
    h = linear(m, m.op(Op.MUL, gate, up), f"{p}.mlp.down_proj", cfg.intermediate_size, d, cfg.mlp_bias)
    return m.op(Op.ADD, x, h)


def build_llama(cfg: ModelConfig, batch: int, seq: int, weights: WeightSource) -> Graph:
    m = Blocks(cfg.name, weights)
    d, hd, eps = cfg.hidden_size, cfg.head_dim, cfg.norm_eps
    ids = m.b.input("input_ids", (batch, seq), DType.I64)
    mask_in = m.b.input("attention_mask", (batch, seq), DType.I64)

    table = Embedding(m, "embed_tokens.weight", (cfg.vocab_size, d))
    x = table.lookup(ids)
    mask = causal_padding_mask(m, mask_in)
    cos, sin = rope_tables(m, seq, hd, cfg.rope_theta)

    for i in range(cfg.num_layers):
        x = decoder_layer(m, cfg, x, i, cos, sin,
                          lambda q, k, v: eager_attention(m, q, k, v, mask, scale=cfg.head_dim ** -0.5))

    x = rms_norm(m, x, "norm", d, eps)
    if cfg.tie_word_embeddings:
        logits = table.project(x)
    else:
        logits = linear(m, x, "lm_head", d, cfg.vocab_size, bias=False)
    return m.finish(logits, "logits")
