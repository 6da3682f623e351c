"""The **join** entry of a generation plan: one decode step of every row that also prefills up to J
new prompts into chosen rows, in the same matrix products.

Why: a server admitting rows between decode steps stalls every decoding row while the admission's
prefill runs. Measured on the H100 (benchmarks/RESULTS.md, issue 24, 32 clients): the prefills
took 15-18% of the GPU's time and the whole-batch prefill or the admit entry cost the same per
request. A decode step reads every weight once for a few rows; the products have room for
prompts' tokens beside them (M = B + J*S instead of B), so prompts that join a step cost little
more than the weights the step reads anyway, and no row waits. J > 1 lets rows freed at the same
step be taken again at the same step, and spreads the join's own launches over its prompts.

Inputs: ``input_ids`` [J, S] (the prompts, right-padded), ``lengths`` [J] (each prompt's length;
0: an empty slot, which writes nothing and takes no row) and ``row`` [J] (the row each prompt
takes, which must be free; distinct among the slots in use): ``fusec.generation.join_feeds``.
The B decoding tokens and the J*S prompt tokens travel as N = B + J*S rows of one token each
([N, 1, D], the decode step's layout with N rows) through each layer's products; then

* one ``cache_write`` with destination rows per K and V stores every token's keys/values: a
  decode token's in its row at ``pos``, a prompt token's in its prompt's row at its position
  (an empty slot's, and a joined row's own decode token's, at position T: dropped);
* the B decode tokens attend over the cache, as the decode entry does (``kv_attention``);
* each prompt's S tokens attend over themselves (causal and padding mask), as the prefill does.

A joined row's own decode token is computed and thrown away (it writes nothing, and what it
draws is replaced by the prompt's first token). Each prompt's last real token gives its row's first token, drawn at
position ``lengths`` with the row's sampling state, and the row's ``pos``/``cur``/``done``/
``tokens`` are set as the prefill sets them; every other row advances as in a decode step. So the
states after a join are those of a decode step for the other rows and of a prefill for the new
ones (tests/test_generation_join.py checks it on the reference backend).
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
    slots = int(shape.join)  # type: ignore[attr-defined]
    n_new = slots * seq  # the prompts' tokens
    n = bsz + n_new
    d, hd, i64 = cfg.hidden_size, cfg.head_dim, DType.I64
    ids = m.b.input("input_ids", (slots, seq), i64)
    length = m.b.input("lengths", (slots,), i64)
    row = m.b.input("row", (slots,), i64)
    table = Embedding(m, "embed_tokens.weight", (cfg.vocab_size, d))

    def cat(a: Value, b: Value, axis: int = 0) -> Value:
        return m.op(Op.CONCAT, a, b, axis=axis)

    def const(x: np.ndarray, name: str) -> Value:
        return m.b.const(x, name=name)

    # which slot, if any, each row takes: hits[b, j] = (row[j] == b and slot j holds a prompt)
    used = m.op(Op.GREATER, length, m.scalar(0, i64))  # [J]
    batch_rows = const(np.arange(bsz, dtype=np.int64), "batch_rows")
    hits = m.op(Op.AND, m.op(Op.EQUAL, m.op(Op.RESHAPE, batch_rows, shape=(bsz, 1)), m.op(Op.RESHAPE, row, shape=(1, slots))),
                m.op(Op.RESHAPE, used, shape=(1, slots)))
    hits = m.op(Op.CAST, hits, to=i64)  # [B, J]: at most one 1 per row and per slot

    def per_row(per_slot: Value) -> Value:  # [J] -> [B]: the value of the slot row b takes (0 if none)
        return m.op(Op.REDUCE_SUM, m.op(Op.MUL, hits, m.op(Op.RESHAPE, per_slot, shape=(1, slots))), axes=(1,),
                    keepdims=False)

    joined = m.op(Op.GREATER, m.op(Op.REDUCE_SUM, hits, axes=(1,), keepdims=False), m.scalar(0, i64))  # [B]

    # every token's cache destination: (row, position); T drops the write
    at_t = m.scalar(t_max, i64)
    prompt_pos = m.op(Op.WHERE, m.op(Op.RESHAPE, used, shape=(slots, 1)), const(np.arange(seq, dtype=np.int64)[None], "prompt_positions"), at_t)
    write_pos = cat(m.op(Op.WHERE, joined, at_t, st.pos), m.op(Op.RESHAPE, prompt_pos, shape=(n_new,)))  # [N]
    prompt_rows = m.op(Op.MUL, m.op(Op.RESHAPE, row, shape=(slots, 1)), const(np.ones((1, seq), np.int64), "prompt_span"))
    write_rows = cat(batch_rows, m.op(Op.RESHAPE, prompt_rows, shape=(n_new,)))  # [N]

    x = cat(embed(m, cfg, table, st.cur), embed(m, cfg, table, m.op(Op.RESHAPE, ids, shape=(n_new,))))  # [N, D]
    x = m.op(Op.RESHAPE, x, shape=(n, 1, d))  # the decode tokens, then the prompts'

    def rope_rows(cos: np.ndarray, sin: np.ndarray, sfx: str) -> tuple[Value, Value]:
        """Each token's RoPE row: a decode token's at its row's position, a prompt's at 0..S-1."""
        def rows(table_: np.ndarray, name: str) -> Value:
            at_pos = m.op(Op.GATHER, const(table_, name + "_table" + sfx), st.pos, axis=0)  # [B, rd]
            both = cat(at_pos, const(np.tile(table_[:seq], (slots, 1)), name + "_prompt" + sfx))
            return m.op(Op.RESHAPE, both, shape=(n, 1, 1, cfg.rope_dims))
        return rows(cos, "rope_cos"), rows(sin, "rope_sin")

    ropes = layer_ropes(m, cfg, t_max, rope_rows)
    masks = prompt_masks(m, cfg, length, seq)
    new_caches: list[tuple[Value, Value]] = []

    def tokens(t: Value, start: int, end: int) -> Value:  # rows [start, end) of an [N, H, 1, hd] head
        return m.op(Op.SLICE, t, axes=(0,), starts=(start,), ends=(end,), steps=(1,))

    def prompts_of(t: Value) -> Value:  # [N, H, 1, hd] -> the prompts' [J, H, S, hd]
        heads = t.shape[1]
        p = m.op(Op.RESHAPE, tokens(t, bsz, n), shape=(slots, seq, heads, hd))
        return m.op(Op.TRANSPOSE, p, perm=(0, 2, 1, 3))

    def attend(i: int, q: Value, k: Value, v: Value) -> Value:
        caches = [m.op(Op.CACHE_WRITE, cache, t, write_pos, write_rows, axis=2) for cache, t in zip(st.caches[i], (k, v))]
        new_caches.append((caches[0], caches[1]))
        w = cfg.window(i)
        a = m.op(Op.KV_ATTENTION, tokens(q, 0, bsz), caches[0], caches[1], st.pos, scale=cfg.attention_scale,
                 softcap=cfg.attn_softcap, window=w)  # [B, H, 1, hd]
        a = m.op(Op.RESHAPE, m.op(Op.TRANSPOSE, a, perm=(0, 2, 1, 3)), shape=(bsz, 1, cfg.num_heads * hd))
        p = eager_attention(m, prompts_of(q), prompts_of(k), prompts_of(v), masks[w if w < seq else 0],
                            scale=cfg.attention_scale, softcap=cfg.attn_softcap)  # [J, S, H * hd]
        return cat(a, m.op(Op.RESHAPE, p, shape=(n_new, 1, cfg.num_heads * hd)))  # [N, 1, H * hd]

    for i in range(cfg.num_layers):
        x = decoder_layer(m, cfg, x, i, ropes[i], lambda q, k, v, i=i: attend(i, q, k, v))

    # the decode tokens' hidden states and each prompt's last real token's: B + j*S + length[j] - 1
    lasts = m.op(Op.ADD, length, const(bsz - 1 + np.arange(slots, dtype=np.int64) * seq, "prompt_ends"))
    picks = cat(batch_rows, lasts)
    x = m.op(Op.GATHER, m.op(Op.RESHAPE, x, shape=(n, d)), picks, axis=0)  # [B + J, D]
    logits = lm_head(m, cfg, x, table)
    slot_logits = const(bsz + np.arange(slots, dtype=np.int64), "slot_logits")
    logits = m.op(Op.GATHER, logits, m.op(Op.WHERE, joined, per_row(slot_logits), batch_rows), axis=0)
    counter = m.op(Op.WHERE, joined, per_row(length), m.op(Op.ADD, st.pos, m.scalar(1, i64)))
    g = finish_step(m, st, logits, counter, new_caches, shape, eos_ids, False, joined=joined)  # type: ignore[arg-type]
    g.meta["generation"]["entry"] = "join"
    return g
