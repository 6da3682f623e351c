"""GPT-2 (HF GPT2LMHeadModel), op by op as modeling_gpt2.py computes it in eager mode."""

from __future__ import annotations

from fusec.dtypes import DType
from fusec.ir import Graph
from fusec.ops import Op

from .layers import (
    Blocks,
    activation,
    causal_padding_mask,
    conv1d,
    eager_attention,
    embedding,
    layer_norm,
    positions,
    split_heads,
)
from .registry import ModelConfig
from .weights import WeightSource


def build_gpt2(cfg: ModelConfig, batch: int, seq: int, weights: WeightSource) -> Graph:
    m = Blocks(cfg.name, weights)
    d, heads, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    ids = m.b.input("input_ids", (batch, seq), DType.I64)
    mask_in = m.b.input("attention_mask", (batch, seq), DType.I64)

    wte = m.param("wte.weight", (cfg.vocab_size, d))
    wpe = m.param("wpe.weight", (cfg.max_positions, d))
    x = m.op(Op.ADD, embedding(m, wte, ids), embedding(m, wpe, positions(m, seq)))
    mask = causal_padding_mask(m, mask_in)

    for i in range(cfg.num_layers):
        p = f"h.{i}"
        h = layer_norm(m, x, f"{p}.ln_1", d, cfg.norm_eps)
        # c_attn produces q|k|v side by side; HF splits them with .split(d, dim=2).
        qkv = conv1d(m, h, f"{p}.attn.c_attn", d, 3 * d)
        q, k, v = (split_heads(m, m.op(Op.SLICE, qkv, axes=(2,), starts=(j * d,), ends=((j + 1) * d,), steps=(1,)),
                               heads, hd) for j in range(3))
        a = eager_attention(m, q, k, v, mask, scale=hd ** -0.5)
        a = conv1d(m, a, f"{p}.attn.c_proj", d, d)
        x = m.op(Op.ADD, a, x)  # attn_output + residual
        h = layer_norm(m, x, f"{p}.ln_2", d, cfg.norm_eps)
        h = conv1d(m, h, f"{p}.mlp.c_fc", d, cfg.intermediate_size)
        h = activation(m, h, cfg.activation)
        h = conv1d(m, h, f"{p}.mlp.c_proj", cfg.intermediate_size, d)
        x = m.op(Op.ADD, x, h)  # residual + feed_forward_hidden_states

    x = layer_norm(m, x, "ln_f", d, cfg.norm_eps)
    # lm_head is tied to wte in GPT-2: an nn.Linear over the [V, D] table.
    logits = m.op(Op.MATMUL, x, m.op(Op.TRANSPOSE, wte, perm=(1, 0)))
    return m.finish(logits, "logits")
