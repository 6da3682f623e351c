"""Graphs for autoregressive generation: a prefill graph and a decode graph over one KV cache.

Both graphs read and update the same **state** (``GraphBuilder.state``; persistent device memory
that the plan owns and both entry points share):

===============  ==================  ===============================================================
state            shape, dtype        meaning
===============  ==================  ===============================================================
``k.L, v.L``     [B, Hkv, T, hd] f   layer L's key/value cache (T = ``max_seq_len``), storage dtype
``pos``          [B] i64             tokens in the cache per sequence = position of the next token fed
``cur``          [B] i64             the last token drawn (the decode step's input)
``done``         [B] bool            the sequence has drawn an end-of-sequence token (or filled T)
``tokens``       [B, T] i64          token t of sequence b sits at ``tokens[b, t]`` (drawn ones only)
``temperature``  [B] f32             the row's sampling settings (fusec/sampling.py): written by
``top_k``        [B] i64             the host once per request, read by every step's ``sample``
``top_p``        [B] f32
``seed``         [B] i64
===============  ==================  ===============================================================

Nothing about sampling is compiled into a plan: the host writes a row's four settings (whole [B]
arrays, from its own copy of every row's settings) before the prefill that admits the row, outside
any captured graph; after that nothing crosses between host and device until tokens are read back.

* **prefill** (inputs ``input_ids`` [B, S], prompts right-padded, and ``lengths`` [B]: row b's
  prompt length, or 0 for a row that is not admitted): the model in the HF eager form (the pattern
  passes turn it into fused attention), plus a ``cache_write`` of every layer's post-RoPE keys and
  values at position 0; the hidden state of each row's last real token goes through the final
  norm and the LM head; the first new token is drawn at position ``lengths[b]`` and written to
  ``tokens`` and ``cur``; ``pos`` = ``lengths``, ``done`` = drew an end-of-sequence token.
  **Admission**: a row with ``lengths[b] == 0`` is left exactly as it was (its caches are written
  at position T, which a cache write drops; its ``pos``/``cur``/``done``/``tokens`` keep their
  values), so a server admits new requests into free rows between decode steps while the other
  rows keep decoding; ``fusec generate`` admits every row at once. The prefill computes all B rows
  (a non-admitted row as a one-token dummy prompt): admitting k rows costs one prefill, whatever k.
* **admit** (``admit_batch`` A > 0; inputs ``input_ids`` [A, S] and ``lengths`` [A] of A prompts,
  ``row_lengths`` [B] and ``src`` [B]: ``fusec.generation.admit_feeds``): the prefill computed for
  A prompts only; each layer's keys/values and the logits are gathered into the batch's rows by
  ``src``, then written, drawn and recorded exactly as the prefill does with ``lengths`` =
  ``row_lengths``. A server admitting k rows runs it ceil(k / A) times instead of computing B.
* **join** (``join`` = J; inputs ``input_ids`` [J, S], ``lengths`` [J] and ``row`` [J]:
  ``fusec.generation.join_feeds``): a decode step of every row that also prefills up to J prompts
  into free rows, in the same products (models/join.py).
* **decode** (no inputs): embeds ``cur`` at position ``pos``, writes K/V at ``pos``, attends keys
  ``0..pos`` (``kv_attention``; a sliding-window layer only the last ``window`` of them: the cache
  keeps every position, the window is a bound on the keys read, not a ring buffer), draws the next
  token at ``pos + 1``; ``pos`` advances by one
  unless the row was already done. The step is the same launch list every time: it is captured
  once as a CUDA graph and replayed per token.

A row is also done once its cache is full (``pos >= T - 1``: the next token would have nowhere to
go), so a row nobody reads any more (a server's freed row) never runs past its cache.

``new tokens of row b = tokens[b, lengths[b] : pos[b] + 1]`` after the last step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fusec.dtypes import DType
from fusec.errors import InputError, ModelError
from fusec.ir import Graph, Value
from fusec.ops import Op

from .layers import Blocks, Embedding, eager_attention
from .llama import decoder_layer, embed, layer_ropes, lm_head, window_masks
from .registry import LLAMA_STYLE, ModelConfig


@dataclasses.dataclass(frozen=True)
class GenerationShape:
    batch: int
    max_seq_len: int  # T: the KV cache's length, prompt + new tokens
    prefill_len: int  # S: the prefill graph's (padded) prompt length
    admit_batch: int = 0  # A: the admit entry's prompts per run (0: no admit entry)
    join: int = 0  # J: a join entry, a decode step that also prefills up to J prompts (models/join.py); 0: none

    def __post_init__(self) -> None:
        for name in ("batch", "max_seq_len", "prefill_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.prefill_len > self.max_seq_len:
            raise InputError(f"prefill length {self.prefill_len} exceeds --max-seq-len {self.max_seq_len}")
        check_admit_batch(self.admit_batch, self.batch)
        check_join(self.join, self.batch)
        object.__setattr__(self, "join", int(self.join))  # join=True: one prompt per step


def check_admit_batch(admit_batch: object, batch: int) -> None:
    """An admit entry's prompts per run: 0 (none) or fewer than the batch's rows (the CLIs ask
    before loading a model, GenerationShape again)."""
    a = admit_batch
    if not isinstance(a, int) or isinstance(a, bool) or not 0 <= a < batch:
        raise InputError(f"--admit-batch must be 0 (none) or less than the batch ({batch}), got {a!r}")


def check_join(join: object, batch: int) -> None:
    """A join entry's prompts per step: 0 (none) up to the batch's rows (``True``: 1)."""
    if not isinstance(join, int) or not 0 <= join <= batch:
        raise InputError(f"--join must be 0 (none) or 1 to the batch ({batch}) prompts per step, got {join!r}")


class SharedWeights:
    """Hands every graph the same fp32 array (or packed weight) per parameter name (built once,
    shared by entries); ``stored(storage)``: the same for a compile storing weights in fp16/bf16
    (``StoredWeights``)."""

    def __init__(self, source: object):
        self.source = source
        self._cache: dict[str, np.ndarray] = {}
        self._packed: dict[str, object] = {}
        self._stored: dict[str, SharedWeights] = {}

    def stored(self, storage: str | None) -> SharedWeights:
        from .weights import StoredWeights

        if storage not in ("f16", "bf16"):
            return self
        if storage not in self._stored:
            self._stored[storage] = SharedWeights(StoredWeights(self.source, storage))  # type: ignore[arg-type]
        return self._stored[storage]

    def get(self, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        arr = self._cache.get(name)
        if arr is None:
            arr = self._cache[name] = self.source.get(name, shape, kind)  # type: ignore[attr-defined]
        return arr

    def get_packed(self, name: str, shape: tuple[int, ...]) -> object:
        """The source's packed form of ``name`` (one per name, shared by the entries), or None."""
        getter = getattr(self.source, "get_packed", None)
        if getter is None:
            return None
        if name not in self._packed:
            self._packed[name] = getter(name, shape)
        return self._packed[name]

    def finish(self) -> None:
        self.source.finish()  # type: ignore[attr-defined]


def check_generation_model(cfg: ModelConfig) -> None:
    if cfg.family not in LLAMA_STYLE:
        raise ModelError(f"model {cfg.name!r} ({cfg.family}) cannot generate: text generation supports "
                         f"Llama-style decoders ({', '.join(LLAMA_STYLE)}); "
                         f"{'it is an encoder' if not cfg.is_decoder else 'its family has no KV-cache builder yet'}")


def build_generation(cfg: ModelConfig, weights: object, shape: GenerationShape,
                     eos_ids: tuple[int, ...]) -> dict[str, Graph]:
    """{"prefill": Graph, "decode": Graph} sharing ``weights`` (wrap a source in SharedWeights)."""
    check_generation_model(cfg)
    if shape.max_seq_len > cfg.max_positions:
        raise InputError(f"a KV cache of {shape.max_seq_len} positions (max_seq_len) exceeds the model's context of "
                         f"{cfg.max_positions} positions")
    if cfg.rope_scaling is not None:
        cfg.rope_scaling.check(cfg.rope_dims, shape.max_seq_len)
    if any(not 0 <= e < cfg.vocab_size for e in eos_ids):
        raise InputError(f"end-of-sequence ids {list(eos_ids)} must lie within the vocabulary ({cfg.vocab_size})")
    graphs = {"prefill": _build(cfg, weights, shape, eos_ids, "prefill"),
              "decode": _build(cfg, weights, shape, eos_ids, "decode")}
    if shape.admit_batch:
        graphs["admit"] = _build(cfg, weights, shape, eos_ids, "admit")
    if shape.join:
        from .join import build_join

        graphs["join"] = build_join(cfg, weights, shape, eos_ids)
    return graphs


class _State:
    def __init__(self, m: Blocks, cfg: ModelConfig, shape: GenerationShape):
        b, t = shape.batch, shape.max_seq_len
        self.m, self.batch, self.t_max = m, b, t
        kv = (b, cfg.num_kv_heads, t, cfg.head_dim)
        self.caches = [(m.b.state(f"k.{i}", kv, DType.F32), m.b.state(f"v.{i}", kv, DType.F32))
                       for i in range(cfg.num_layers)]
        self.pos = m.b.state("pos", (b,), DType.I64)
        self.cur = m.b.state("cur", (b,), DType.I64)
        self.done = m.b.state("done", (b,), DType.BOOL)
        self.tokens = m.b.state("tokens", (b, t), DType.I64)
        self.temperature = m.b.state("temperature", (b,), DType.F32)
        self.top_k = m.b.state("top_k", (b,), DType.I64)
        self.top_p = m.b.state("top_p", (b,), DType.F32)
        self.seed = m.b.state("seed", (b,), DType.I64)
        self.admit: Value | None = None  # prefill: lengths > 0

    def prefill_inputs(self, seq: int) -> tuple[Value, Value, Value]:
        """The prefill's inputs ``input_ids`` [B, S] and ``lengths`` [B] (0: the row is not
        admitted); returns (input_ids, the prompt length each row computes with: a non-admitted row
        runs a one-token dummy prompt, and the cache-write position: 0, or T for a non-admitted
        row, where the write is dropped)."""
        m, i64 = self.m, DType.I64
        ids = m.b.input("input_ids", (self.batch, seq), i64)
        lengths = m.b.input("lengths", (self.batch,), i64)
        self.lengths = lengths
        self.admit = m.op(Op.GREATER, lengths, m.scalar(0, i64))
        length = m.op(Op.WHERE, self.admit, lengths, m.scalar(1, i64))
        write_at = m.op(Op.WHERE, self.admit, m.scalar(0, i64), m.scalar(self.t_max, i64))
        return ids, length, write_at

    def admit_inputs(self, seq: int, slots: int) -> tuple[Value, Value, Value]:
        """The admit entry's inputs: ``input_ids`` [A, S] and ``lengths`` [A] (0: an unused slot) of
        A prompts, and per row of the batch ``row_lengths`` [B] (the admitted prompt's length, 0:
        the row is left as it is) and ``src`` [B] (the slot row b takes its keys, values and logits
        from; any slot where not admitted). Returns (input_ids, each slot's computed prompt length,
        src); ``admit``, ``lengths`` and the cache-write position are per row of the batch, as the
        prefill has them."""
        m, i64 = self.m, DType.I64
        ids = m.b.input("input_ids", (slots, seq), i64)
        slot_lengths = m.b.input("lengths", (slots,), i64)
        self.lengths = m.b.input("row_lengths", (self.batch,), i64)
        src = m.b.input("src", (self.batch,), i64)
        self.admit = m.op(Op.GREATER, self.lengths, m.scalar(0, i64))
        self.write_at = m.op(Op.WHERE, self.admit, m.scalar(0, i64), m.scalar(self.t_max, i64))
        length = m.op(Op.WHERE, m.op(Op.GREATER, slot_lengths, m.scalar(0, i64)), slot_lengths, m.scalar(1, i64))
        return ids, length, src


def _build(cfg: ModelConfig, weights: object, shape: GenerationShape, eos_ids: tuple[int, ...],
           mode: str) -> Graph:
    """The ``mode`` entry's graph: "prefill", "decode", or "admit" (the prefill of ``admit_batch``
    prompts into chosen rows: its keys, values and first tokens are gathered into the batch's rows
    by ``src``, then written as the prefill writes them)."""
    m = Blocks(f"{cfg.name}.{mode}", weights)  # type: ignore[arg-type]
    st = _State(m, cfg, shape)
    t_max, d, hd = shape.max_seq_len, cfg.hidden_size, cfg.head_dim
    bsz = shape.admit_batch if mode == "admit" else shape.batch  # the rows the graph computes
    seq = 1 if mode == "decode" else shape.prefill_len
    table = Embedding(m, "embed_tokens.weight", (cfg.vocab_size, d))
    i64 = DType.I64
    src = None
    if mode != "decode":
        if mode == "admit":
            ids, length, src = st.admit_inputs(seq, bsz)
            write_at = st.write_at
        else:
            ids, length, write_at = st.prefill_inputs(seq)
        masks = prompt_masks(m, cfg, length, seq)
        ropes = layer_ropes(m, cfg, t_max, lambda c, s, sfx: (m.b.const(c[None, None, :seq], name="rope_cos" + sfx),
                                                             m.b.const(s[None, None, :seq], name="rope_sin" + sfx)))
    else:
        ids = m.op(Op.RESHAPE, st.cur, shape=(bsz, 1))
        at = m.op(Op.RESHAPE, st.pos, shape=(bsz, 1))

        def rows_at(cos: np.ndarray, sin: np.ndarray, sfx: str) -> tuple[Value, Value]:
            """Each sequence's cos and sin rows at its position: one gather from the two tables stacked [2, T, D]
            (one launch), its halves contiguous [B, 1, 1, D] views."""
            both = m.op(Op.GATHER, m.b.const(np.stack([cos, sin]), name="rope_cos_sin_table" + sfx), at, axis=1)
            return tuple(m.op(Op.RESHAPE, m.op(Op.SLICE, both, axes=(0,), starts=(i,), ends=(i + 1,), steps=(1,)),
                              shape=(bsz, 1, 1, cfg.rope_dims)) for i in (0, 1))  # type: ignore[return-value]

        ropes = layer_ropes(m, cfg, t_max, rows_at)
        write_at = st.pos

    x = embed(m, cfg, table, ids)
    new_caches: list[tuple[Value, Value]] = []

    def attend(i: int, q: Value, k: Value, v: Value) -> Value:
        """Write this layer's K/V into the cache, then attend: prefill over the fresh keys (the
        HF eager form the pattern passes fuse; a sliding window is part of the mask), decode over
        the cache up to each row's position (keys older than its window skipped). The cache
        keeps every position of every layer: a windowed layer's window is a bound, not a ring."""
        k_rows, v_rows = (k, v) if src is None else (m.op(Op.GATHER, k, src, axis=0), m.op(Op.GATHER, v, src, axis=0))
        k_cache = m.op(Op.CACHE_WRITE, st.caches[i][0], k_rows, write_at, axis=2)
        v_cache = m.op(Op.CACHE_WRITE, st.caches[i][1], v_rows, write_at, axis=2)
        new_caches.append((k_cache, v_cache))
        w = cfg.window(i)
        if mode == "prefill":
            # over the cache rows just written (the prompt's keys at positions 0..S-1): the fresh
            # keys and values then have one reader, the cache write, which takes them in the RoPE's
            # launch (rope_siblings) instead of copies of their own
            k, v = (m.op(Op.SLICE, c, axes=(2,), starts=(0,), ends=(seq,), steps=(1,)) for c in (k_cache, v_cache))
        if mode != "decode":
            return eager_attention(m, q, k, v, masks[w if w < seq else 0], scale=cfg.attention_scale,
                                   softcap=cfg.attn_softcap)
        a = m.op(Op.KV_ATTENTION, q, k_cache, v_cache, st.pos, scale=cfg.attention_scale, softcap=cfg.attn_softcap,
                 window=w)
        return m.op(Op.RESHAPE, m.op(Op.TRANSPOSE, a, perm=(0, 2, 1, 3)), shape=(bsz, 1, cfg.num_heads * hd))

    for i in range(cfg.num_layers):
        x = decoder_layer(m, cfg, x, i, ropes[i], lambda q, k, v, i=i: attend(i, q, k, v))

    if mode != "decode":  # the hidden state of each row's last real token: row b*S + length[b] - 1 of [B*S, D]
        starts = m.b.const(np.arange(bsz, dtype=np.int64) * seq - 1, name="row_starts")
        x = m.op(Op.GATHER, m.op(Op.RESHAPE, x, shape=(bsz * seq, d)), m.op(Op.ADD, starts, length), axis=0)
        counter = length  # the new token's position
    else:
        x = m.op(Op.RESHAPE, x, shape=(bsz, d))
        counter = m.op(Op.ADD, st.pos, m.scalar(1, i64))
    logits = lm_head(m, cfg, x, table)
    if mode != "admit":
        return finish_step(m, st, logits, counter, new_caches, shape, eos_ids, mode == "prefill")
    # the batch's rows take their slot's logits and draw as the prefill draws (each row's own
    # sampling state, fp32, at its prompt length); a row not admitted draws nothing it keeps
    g = finish_step(m, st, m.op(Op.GATHER, logits, src, axis=0), st.lengths, new_caches, shape, eos_ids, True)
    g.meta["generation"]["entry"] = "admit"
    return g


def prompt_masks(m: Blocks, cfg: ModelConfig, length: Value, seq: int) -> dict[int, Value]:
    """The prompts' attention masks by window (``window_masks``) for right-padded prompts of
    ``length`` [N]: attention_mask[n, j] = j < length[n], made on the device.

    A causal layer's (window 0) is the constant causal mask alone. A prompt's real query i
    (i < length) sees keys j <= i, all real, so the padding mask hides none of its keys; the
    pattern pass turns the constant into the attention's causal flag, and the kernel skips the
    keys past each block's rows and reads no mask (the [N,1,S,S] mask had been read a score at a
    time over every key: Qwen3-0.6B's 2,048-token prefill spent 248 us a layer in its attention,
    H200). A padding row (i >= length) then sees the padding's keys up to i: nothing reads those
    rows (the LM head takes row length - 1, and a decode step writes a cache row before any step
    reads it). Windowed layers keep the window combined with the padding mask."""
    cols = m.b.const(np.arange(seq, dtype=np.int64)[None, :], name="columns")
    rows = m.op(Op.RESHAPE, length, shape=(length.shape[0], 1))
    return window_masks(m, cfg, m.op(Op.CAST, m.op(Op.LESS, cols, rows), to=DType.I64), causal_alone=True)


def finish_step(m: Blocks, st: _State, logits: Value, counter: Value, new_caches: list[tuple[Value, Value]],
                shape: GenerationShape, eos_ids: tuple[int, ...], prefill: bool, joined: Value | None = None) -> Graph:
    """The tail every generation graph shares: draw a token from ``logits`` [B, V] at ``counter``
    with each row's sampling state, end rows at an eos id or a full cache, record the token, advance
    ``pos``/``cur``/``done`` (prefill: of the admitted rows only), give every state its update
    (``new_caches``: each layer's written K/V caches) and set ``meta["generation"]``. ``joined``
    (a decode step, [B] bool: models/join.py): those rows start as the prefill starts a row.
    Also used by fusec/frontend/kv_cache.py (ONNX decoders exported with a KV cache)."""
    bsz, t_max, i64 = shape.batch, shape.max_seq_len, DType.I64
    tok = m.op(Op.SAMPLE, logits, st.seed, counter, st.temperature, st.top_k, st.top_p)

    is_eos: Value | None = None  # no end-of-sequence ids: every row runs to max_new_tokens
    for e in eos_ids:
        hit = m.op(Op.EQUAL, tok, m.scalar(int(e), i64))
        is_eos = hit if is_eos is None else m.op(Op.OR, is_eos, hit)
    if is_eos is None:
        is_eos = m.op(Op.EQUAL, tok, m.scalar(-1, i64))  # never true: ids are >= 0
    last = m.scalar(t_max - 1, i64)  # a row at this position has no room for another token
    if prefill:
        assert st.admit is not None
        admit = st.admit
        at = m.op(Op.WHERE, admit, counter, m.scalar(t_max, i64))  # T: a non-admitted row's write is dropped
        tokens = m.op(Op.CACHE_WRITE, st.tokens, m.op(Op.RESHAPE, tok, shape=(bsz, 1)), at, axis=1)
        full = m.op(Op.GREATER_EQUAL, counter, last)
        done = m.op(Op.WHERE, admit, m.op(Op.OR, is_eos, full), st.done)
        pos = m.op(Op.WHERE, admit, counter, st.pos)
        tok = m.op(Op.WHERE, admit, tok, st.cur)
    else:
        tokens = m.op(Op.CACHE_WRITE, st.tokens, m.op(Op.RESHAPE, tok, shape=(bsz, 1)), counter, axis=1)
        pos = m.op(Op.ADD, st.pos, m.op(Op.CAST, m.op(Op.NOT, st.done), to=i64))
        done = m.op(Op.OR, m.op(Op.OR, st.done, is_eos), m.op(Op.GREATER_EQUAL, pos, last))
        if joined is not None:  # as the prefill: at the prompt's length, done on an eos id or a full cache
            pos = m.op(Op.WHERE, joined, counter, pos)
            done = m.op(Op.WHERE, joined, m.op(Op.OR, is_eos, m.op(Op.GREATER_EQUAL, counter, last)), done)
    for (k_state, v_state), (k_new, v_new) in zip(st.caches, new_caches):
        m.b.update(k_state, k_new)
        m.b.update(v_state, v_new)
    m.b.update(st.pos, pos)
    m.b.update(st.cur, tok)
    m.b.update(st.done, done)
    m.b.update(st.tokens, tokens)
    for s in (st.temperature, st.top_k, st.top_p, st.seed):  # the host writes them; steps only read
        m.b.update(s, s)
    g = m.b.build()
    g.meta["generation"] = {"entry": "prefill" if prefill else "decode", "batch": bsz, "max_seq_len": t_max,
                            "prefill_len": shape.prefill_len, "eos_ids": [int(e) for e in eos_ids]}
    if shape.admit_batch:
        g.meta["generation"]["admit_batch"] = shape.admit_batch
    if shape.join:
        g.meta["generation"]["join"] = int(shape.join)
    return g
