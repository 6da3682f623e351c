"""Shared transformer blocks, emitted op by op in the form HF's eager PyTorch code exports to.

The pattern passes must recognize the same forms in these graphs and in imported ONNX exports of
the HF models, so each block mirrors its HF module line by line (see the docstrings), including
the weight TRANSPOSE in front of every nn.Linear MATMUL (the export form; a pass caches it).
"""

from __future__ import annotations

import math

import numpy as np

from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph, Value
from fusec.ops import Op

from .weights import BIAS, MATRIX, NORM, WeightSource

F32_MIN = float(np.finfo(np.float32).min)  # HF's torch.finfo(float32).min for masked positions


class Blocks:
    """A GraphBuilder plus the weight source, with shared scalar constants."""

    def __init__(self, name: str, weights: WeightSource):
        self.b = GraphBuilder(name)
        self.weights = weights
        self._scalars: dict[tuple[float, str], Value] = {}

    def param(self, name: str, shape: tuple[int, ...], kind: str = MATRIX) -> Value:
        arr = self.weights.get(name, shape, kind)
        if arr.dtype == np.float32:
            return self.b.const(arr, name=name, dtype=DType.F32)
        # stored in a compile's half-precision dtype (weights.StoredWeights): read as fp32, as it computes
        stored = self.b.const(arr, name=name, dtype=DType.from_np(arr.dtype))
        return self.b.emit(Op.CAST, stored, to=DType.F32, name=f"{name}.f32")  # type: ignore[no-any-return]

    def qmatmul(self, x: Value, name: str, shape: tuple[int, ...]) -> Value | None:
        """x @ W^T as one QMATMUL when the source keeps weight ``name`` [N, K] packed
        (``get_packed``: a GGUF file's quantized projections), else None."""
        getter = getattr(self.weights, "get_packed", None)
        qw = getter(name, shape) if getter is not None else None
        if qw is None:
            return None
        consts = [self.b.const(a, name=f"{name}.{role}") for role, a in zip(qw.roles, qw.arrays)]
        return self.op(Op.QMATMUL, x, *consts, format=qw.format, n=qw.n, k=qw.k, group=qw.group)

    def scalar(self, x: float, dtype: DType = DType.F32) -> Value:
        # One constant per distinct value: a model uses eps, 0.5, 1.0... thousands of times.
        key = (float(x), dtype.value)
        v = self._scalars.get(key)
        if v is None:
            v = self._scalars[key] = self.b.scalar(x, dtype, name=f"scalar_{dtype.value}_{x!r}")
        return v

    def op(self, op: Op, *inputs: Value, **attrs: object) -> Value:
        return self.b.emit(op, *inputs, **attrs)

    def finish(self, out: Value, name: str) -> Graph:
        self.b.output(out, name)
        return self.b.build()


# ---- projections ---------------------------------------------------------------------------


def linear(m: Blocks, x: Value, prefix: str, d_in: int, d_out: int, bias: bool) -> Value:
    """nn.Linear: weight stored [out, in] as HF stores it, TRANSPOSE then MATMUL (+ ADD bias); a
    weight the source keeps packed is one QMATMUL over its packed operands instead."""
    y = m.qmatmul(x, f"{prefix}.weight", (d_out, d_in))
    if y is None:
        w = m.param(f"{prefix}.weight", (d_out, d_in))
        y = m.op(Op.MATMUL, x, m.op(Op.TRANSPOSE, w, perm=(1, 0)))
    if bias:
        y = m.op(Op.ADD, y, m.param(f"{prefix}.bias", (d_out,), BIAS))
    return y


def conv1d(m: Blocks, x: Value, prefix: str, d_in: int, d_out: int) -> Value:
    """GPT-2 Conv1D: weight stored [in, out], so a plain MATMUL, then ADD bias."""
    w = m.param(f"{prefix}.weight", (d_in, d_out))
    return m.op(Op.ADD, m.op(Op.MATMUL, x, w), m.param(f"{prefix}.bias", (d_out,), BIAS))


def embedding(m: Blocks, table: Value, ids: Value) -> Value:
    """nn.Embedding: GATHER rows of the [V, D] table."""
    return m.op(Op.GATHER, table, ids, axis=0)


class Embedding:
    """A decoder's token embedding table [V, D], read by the lookup and (tied) by the LM head: the
    fp32 table (GATHER; MATMUL with its transpose), or, when the source keeps it packed (a GGUF
    file's token_embd), its packed form (QGATHER; QMATMUL), stored once for both readers."""

    def __init__(self, m: Blocks, name: str, shape: tuple[int, int]):
        self.m = m
        getter = getattr(m.weights, "get_packed", None)
        self.qw = getter(name, shape) if getter is not None else None
        if self.qw is None:
            self.table = m.param(name, shape)
        else:
            self.packed = [m.b.const(a, name=f"{name}.{r}") for r, a in zip(self.qw.roles, self.qw.arrays)]

    def lookup(self, ids: Value) -> Value:
        if self.qw is None:
            return embedding(self.m, self.table, ids)
        q = self.qw
        return self.m.op(Op.QGATHER, ids, *self.packed, format=q.format, n=q.n, k=q.k, group=q.group)

    def project(self, x: Value) -> Value:
        """x @ table^T (a tied LM head)."""
        if self.qw is None:
            return self.m.op(Op.MATMUL, x, self.m.op(Op.TRANSPOSE, self.table, perm=(1, 0)))
        q = self.qw
        return self.m.op(Op.QMATMUL, x, *self.packed, format=q.format, n=q.n, k=q.k, group=q.group)


def positions(m: Blocks, seq: int) -> Value:
    """Static position ids 0..S-1 as [1, S] (HF: arange(S).unsqueeze(0), no KV cache)."""
    return m.b.const(np.arange(seq, dtype=np.int64)[None, :], name="position_ids")


# ---- norms and activations -----------------------------------------------------------------


def layer_norm(m: Blocks, x: Value, prefix: str, dim: int, eps: float) -> Value:
    """nn.LayerNorm over the last axis: one LAYERNORM op (torch exports LayerNormalization at 17)."""
    w = m.param(f"{prefix}.weight", (dim,), NORM)
    b = m.param(f"{prefix}.bias", (dim,), BIAS)
    return m.op(Op.LAYERNORM, x, w, b, axis=len(x.shape) - 1, eps=float(eps))


def rms_norm(m: Blocks, x: Value, prefix: str, dim: int, eps: float, offset: float = 0.0) -> Value:
    """LlamaRMSNorm/Qwen3RMSNorm, decomposed as HF writes it:

    h = x.to(f32); var = h.pow(2).mean(-1, keepdim=True); h = h * rsqrt(var + eps);
    return weight * h.to(input_dtype)        (torch exports rsqrt as Div(1, Sqrt(.)))

    ``offset`` 1.0: GemmaRMSNorm's (1 + weight), an ADD the constant folding leaves as the weight.
    """
    w = m.param(f"{prefix}.weight", (dim,), NORM)
    if offset:
        w = m.op(Op.ADD, w, m.scalar(offset))
    in_dtype = x.dtype
    h = x if in_dtype == DType.F32 else m.op(Op.CAST, x, to=DType.F32)
    var = m.op(Op.REDUCE_MEAN, m.op(Op.POW, h, m.scalar(2.0)), axes=(len(x.shape) - 1,), keepdims=True)
    inv = m.op(Op.DIV, m.scalar(1.0), m.op(Op.SQRT, m.op(Op.ADD, var, m.scalar(eps))))
    h = m.op(Op.MUL, h, inv)
    if in_dtype != DType.F32:
        h = m.op(Op.CAST, h, to=in_dtype)
    return m.op(Op.MUL, w, h)


def gelu_tanh(m: Blocks, x: Value) -> Value:
    """HF NewGELUActivation ("gelu_new"):
    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3))))."""
    cube = m.op(Op.MUL, m.scalar(0.044715), m.op(Op.POW, x, m.scalar(3.0)))
    inner = m.op(Op.MUL, m.scalar(math.sqrt(2.0 / math.pi)), m.op(Op.ADD, x, cube))
    one_plus = m.op(Op.ADD, m.scalar(1.0), m.op(Op.TANH, inner))
    return m.op(Op.MUL, m.op(Op.MUL, m.scalar(0.5), x), one_plus)


def gelu_erf(m: Blocks, x: Value) -> Value:
    """nn.functional.gelu (exact), as torch decomposes it below opset 20:
    x * 0.5 * (1 + erf(x / sqrt(2)))  ->  Div, Erf, Add, Mul, Mul."""
    e = m.op(Op.ERF, m.op(Op.DIV, x, m.scalar(math.sqrt(2.0))))
    return m.op(Op.MUL, m.op(Op.MUL, x, m.op(Op.ADD, e, m.scalar(1.0))), m.scalar(0.5))


def silu(m: Blocks, x: Value) -> Value:
    """nn.SiLU as x * sigmoid(x)."""
    return m.op(Op.MUL, x, m.op(Op.SIGMOID, x))


def activation(m: Blocks, x: Value, name: str) -> Value:
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return gelu_tanh(m, x)
    if name == "gelu":
        return gelu_erf(m, x)
    if name == "silu":
        return silu(m, x)
    if name == "relu":
        return m.op(Op.RELU, x)
    raise ValueError(f"unsupported activation {name!r}")  # config_from_hf rejects these earlier


# ---- attention -----------------------------------------------------------------------------


def padding_mask(m: Blocks, mask: Value) -> Value:
    """HF's additive padding mask [B,1,1,S]: (1 - mask[:, None, None, :].float()) * finfo.min."""
    bsz, seq = mask.shape
    f = m.op(Op.RESHAPE, m.op(Op.CAST, mask, to=DType.F32), shape=(bsz, 1, 1, seq))
    return m.op(Op.MUL, m.op(Op.SUB, m.scalar(1.0), f), m.scalar(F32_MIN))


def causal_padding_mask(m: Blocks, mask: Value) -> Value:
    """Decoder mask [B,1,S,S]: the constant causal mask (0 on/below the diagonal, finfo.min above)
    combined with the padding mask. MIN, not ADD, combines them: it keeps masked entries at
    finfo.min (as HF's masked_fill does) instead of overflowing min + min to -inf."""
    seq = mask.shape[1]
    causal = np.triu(np.full((seq, seq), F32_MIN, np.float32), k=1)[None, None]
    return m.op(Op.MIN, m.b.const(causal, name="causal_mask"), padding_mask(m, mask))


def split_heads(m: Blocks, x: Value, heads: int, head_dim: int) -> Value:
    """x.view(B, S, heads, head_dim).transpose(1, 2) -> [B, heads, S, head_dim]."""
    return m.op(Op.TRANSPOSE, to_heads(m, x, heads, head_dim), perm=(0, 2, 1, 3))


def to_heads(m: Blocks, x: Value, heads: int, head_dim: int) -> Value:
    """x.view(B, S, heads, head_dim) (before the transpose, where Qwen3 applies q/k norm)."""
    bsz, seq = x.shape[:2]
    return m.op(Op.RESHAPE, x, shape=(bsz, seq, heads, head_dim))


def repeat_kv(m: Blocks, x: Value, n_rep: int) -> Value:
    """HF repeat_kv: x[:, :, None].expand(B, kv, n_rep, S, hd).reshape(B, kv * n_rep, S, hd)."""
    if n_rep == 1:
        return x
    bsz, kv, seq, hd = x.shape
    x = m.op(Op.RESHAPE, x, shape=(bsz, kv, 1, seq, hd))
    x = m.op(Op.EXPAND, x, shape=(bsz, kv, n_rep, seq, hd))
    return m.op(Op.RESHAPE, x, shape=(bsz, kv * n_rep, seq, hd))


def eager_attention(m: Blocks, q: Value, k: Value, v: Value, mask: Value, scale: float,
                    softcap: float = 0.0) -> Value:
    """HF eager_attention_forward on [B, H, S, hd] heads; returns [B, S, H * hd].

    scores = matmul(q, k.transpose(-1, -2)) * scale [soft-capped: tanh(s / cap) * cap] + mask;
    softmax(-1); matmul(., v); transpose(1, 2).reshape(B, S, H * hd). GQA k/v are repeated
    first, as repeat_kv does.
    """
    bsz, heads, seq, hd = q.shape
    n_rep = heads // k.shape[1]
    k = repeat_kv(m, k, n_rep)
    v = repeat_kv(m, v, n_rep)
    scores = m.op(Op.MATMUL, q, m.op(Op.TRANSPOSE, k, perm=(0, 1, 3, 2)))
    scores = m.op(Op.MUL, scores, m.scalar(scale))
    if softcap:
        cap = m.scalar(softcap)
        scores = m.op(Op.MUL, m.op(Op.TANH, m.op(Op.DIV, scores, cap)), cap)
    scores = m.op(Op.ADD, scores, mask)
    probs = m.op(Op.SOFTMAX, scores, axis=3)
    out = m.op(Op.TRANSPOSE, m.op(Op.MATMUL, probs, v), perm=(0, 2, 1, 3))
    return m.op(Op.RESHAPE, out, shape=(bsz, seq, heads * hd))


# ---- rotary position embedding -------------------------------------------------------------


def rotate_half(m: Blocks, x: Value) -> Value:
    """cat((-x[..., d/2:], x[..., :d/2]), -1) with SLICE, NEG, CONCAT."""
    ax = len(x.shape) - 1
    half = x.shape[ax] // 2
    x1 = m.op(Op.SLICE, x, axes=(ax,), starts=(0,), ends=(half,), steps=(1,))
    x2 = m.op(Op.SLICE, x, axes=(ax,), starts=(half,), ends=(x.shape[ax],), steps=(1,))
    return m.op(Op.CONCAT, m.op(Op.NEG, x2), x1, axis=ax)


def apply_rope(m: Blocks, x: Value, cos: Value, sin: Value) -> Value:
    """(x * cos) + (rotate_half(x) * sin); where cos/sin are narrower than x (partial rotary,
    Phi-3), on the first dims only: cat(rope(x[..., :rd]), x[..., rd:])."""
    ax, rd = len(x.shape) - 1, cos.shape[-1]
    if rd == x.shape[ax]:
        return m.op(Op.ADD, m.op(Op.MUL, x, cos), m.op(Op.MUL, rotate_half(m, x), sin))
    rot = m.op(Op.SLICE, x, axes=(ax,), starts=(0,), ends=(rd,), steps=(1,))
    rest = m.op(Op.SLICE, x, axes=(ax,), starts=(rd,), ends=(x.shape[ax],), steps=(1,))
    rot = m.op(Op.ADD, m.op(Op.MUL, rot, cos), m.op(Op.MUL, rotate_half(m, rot), sin))
    return m.op(Op.CONCAT, rot, rest, axis=ax)
