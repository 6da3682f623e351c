"""The **join** entry of a generation plan: one decode step of every row that also prefills one new
prompt into a chosen row, in the same matrix products.

Why: a server admitting rows between decode steps stalls every decoding row while the admission's
prefill runs. Measured on the H100 (benchmarks/RESULTS.md, issue 24, 32 clients): the prefills
took 15-18% of the GPU's time and the whole-batch prefill or the admit entry cost the same per
request. A decode step reads every weight once for a few rows; the products have room for a
prompt's tokens beside them (M = B + S instead of B), so a prompt that joins a step costs little
more than the weights the step reads anyway, and no row waits.

Inputs: ``input_ids`` [1, S] (the prompt, right-padded), ``lengths`` [1] (its length, >= 1) and
``row`` [1] (the row it takes, which must be free). The hidden states of the B decoding tokens
and the S prompt tokens travel as one [1, B + S, D] sequence through each layer's products;
attention splits them again:

* the B decode tokens write their keys/values at ``pos`` and attend over the cache, as the
  decode entry does (``kv_attention``);
* the S prompt tokens write theirs into row ``row`` at position 0 (``cache_write`` with
  destination rows) and attend over themselves (causal and padding mask), as the prefill does.

Row ``row``'s own decode token is computed and thrown away (its keys land at its old position
before the prompt's overwrite positions 0..S-1; a position past the new prompt is written again
before any step reads it). The prompt's last real token gives row ``row``'s first token, drawn at
position ``lengths`` with the row's sampling state, and the row's ``pos``/``cur``/``done``/
``tokens`` are set as the prefill sets them; every other row advances as in a decode step. So the
states after a join are those of a decode step for the other rows and of a prefill for the new
one (tests/test_generation_join.py checks it on the reference backend).
"""

from __future__ import annotations

import numpy as np

from fusec.dtypes import DType
from fusec.ir import Graph, Value
from fusec.ops import Op

from .layers import Blocks, Embedding, eager_attention
from .llama import decoder_layer, embed, layer_ropes, lm_head
from .registry import ModelConfig


def build_join(cfg: ModelConfig, weights: object, shape: object, eos_ids: tuple[int, ...]) -> Graph:
    from .generate import _State, finish_step, prompt_masks

    m = Blocks(f"{cfg.name}.join", weights)  # type: ignore[arg-type]
    st = _State(m, cfg, shape)  # type: ignore[arg-type]
    bsz, seq, t_max = shape.batch, shape.prefill_len, shape.max_seq_len  # type: ignore[attr-defined]
    d, hd, i64 = cfg.hidden_size, cfg.head_dim, DType.I64
    ids = m.b.input("input_ids", (1, seq), i64)
    length = m.b.input("lengths", (1,), i64)
    row = m.b.input("row", (1,), i64)
    table = Embedding(m, "embed_tokens.weight", (cfg.vocab_size, d))

    def cat(a: Value, b: Value, axis: int) -> Value:
        return m.op(Op.CONCAT, a, b, axis=axis)

    def part(v: Value, start: int, end: int) -> Value:  # positions [start, end) of a [1, H, B + S, hd] head
        return m.op(Op.SLICE, v, axes=(2,), starts=(start,), ends=(end,), steps=(1,))

    x = cat(m.op(Op.RESHAPE, embed(m, cfg, table, m.op(Op.RESHAPE, st.cur, shape=(bsz, 1))), shape=(1, bsz, d)),
            embed(m, cfg, table, ids), axis=1)  # [1, B + S, D]: the decode tokens, then the prompt's

    def rope_rows(cos: np.ndarray, sin: np.ndarray, sfx: str) -> tuple[Value, Value]:
        """Each token's RoPE row: a decode token's at its row's position, the prompt's at 0..S-1."""
        def rows(table_: np.ndarray, name: str) -> Value:
            at_pos = m.op(Op.GATHER, m.b.const(table_, name=name + "_table" + sfx), st.pos, axis=0)  # [B, rd]
            both = cat(at_pos, m.b.const(table_[:seq], name=name + "_prompt" + sfx), axis=0)
            return m.op(Op.RESHAPE, both, shape=(1, 1, bsz + seq, cfg.rope_dims))
        return rows(cos, "rope_cos"), rows(sin, "rope_sin")

    ropes = layer_ropes(m, cfg, t_max, rope_rows)
    masks = prompt_masks(m, cfg, length, seq)
    at_zero = m.b.const(np.zeros(1, np.int64), name="prompt_start")
    new_caches: list[tuple[Value, Value]] = []

    def attend(i: int, q: Value, k: Value, v: Value) -> Value:
        def rows_of(t: Value) -> Value:  # [1, H, B, hd] -> [B, H, 1, hd]
            return m.op(Op.TRANSPOSE, part(t, 0, bsz), perm=(2, 1, 0, 3))

        caches = []
        for cache, t in zip(st.caches[i], (k, v)):
            c = m.op(Op.CACHE_WRITE, cache, rows_of(t), st.pos, axis=2)  # the decode tokens, at pos
            caches.append(m.op(Op.CACHE_WRITE, c, part(t, bsz, bsz + seq), at_zero, row, axis=2))  # the prompt
        new_caches.append((caches[0], caches[1]))
        w = cfg.window(i)
        a = m.op(Op.KV_ATTENTION, rows_of(q), caches[0], caches[1], st.pos, scale=cfg.attention_scale,
                 softcap=cfg.attn_softcap, window=w)  # [B, H, 1, hd]
        a = m.op(Op.RESHAPE, m.op(Op.TRANSPOSE, a, perm=(0, 2, 1, 3)), shape=(1, bsz, cfg.num_heads * hd))
        p = eager_attention(m, part(q, bsz, bsz + seq), part(k, bsz, bsz + seq), part(v, bsz, bsz + seq),
                            masks[w if w < seq else 0], scale=cfg.attention_scale, softcap=cfg.attn_softcap)
        return cat(a, p, axis=1)  # [1, B + S, H * hd]

    for i in range(cfg.num_layers):
        x = decoder_layer(m, cfg, x, i, ropes[i], lambda q, k, v, i=i: attend(i, q, k, v))

    # the decode tokens' hidden states and the prompt's last real token's: rows 0..B-1 and B + length - 1
    last = m.op(Op.ADD, length, m.scalar(bsz - 1, i64))
    picks = cat(m.b.const(np.arange(bsz, dtype=np.int64), name="decode_rows"), last, axis=0)
    x = m.op(Op.GATHER, m.op(Op.RESHAPE, x, shape=(bsz + seq, d)), picks, axis=0)  # [B + 1, D]
    logits = lm_head(m, cfg, x, table)
    batch_rows = m.b.const(np.arange(bsz, dtype=np.int64), name="batch_rows")
    joined = m.op(Op.EQUAL, batch_rows, row)  # [B]: the row the prompt takes
    logits = m.op(Op.GATHER, logits, m.op(Op.WHERE, joined, m.scalar(bsz, i64), batch_rows), axis=0)
    counter = m.op(Op.WHERE, joined, length, m.op(Op.ADD, st.pos, m.scalar(1, i64)))
    g = finish_step(m, st, logits, counter, new_caches, shape, eos_ids, False, joined=joined)  # type: ignore[arg-type]
    g.meta["generation"]["entry"] = "join"
    return g
