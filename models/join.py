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
The hidden states of the B decoding tokens and the J*S prompt tokens travel as one
[1, B + J*S, D] sequence through each layer's products; attention splits them again:

* the B decode tokens write their keys/values at ``pos`` and attend over the cache, as the
  decode entry does (``kv_attention``);
* each prompt's S tokens write theirs into its row at position 0 (``cache_write`` with
  destination rows; an empty slot writes at position T, which is dropped) and attend over
  themselves (causal and padding mask), as the prefill does.

A joined row's own decode token is computed and thrown away (its keys land at its old position
before the prompt's overwrite positions 0..S-1; a position past the new prompt is written again
before any step reads it). Each prompt's last real token gives its row's first token, drawn at
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
    d, hd, i64 = cfg.hidden_size, cfg.head_dim, DType.I64
    ids = m.b.input("input_ids", (slots, seq), i64)
    length = m.b.input("lengths", (slots,), i64)
    row = m.b.input("row", (slots,), i64)
    table = Embedding(m, "embed_tokens.weight", (cfg.vocab_size, d))

    def cat(a: Value, b: Value, axis: int) -> Value:
        return m.op(Op.CONCAT, a, b, axis=axis)

    def part(v: Value, start: int, end: int) -> Value:  # positions [start, end) of a [1, H, B + J*S, hd] head
        return m.op(Op.SLICE, v, axes=(2,), starts=(start,), ends=(end,), steps=(1,))

    def prompts_of(t: Value) -> Value:  # [1, H, B + J*S, hd] -> the prompts' [J, H, S, hd]
        p = part(t, bsz, bsz + n_new)
        if slots == 1:
            return p
        heads = t.shape[1]
        return m.op(Op.TRANSPOSE, m.op(Op.RESHAPE, p, shape=(heads, slots, seq, hd)), perm=(1, 0, 2, 3))

    prompt_x = m.op(Op.RESHAPE, embed(m, cfg, table, ids), shape=(1, n_new, d))
    x = cat(m.op(Op.RESHAPE, embed(m, cfg, table, m.op(Op.RESHAPE, st.cur, shape=(bsz, 1))), shape=(1, bsz, d)),
            prompt_x, axis=1)  # [1, B + J*S, D]: the decode tokens, then the prompts'

    def rope_rows(cos: np.ndarray, sin: np.ndarray, sfx: str) -> tuple[Value, Value]:
        """Each token's RoPE row: a decode token's at its row's position, a prompt's at 0..S-1."""
        def rows(table_: np.ndarray, name: str) -> Value:
            at_pos = m.op(Op.GATHER, m.b.const(table_, name=name + "_table" + sfx), st.pos, axis=0)  # [B, rd]
            both = cat(at_pos, m.b.const(np.tile(table_[:seq], (slots, 1)), name=name + "_prompt" + sfx), axis=0)
            return m.op(Op.RESHAPE, both, shape=(1, 1, bsz + n_new, cfg.rope_dims))
        return rows(cos, "rope_cos"), rows(sin, "rope_sin")

    ropes = layer_ropes(m, cfg, t_max, rope_rows)
    masks = prompt_masks(m, cfg, length, seq)
    used = m.op(Op.GREATER, length, m.scalar(0, i64))  # [J]: the slots holding a prompt
    starts = m.op(Op.WHERE, used, m.scalar(0, i64), m.scalar(t_max, i64))  # an empty slot's writes: dropped
    new_caches: list[tuple[Value, Value]] = []

    def attend(i: int, q: Value, k: Value, v: Value) -> Value:
        def rows_of(t: Value) -> Value:  # [1, H, B, hd] -> [B, H, 1, hd]
            return m.op(Op.TRANSPOSE, part(t, 0, bsz), perm=(2, 1, 0, 3))

        caches = []
        for cache, t in zip(st.caches[i], (k, v)):
            c = m.op(Op.CACHE_WRITE, cache, rows_of(t), st.pos, axis=2)  # the decode tokens, at pos
            caches.append(m.op(Op.CACHE_WRITE, c, prompts_of(t), starts, row, axis=2))  # the prompts
        new_caches.append((caches[0], caches[1]))
        w = cfg.window(i)
        a = m.op(Op.KV_ATTENTION, rows_of(q), caches[0], caches[1], st.pos, scale=cfg.attention_scale,
                 softcap=cfg.attn_softcap, window=w)  # [B, H, 1, hd]
        a = m.op(Op.RESHAPE, m.op(Op.TRANSPOSE, a, perm=(0, 2, 1, 3)), shape=(1, bsz, cfg.num_heads * hd))
        p = eager_attention(m, prompts_of(q), prompts_of(k), prompts_of(v), masks[w if w < seq else 0],
                            scale=cfg.attention_scale, softcap=cfg.attn_softcap)  # [J, S, H * hd]
        if slots > 1:
            p = m.op(Op.RESHAPE, p, shape=(1, n_new, cfg.num_heads * hd))
        return cat(a, p, axis=1)  # [1, B + J*S, H * hd]

    for i in range(cfg.num_layers):
        x = decoder_layer(m, cfg, x, i, ropes[i], lambda q, k, v, i=i: attend(i, q, k, v))

    # the decode tokens' hidden states and each prompt's last real token's: B + j*S + length[j] - 1
    lasts = m.op(Op.ADD, length, m.b.const(bsz - 1 + np.arange(slots, dtype=np.int64) * seq, name="prompt_ends"))
    picks = cat(m.b.const(np.arange(bsz, dtype=np.int64), name="decode_rows"), lasts, axis=0)
    x = m.op(Op.GATHER, m.op(Op.RESHAPE, x, shape=(bsz + n_new, d)), picks, axis=0)  # [B + J, D]
    logits = lm_head(m, cfg, x, table)
    # which slot, if any, each row takes: hits[b, j] = (row[j] == b and slot j in use)
    batch_rows = m.b.const(np.arange(bsz, dtype=np.int64), name="batch_rows")
    hits = m.op(Op.AND, m.op(Op.EQUAL, m.op(Op.RESHAPE, batch_rows, shape=(bsz, 1)), m.op(Op.RESHAPE, row, shape=(1, slots))),
                m.op(Op.RESHAPE, used, shape=(1, slots)))
    hits = m.op(Op.CAST, hits, to=i64)  # [B, J]: at most one 1 per row and per slot

    def per_row(per_slot: Value) -> Value:  # [J] -> [B]: the value of the slot row b takes (0 if none)
        return m.op(Op.REDUCE_SUM, m.op(Op.MUL, hits, m.op(Op.RESHAPE, per_slot, shape=(1, slots))), axes=(1,),
                    keepdims=False)

    joined = m.op(Op.GREATER, m.op(Op.REDUCE_SUM, hits, axes=(1,), keepdims=False), m.scalar(0, i64))  # [B]
    slot_logits = m.b.const(bsz + np.arange(slots, dtype=np.int64), name="slot_logits")
    logits = m.op(Op.GATHER, logits, m.op(Op.WHERE, joined, per_row(slot_logits), batch_rows), axis=0)
    counter = m.op(Op.WHERE, joined, per_row(length), m.op(Op.ADD, st.pos, m.scalar(1, i64)))
    g = finish_step(m, st, logits, counter, new_caches, shape, eos_ids, False, joined=joined)  # type: ignore[arg-type]
    g.meta["generation"]["entry"] = "join"
    return g
