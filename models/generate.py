"""Graphs for autoregressive generation: a prefill graph and a decode graph over one KV cache.

Both graphs read and update the same **state** (``GraphBuilder.state``; persistent device memory
that the plan owns and both entry points share):

=============  ==================  =================================================================
state          shape, dtype        meaning
=============  ==================  =================================================================
``k.L, v.L``   [B, Hkv, T, hd] f   layer L's key/value cache (T = ``max_seq_len``), storage dtype
``pos``        [B] i64             tokens in the cache per sequence = position of the next token fed
``cur``        [B] i64             the last token drawn (the decode step's input)
``done``       [B] bool            the sequence has drawn an end-of-sequence token
``tokens``     [B, T] i64          token t of sequence b sits at ``tokens[b, t]`` (drawn ones only)
``seed``       [1] i64             the sampling seed (read only)
=============  ==================  =================================================================

The caller (``fusec.generate``) writes ``pos`` (the prompt lengths), ``done`` (False) and ``seed``
once before the prefill; after that nothing crosses between host and device until the tokens are
read back.

* **prefill** (input ``input_ids`` [B, S], prompts right-padded; row b holds ``pos[b]`` real
  tokens): the model in the HF eager form (the pattern passes turn it into fused attention),
  plus a ``cache_write`` of every layer's post-RoPE keys and values at position 0; the hidden state
  of each row's last real token goes through the final norm and the LM head; the first new
  token is drawn at position ``pos[b]`` and written to ``tokens`` and ``cur``.
* **decode** (no inputs): embeds ``cur`` at position ``pos``, writes K/V at ``pos``, attends keys
  ``0..pos`` (``kv_attention``), draws the next token at ``pos + 1``; ``pos`` advances by one
  unless the row was already done. The step is the same launch list every time: it is captured
  once as a CUDA graph and replayed per token.

``new tokens of row b = tokens[b, lengths[b] : pos[b] + 1]`` after the last step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fusec.dtypes import DType
from fusec.errors import InputError, ModelError
from fusec.ir import Graph, Value
from fusec.ops import Op

from .layers import Blocks, causal_padding_mask, eager_attention, embedding, linear, rms_norm
from .llama import decoder_layer
from .registry import ModelConfig


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (compiled into the plan; see fusec/sampling.py)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.top_k >= 0 and 0 < self.top_p <= 1):
            raise InputError(f"sampling: temperature must be >= 0 (got {self.temperature}), top_k >= 0 "
                             f"(got {self.top_k}) and top_p in (0, 1] (got {self.top_p})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class GenerationShape:
    batch: int
    max_seq_len: int  # T: the KV cache's length, prompt + new tokens
    prefill_len: int  # S: the prefill graph's (padded) prompt length

    def __post_init__(self) -> None:
        for name in ("batch", "max_seq_len", "prefill_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.prefill_len > self.max_seq_len:
            raise InputError(f"prefill length {self.prefill_len} exceeds --max-seq-len {self.max_seq_len}")


class SharedWeights:
    """Hands every graph the same fp32 array per parameter name (built once, shared by entries);
    ``stored(storage)``: the same for a compile storing weights in fp16/bf16 (``StoredWeights``)."""

    def __init__(self, source: object):
        self.source = source
        self._cache: dict[str, np.ndarray] = {}
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

    def finish(self) -> None:
        self.source.finish()  # type: ignore[attr-defined]


def check_generation_model(cfg: ModelConfig) -> None:
    if cfg.family not in ("llama", "qwen3"):
        raise ModelError(f"model {cfg.name!r} ({cfg.family}) cannot generate: text generation supports "
                         f"Llama-style decoders (llama, qwen3 families); "
                         f"{'it is an encoder' if not cfg.is_decoder else 'its family has no KV-cache builder yet'}")


def build_generation(cfg: ModelConfig, weights: object, shape: GenerationShape, sampling: Sampling,
                     eos_ids: tuple[int, ...]) -> dict[str, Graph]:
    """{"prefill": Graph, "decode": Graph} sharing ``weights`` (wrap a source in SharedWeights)."""
    check_generation_model(cfg)
    if shape.max_seq_len > cfg.max_positions:
        raise InputError(f"a KV cache of {shape.max_seq_len} positions (max_seq_len) exceeds the model's context of "
                         f"{cfg.max_positions} positions")
    if any(not 0 <= e < cfg.vocab_size for e in eos_ids):
        raise InputError(f"end-of-sequence ids {list(eos_ids)} must lie within the vocabulary ({cfg.vocab_size})")
    return {"prefill": _build(cfg, weights, shape, sampling, eos_ids, prefill=True),
            "decode": _build(cfg, weights, shape, sampling, eos_ids, prefill=False)}


class _State:
    def __init__(self, m: Blocks, cfg: ModelConfig, shape: GenerationShape):
        b, t = shape.batch, shape.max_seq_len
        kv = (b, cfg.num_kv_heads, t, cfg.head_dim)
        self.caches = [(m.b.state(f"k.{i}", kv, DType.F32), m.b.state(f"v.{i}", kv, DType.F32))
                       for i in range(cfg.num_layers)]
        self.pos = m.b.state("pos", (b,), DType.I64)
        self.cur = m.b.state("cur", (b,), DType.I64)
        self.done = m.b.state("done", (b,), DType.BOOL)
        self.tokens = m.b.state("tokens", (b, t), DType.I64)
        self.seed = m.b.state("seed", (1,), DType.I64)


def _rope_table(cfg: ModelConfig, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [length, hd] as HF's default RoPE computes them (fp32 inv_freq, cat(freqs, freqs))."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd)))
    freqs = np.arange(length, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def _build(cfg: ModelConfig, weights: object, shape: GenerationShape, sampling: Sampling,
           eos_ids: tuple[int, ...], prefill: bool) -> Graph:
    m = Blocks(f"{cfg.name}.{'prefill' if prefill else 'decode'}", weights)  # type: ignore[arg-type]
    st = _State(m, cfg, shape)
    bsz, t_max, d, hd, eps = shape.batch, shape.max_seq_len, cfg.hidden_size, cfg.head_dim, cfg.norm_eps
    seq = shape.prefill_len if prefill else 1
    table = m.param("embed_tokens.weight", (cfg.vocab_size, d))
    cos_t, sin_t = _rope_table(cfg, t_max)
    i64 = DType.I64

    if prefill:
        ids = m.b.input("input_ids", (bsz, seq), i64)
        # attention_mask[b, j] = j < pos[b]: the padding mask of right-padded prompts, on the device
        cols = m.b.const(np.arange(seq, dtype=np.int64)[None, :], name="columns")
        mask_i = m.op(Op.CAST, m.op(Op.LESS, cols, m.op(Op.RESHAPE, st.pos, shape=(bsz, 1))), to=i64)
        mask = causal_padding_mask(m, mask_i)
        cos = m.b.const(cos_t[None, None, :seq], name="rope_cos")
        sin = m.b.const(sin_t[None, None, :seq], name="rope_sin")
        write_at = m.b.const(np.zeros(bsz, np.int64), name="zero_positions")
    else:
        ids = m.op(Op.RESHAPE, st.cur, shape=(bsz, 1))
        at = m.op(Op.RESHAPE, st.pos, shape=(bsz, 1))
        cos = m.op(Op.RESHAPE, m.op(Op.GATHER, m.b.const(cos_t, name="rope_cos_table"), at, axis=0),
                   shape=(bsz, 1, 1, hd))
        sin = m.op(Op.RESHAPE, m.op(Op.GATHER, m.b.const(sin_t, name="rope_sin_table"), at, axis=0),
                   shape=(bsz, 1, 1, hd))
        write_at = st.pos

    x = embedding(m, table, ids)
    new_caches: list[tuple[Value, Value]] = []

    def attend(i: int, q: Value, k: Value, v: Value) -> Value:
        """Write this layer's K/V into the cache, then attend: prefill over the fresh keys (the
        HF eager form the pattern passes fuse), decode over the cache up to each row's position."""
        k_cache = m.op(Op.CACHE_WRITE, st.caches[i][0], k, write_at, axis=2)
        v_cache = m.op(Op.CACHE_WRITE, st.caches[i][1], v, write_at, axis=2)
        new_caches.append((k_cache, v_cache))
        if prefill:
            return eager_attention(m, q, k, v, mask, scale=hd ** -0.5)
        a = m.op(Op.KV_ATTENTION, q, k_cache, v_cache, st.pos, scale=hd ** -0.5)
        return m.op(Op.RESHAPE, m.op(Op.TRANSPOSE, a, perm=(0, 2, 1, 3)), shape=(bsz, 1, cfg.num_heads * hd))

    for i in range(cfg.num_layers):
        x = decoder_layer(m, cfg, x, i, cos, sin, lambda q, k, v, i=i: attend(i, q, k, v))

    if prefill:  # the hidden state of each row's last real token: row b*S + pos[b] - 1 of [B*S, D]
        starts = m.b.const(np.arange(bsz, dtype=np.int64) * seq - 1, name="row_starts")
        x = m.op(Op.GATHER, m.op(Op.RESHAPE, x, shape=(bsz * seq, d)), m.op(Op.ADD, starts, st.pos), axis=0)
        counter = st.pos  # the new token's position
    else:
        x = m.op(Op.RESHAPE, x, shape=(bsz, d))
        counter = m.op(Op.ADD, st.pos, m.scalar(1, i64))
    x = rms_norm(m, x, "norm", d, eps)
    if cfg.tie_word_embeddings:
        logits = m.op(Op.MATMUL, x, m.op(Op.TRANSPOSE, table, perm=(1, 0)))
    else:
        logits = linear(m, x, "lm_head", d, cfg.vocab_size, bias=False)
    return finish_step(m, st, logits, counter, new_caches, shape, sampling, eos_ids, prefill)


def finish_step(m: Blocks, st: _State, logits: Value, counter: Value, new_caches: list[tuple[Value, Value]],
                shape: GenerationShape, sampling: Sampling, eos_ids: tuple[int, ...], prefill: bool) -> Graph:
    """The tail every generation graph shares: draw a token from ``logits`` [B, V] at ``counter``,
    end rows at an eos id, record the token, advance ``pos``/``cur``/``done``, give every state its
    update (``new_caches``: each layer's written K/V caches) and set ``meta["generation"]``.
    Also used by fusec/frontend/kv_cache.py (ONNX decoders exported with a KV cache)."""
    bsz, t_max, i64 = shape.batch, shape.max_seq_len, DType.I64
    tok = m.op(Op.SAMPLE, logits, st.seed, counter, temperature=float(sampling.temperature),
               top_k=int(sampling.top_k), top_p=float(sampling.top_p))

    is_eos: Value | None = None  # no end-of-sequence ids: every row runs to max_new_tokens
    for e in eos_ids:
        hit = m.op(Op.EQUAL, tok, m.scalar(int(e), i64))
        is_eos = hit if is_eos is None else m.op(Op.OR, is_eos, hit)
    if is_eos is None:
        is_eos = m.op(Op.EQUAL, tok, m.scalar(-1, i64))  # never true: ids are >= 0
    tokens = m.op(Op.CACHE_WRITE, st.tokens, m.op(Op.RESHAPE, tok, shape=(bsz, 1)), counter, axis=1)
    if prefill:
        done, pos = is_eos, st.pos
    else:
        done = m.op(Op.OR, st.done, is_eos)
        pos = m.op(Op.ADD, st.pos, m.op(Op.CAST, m.op(Op.NOT, st.done), to=i64))
    for (k_state, v_state), (k_new, v_new) in zip(st.caches, new_caches):
        m.b.update(k_state, k_new)
        m.b.update(v_state, v_new)
    m.b.update(st.pos, pos)
    m.b.update(st.cur, tok)
    m.b.update(st.done, done)
    m.b.update(st.tokens, tokens)
    m.b.update(st.seed, st.seed)
    g = m.b.build()
    g.meta["generation"] = {"entry": "prefill" if prefill else "decode", "batch": bsz, "max_seq_len": t_max,
                            "prefill_len": shape.prefill_len, "eos_ids": [int(e) for e in eos_ids],
                            "sampling": dataclasses.asdict(sampling)}
    return g
