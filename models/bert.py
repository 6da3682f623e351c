"""BERT encoders (HF BertModel without the pooler), op by op as modeling_bert.py computes them."""

from __future__ import annotations

from fusec.dtypes import DType
from fusec.ir import Graph
from fusec.ops import Op

from .layers import (
    Blocks,
    activation,
    eager_attention,
    embedding,
    layer_norm,
    linear,
    padding_mask,
    positions,
    split_heads,
)
from .registry import ModelConfig
from .weights import MATRIX, WeightSource


def build_bert(cfg: ModelConfig, batch: int, seq: int, weights: WeightSource) -> Graph:
    m = Blocks(cfg.name, weights)
    d, heads, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    ids = m.b.input("input_ids", (batch, seq), DType.I64)
    mask_in = m.b.input("attention_mask", (batch, seq), DType.I64)

    words = m.param("embeddings.word_embeddings.weight", (cfg.vocab_size, d))
    # No token_type_ids input: HF then uses type 0 everywhere, which is a constant row to add.
    types = weights.get("embeddings.token_type_embeddings.weight", (cfg.type_vocab_size, d), MATRIX)
    type0 = m.b.const(types[0], name="embeddings.token_type_embeddings.weight[0]", dtype=DType.F32)
    pos_table = m.param("embeddings.position_embeddings.weight", (cfg.max_positions, d))
    x = m.op(Op.ADD, embedding(m, words, ids), type0)
    x = m.op(Op.ADD, x, embedding(m, pos_table, positions(m, seq)))
    x = layer_norm(m, x, "embeddings.LayerNorm", d, cfg.norm_eps)
    mask = padding_mask(m, mask_in)

    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}"
        q, k, v = (split_heads(m, linear(m, x, f"{p}.attention.self.{n}", d, d, bias=True), heads, hd)
                   for n in ("query", "key", "value"))
        a = eager_attention(m, q, k, v, mask, scale=hd ** -0.5)
        a = linear(m, a, f"{p}.attention.output.dense", d, d, bias=True)
        x = layer_norm(m, m.op(Op.ADD, a, x), f"{p}.attention.output.LayerNorm", d, cfg.norm_eps)
        h = linear(m, x, f"{p}.intermediate.dense", d, cfg.intermediate_size, bias=True)
        h = activation(m, h, cfg.activation)
        h = linear(m, h, f"{p}.output.dense", cfg.intermediate_size, d, bias=True)
        x = layer_norm(m, m.op(Op.ADD, h, x), f"{p}.output.LayerNorm", d, cfg.norm_eps)

    return m.finish(x, "last_hidden_state")
