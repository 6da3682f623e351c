"""BERT encoders for training: the joint intent/slot encoder (issue 23's seed model) and a
sequence classifier (BertForSequenceClassification: a Hugging Face checkpoint plus pooler and
classification head), written once over ``fusec.train.blocks.TrainBlocks``.

The forward is BERT's (post-LayerNorm, HF modeling_bert.py) without dropout, with every weight a
view of the plan's flat parameter state: nn.Linear weights stay [out, in] and are read through
the product's transpose flag (``MATMUL[trans_b]``), so no pass needs to relayout a weight that
changes every step. Mixed precision (``TrainBlocks.cdt`` bf16) follows torch.autocast: products
take bf16 operands (fp32 accumulation), softmax, LayerNorm, the residual stream and the loss stay
fp32; the fp32 master weights are the state.

Parameter names are Hugging Face's (``embeddings.word_embeddings.weight``, ``encoder.layer.0.
attention.self.query.weight``, ...), so checkpoints map by name.
"""

from __future__ import annotations

import dataclasses
import math

from fusec.dtypes import DType
from fusec.errors import ModelError
from fusec.ir import Value
from fusec.ops import Op
from fusec.train.blocks import ParamSpec, TrainBlocks


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int = 1000
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    ffn: int = 512
    max_positions: int = 50
    type_vocab_size: int = 0  # 0: no token-type embeddings
    eps: float = 1e-12
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("eps", "init_std"):
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                    raise ModelError(f"encoder config: {f.name} must be a finite number > 0, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, int) or v < (0 if f.name == "type_vocab_size" else 1):
                raise ModelError(f"encoder config: {f.name} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise ModelError(f"encoder config: hidden size {self.hidden} is not divisible by {self.heads} heads")


def _linear_specs(prefix: str, d_in: int, d_out: int, std: float) -> list[ParamSpec]:
    return [ParamSpec(f"{prefix}.weight", (d_out, d_in), "normal", std, decay=True),
            ParamSpec(f"{prefix}.bias", (d_out,), "zeros", decay=False)]


def _norm_specs(prefix: str, d: int) -> list[ParamSpec]:
    return [ParamSpec(f"{prefix}.weight", (d,), "ones", decay=False), ParamSpec(f"{prefix}.bias", (d,), "zeros", decay=False)]


def encoder_specs(cfg: EncoderConfig, prefix: str = "") -> list[ParamSpec]:
    d, s = cfg.hidden, cfg.init_std
    out = [ParamSpec(f"{prefix}embeddings.word_embeddings.weight", (cfg.vocab_size, d), "normal", s, decay=True),
           ParamSpec(f"{prefix}embeddings.position_embeddings.weight", (cfg.max_positions, d), "normal", s, decay=True)]
    if cfg.type_vocab_size:
        out.append(ParamSpec(f"{prefix}embeddings.token_type_embeddings.weight", (cfg.type_vocab_size, d), "normal", s,
                             decay=True))
    out += _norm_specs(f"{prefix}embeddings.LayerNorm", d)
    for i in range(cfg.layers):
        p = f"{prefix}encoder.layer.{i}.attention.self"
        qkv = [_linear_specs(f"{p}.{n}", d, d, s) for n in ("query", "key", "value")]
        out += [w for w, _ in qkv] + [b for _, b in qkv]  # q, k, v weights then biases: one [3D, D] view each
        p = f"{prefix}encoder.layer.{i}"
        out += _linear_specs(f"{p}.attention.output.dense", d, d, s)
        out += _norm_specs(f"{p}.attention.output.LayerNorm", d)
        out += _linear_specs(f"{p}.intermediate.dense", d, cfg.ffn, s)
        out += _linear_specs(f"{p}.output.dense", cfg.ffn, d, s)
        out += _norm_specs(f"{p}.output.LayerNorm", d)
    return out


def linear(m: TrainBlocks, x: Value, prefix: str) -> Value:
    """x @ W^T + b with W [out, in] read through the transpose flag; operands in ``m.cdt``."""
    w, bias = m.param(f"{prefix}.weight"), m.param(f"{prefix}.bias")
    y = m.op(Op.MATMUL, m.to_cdt(x), w, trans_b=True)
    return m.op(Op.ADD, y, bias)


def _qkv_heads(m: TrainBlocks, x: Value, prefix: str, heads: int) -> list[Value]:
    """q, k and v [B, H, S, hd] from one product with the stacked [3D, D] weight: [B, S, 3D] ->
    [B, S, 3, H, hd] -> [3, B, H, S, hd] (one copy), then three views."""
    bsz, seq, d = x.shape
    names = [f"{prefix}.{n}" for n in ("query", "key", "value")]
    w = m.param_group([f"{n}.weight" for n in names])
    bias = m.param_group([f"{n}.bias" for n in names])
    qkv = m.op(Op.ADD, m.op(Op.MATMUL, m.to_cdt(x), w, trans_b=True), bias)
    hd = d // heads
    t = m.op(Op.TRANSPOSE, m.op(Op.RESHAPE, qkv, shape=(bsz, seq, 3, heads, hd)), perm=(2, 0, 3, 1, 4))
    return [m.op(Op.RESHAPE, m.op(Op.SLICE, t, axes=(0,), starts=(i,), ends=(i + 1,), steps=(1,)),
                 shape=(bsz, heads, seq, hd)) for i in range(3)]


def attention_mask(m: TrainBlocks, mask: Value) -> Value:
    """HF's additive mask [B, 1, 1, S] in fp32: (1 - mask) * finfo(f32).min."""
    bsz, seq = mask.shape
    f = m.op(Op.RESHAPE, m.op(Op.CAST, mask, to=DType.F32), shape=(bsz, 1, 1, seq))
    return m.op(Op.MUL, m.op(Op.SUB, m.scalar(1.0, DType.F32), f), m.scalar(-3.4028234663852886e38, DType.F32))


def self_attention(m: TrainBlocks, x: Value, add_mask: Value, prefix: str, heads: int) -> Value:
    d = x.shape[-1]
    q, k, v = _qkv_heads(m, x, prefix, heads)
    scores = m.op(Op.MATMUL, q, k, trans_b=True)  # [B, H, S, S], read K through the flag
    scores = m.op(Op.ADD, m.op(Op.MUL, m.to_f32(scores), m.scalar((d // heads) ** -0.5, DType.F32)), add_mask)
    probs = m.op(Op.SOFTMAX, scores, axis=3)
    ctx = m.op(Op.MATMUL, m.to_cdt(probs), v)
    bsz, _, seq, _ = ctx.shape
    return m.op(Op.RESHAPE, m.op(Op.TRANSPOSE, ctx, perm=(0, 2, 1, 3)), shape=(bsz, seq, d))


def layer_norm(m: TrainBlocks, x: Value, prefix: str, eps: float) -> Value:
    return m.op(Op.LAYERNORM, m.to_f32(x), m.param(f"{prefix}.weight", master=True), m.param(f"{prefix}.bias", master=True),
                axis=len(x.shape) - 1, eps=float(eps))


def gelu(m: TrainBlocks, x: Value) -> Value:
    return m.op(Op.GELU, x, approximate="none")


def encoder(m: TrainBlocks, cfg: EncoderConfig, ids: Value, mask: Value, prefix: str = "") -> Value:
    """BERT's embeddings and layers: [B, S] ids and mask -> [B, S, D] fp32 hidden states."""
    bsz, seq = ids.shape
    if seq > cfg.max_positions:
        raise ModelError(f"sequence length {seq} exceeds the model's {cfg.max_positions} positions")
    x = m.op(Op.GATHER, m.param(f"{prefix}embeddings.word_embeddings.weight", master=True), ids, axis=0)
    pos = m.param(f"{prefix}embeddings.position_embeddings.weight", master=True)
    if seq < cfg.max_positions:
        pos = m.op(Op.SLICE, pos, axes=(0,), starts=(0,), ends=(seq,), steps=(1,))
    x = m.op(Op.ADD, x, pos)
    if cfg.type_vocab_size:  # no token_type_ids input: type 0 everywhere (HF's default)
        types = m.param(f"{prefix}embeddings.token_type_embeddings.weight", master=True)
        x = m.op(Op.ADD, x, m.op(Op.SLICE, types, axes=(0,), starts=(0,), ends=(1,), steps=(1,)))
    x = layer_norm(m, x, f"{prefix}embeddings.LayerNorm", cfg.eps)
    add_mask = attention_mask(m, mask)
    for i in range(cfg.layers):
        p = f"{prefix}encoder.layer.{i}"
        a = linear(m, self_attention(m, x, add_mask, f"{p}.attention.self", cfg.heads), f"{p}.attention.output.dense")
        x = layer_norm(m, m.op(Op.ADD, x, m.to_f32(a)), f"{p}.attention.output.LayerNorm", cfg.eps)
        h = gelu(m, linear(m, x, f"{p}.intermediate.dense"))
        h = linear(m, h, f"{p}.output.dense")
        x = layer_norm(m, m.op(Op.ADD, x, m.to_f32(h)), f"{p}.output.LayerNorm", cfg.eps)
    return x


def first_token(m: TrainBlocks, x: Value) -> Value:
    bsz, _, d = x.shape
    return m.op(Op.RESHAPE, m.op(Op.SLICE, x, axes=(1,), starts=(0,), ends=(1,), steps=(1,)), shape=(bsz, d))


def mean_ce(m: TrainBlocks, logits: Value, labels: Value) -> Value:
    """Mean cross-entropy over the rows whose label is not -100 (0 when there are none)."""
    ce = m.op(Op.CROSS_ENTROPY, m.to_f32(logits), labels)
    axes = tuple(range(len(labels.shape)))
    keep = m.op(Op.CAST, m.op(Op.NOT, m.op(Op.EQUAL, labels, m.scalar(-100, labels.dtype))), to=DType.F32)
    count = m.op(Op.MAX, m.op(Op.REDUCE_SUM, keep, axes=axes, keepdims=False), m.scalar(1.0, DType.F32))
    return m.op(Op.DIV, m.op(Op.REDUCE_SUM, ce, axes=axes, keepdims=False), count)
