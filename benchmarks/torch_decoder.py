"""A gpt-fast-style plain-PyTorch Qwen3 decoder: the compiled decode peer of benchmarks/decode.py.

The model is written out in a few modules, the way gpt-fast writes Llama
(https://github.com/pytorch-labs/gpt-fast, model.py / generate.py), for the Qwen3 architecture
as ``transformers`` computes it (modeling_qwen3.py):

* one fused ``wqkv`` projection (the q, k and v weights concatenated), then RMSNorm over the
  head dim of q and k (Qwen3's q_norm / k_norm), then RoPE in the rotate-half form with cos/sin
  tables computed in fp32 and cast to the model dtype (as HF does);
* a static, preallocated KV cache per layer, ``[B, Hkv, T, D]`` buffers written in place at
  ``input_pos`` (``k_cache[:, :, input_pos] = k``);
* RMSNorm computed in fp32 and cast back before the weight multiply (as HF does); SwiGLU MLP
  ``w2(silu(w1(x)) * w3(x))``; tied LM head (the embedding table) when the config ties them.

Attention:

* ``prefill`` (a prompt written from position 0): SDPA with ``is_causal=True`` over the prompt's
  own keys (flash attention; no [S, T] mask, no read of the empty rest of the cache); logits of
  the last position only (``transformers.generate`` does the same with ``logits_to_keep=1``).
* ``forward`` (decode steps, or a chunk written at any position): grouped-query attention over
  the whole static cache with the mask ``key position <= query position``, each KV head read
  once for its group of query heads (two batched matmuls and an fp32 softmax, HF's eager
  order of operations) instead of gpt-fast's ``repeat_interleave`` of the whole cache.

``decode_one_token`` (greedy: argmax of the last logits) is what benchmarks/decode.py compiles
with ``torch.compile(mode="reduce-overhead", fullgraph=True)``; ``prefill_tokens`` is the prefill.

``qk_norm=False`` gives the Llama block (no q/k norm). ``quantize_int4`` turns every linear layer into gpt-fast's
weight-only int4 form: round-to-nearest codes 0..15 per group of K with a bf16 scale and a zero point (min + 8
scales) per group, packed for ``torch.ops.aten._weight_int4pack_mm`` (the tinygemm kernel), the int4 peer of
benchmarks/int4_7b.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    dim: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qk_norm: bool = True  # Qwen3's RMSNorm over the head dim of q and k; Llama has none

    @classmethod
    def from_hf(cls, cfg: Any) -> DecoderConfig:
        """From a transformers Qwen3Config (4.x keeps rope_theta at the top, 5.x in rope_parameters)."""
        params = getattr(cfg, "rope_parameters", None) or {}
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
        if theta is None:
            raise ValueError("the config names no rope_theta")
        scaling = getattr(cfg, "rope_scaling", None) or {}  # 5.x: an alias of rope_parameters
        rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ValueError(f"only the default RoPE is implemented, not {rope_type!r}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(vocab_size=cfg.vocab_size, dim=cfg.hidden_size, n_layer=cfg.num_hidden_layers,
                   n_head=cfg.num_attention_heads, n_kv_head=cfg.num_key_value_heads or cfg.num_attention_heads,
                   head_dim=head_dim, intermediate_size=cfg.intermediate_size, norm_eps=cfg.rms_norm_eps,
                   rope_theta=float(theta), tie_word_embeddings=bool(cfg.tie_word_embeddings))

    def num_params(self) -> int:
        """Parameters stored once (the tied LM head is the embedding table)."""
        d, hd, h, kv, ff = self.dim, self.head_dim, self.n_head, self.n_kv_head, self.intermediate_size
        layer = d * (h + 2 * kv) * hd + h * hd * d + 3 * d * ff + 2 * d + (2 * hd if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.n_layer * layer + self.vocab_size * d + d + head


class KVCache(nn.Module):
    def __init__(self, batch: int, n_kv_head: int, max_seq_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        shape = (batch, n_kv_head, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # input_pos [S], k/v [B, Hkv, S, D]
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k
        v_out[:, :, input_pos] = v
        return k_out, v_out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + rotate_half(x) * sin  # x [B, H, S, D], cos/sin [S, D] (model dtype)


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.c = c
        self.wqkv = nn.Linear(c.dim, (c.n_head + 2 * c.n_kv_head) * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_head * c.head_dim, c.dim, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else nn.Identity()
        self.kv_cache: KVCache | None = None
        self.scale = c.head_dim ** -0.5

    def _qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c = self.c
        b, s, _ = x.shape
        q, k, v = self.wqkv(x).split([c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.n_kv_head * c.head_dim], -1)
        q = self.q_norm(q.view(b, s, c.n_head, c.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(b, s, c.n_kv_head, c.head_dim)).transpose(1, 2)
        v = v.view(b, s, c.n_kv_head, c.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        """Any chunk at any position: attends over the whole cache with ``mask`` [S, T] (bool)."""
        c = self.c
        b, s, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        assert self.kv_cache is not None, "call setup_caches first"
        kc, vc = self.kv_cache.update(input_pos, k, v)
        g, t = c.n_head // c.n_kv_head, kc.shape[2]
        # query head h = hk * g + i uses kv head hk (HF's repeat_kv order); read each kv head once
        qg = q.reshape(b, c.n_kv_head, g * s, c.head_dim)
        scores = torch.matmul(qg, kc.transpose(2, 3)) * self.scale  # [B, Hkv, G*S, T]
        scores = scores.view(b, c.n_kv_head, g, s, t).masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(b, c.n_kv_head, g * s, t)
        y = torch.matmul(p, vc).view(b, c.n_head, s, c.head_dim)
        return self.wo(y.transpose(1, 2).reshape(b, s, c.n_head * c.head_dim))

    def prefill(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor) -> Tensor:
        """A prompt written from position 0: causal attention over its own keys (flash)."""
        c = self.c
        b, s, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        assert self.kv_cache is not None, "call setup_caches first"
        self.kv_cache.update(input_pos, k, v)
        g = c.n_head // c.n_kv_head
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1),
                                           is_causal=True, scale=self.scale)
        return self.wo(y.transpose(1, 2).reshape(b, s, c.n_head * c.head_dim))


class FeedForward(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.intermediate_size, bias=False)  # gate_proj
        self.w3 = nn.Linear(c.dim, c.intermediate_size, bias=False)  # up_proj
        self.w2 = nn.Linear(c.intermediate_size, c.dim, bias=False)  # down_proj

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.attention = Attention(c)
        self.feed_forward = FeedForward(c)
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))

    def prefill(self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor) -> Tensor:
        h = x + self.attention.prefill(self.attention_norm(x), cos, sin, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)
        self.max_batch = -1
        self.max_seq_len = -1

    def setup_caches(self, batch: int, max_seq_len: int) -> None:
        """Preallocate every layer's [B, Hkv, T, D] cache and the RoPE tables for T positions."""
        c = self.config
        w = self.tok_embeddings.weight  # (the LM head's may be packed int4 codes)
        dtype, device = w.dtype, w.device
        for blk in self.layers:
            blk.attention.kv_cache = KVCache(batch, c.n_kv_head, max_seq_len, c.head_dim, dtype, device)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64, device=device).float()
                                           / c.head_dim))
        freqs = torch.arange(max_seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", emb.sin().to(dtype), persistent=False)
        self.register_buffer("key_positions", torch.arange(max_seq_len, device=device), persistent=False)
        self.max_batch, self.max_seq_len = batch, max_seq_len

    def forward(self, idx: Tensor, input_pos: Tensor) -> Tensor:
        """idx [B, S] written at positions input_pos [S] (consecutive); logits [B, S, V]."""
        x = self.tok_embeddings(idx)
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        mask = self.key_positions[None, :] <= input_pos[:, None]  # [S, T]
        for blk in self.layers:
            x = blk(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x))

    def prefill(self, idx: Tensor, input_pos: Tensor) -> Tensor:
        """A prompt from position 0 (input_pos = arange(S)); logits of the last position [B, 1, V]."""
        x = self.tok_embeddings(idx)
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        for blk in self.layers:
            x = blk.prefill(x, cos, sin, input_pos)
        return self.output(self.norm(x[:, -1:]))


def decode_one_token(model: Transformer, x: Tensor, input_pos: Tensor) -> Tensor:
    """One greedy decode step: x [B, 1] at input_pos [1] -> next token [B, 1] (int64)."""
    logits = model(x, input_pos)
    return torch.argmax(logits[:, -1], dim=-1, keepdim=True)


def prefill_tokens(model: Transformer, x: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor]:
    """The prompt x [B, S] from position 0 -> (first new token [B, 1], last logits [B, V])."""
    logits = model.prefill(x, input_pos)[:, -1]
    return torch.argmax(logits, dim=-1, keepdim=True), logits


def hf_state_dict_to_decoder(sd: dict[str, Tensor], c: DecoderConfig) -> dict[str, Tensor]:
    """Rename (and fuse q/k/v of) a Qwen3ForCausalLM state_dict for ``Transformer``."""
    def get(name: str) -> Tensor:
        for key in (f"model.{name}", name):
            if key in sd:
                return sd[key]
        raise KeyError(f"the state_dict has no {name!r}")

    out = {"tok_embeddings.weight": get("embed_tokens.weight"), "norm.weight": get("norm.weight")}
    for i in range(c.n_layer):
        p = q = f"layers.{i}."
        out[q + "attention.wqkv.weight"] = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
        out[q + "attention.wo.weight"] = get(p + "self_attn.o_proj.weight")
        out[q + "attention.q_norm.weight"] = get(p + "self_attn.q_norm.weight")
        out[q + "attention.k_norm.weight"] = get(p + "self_attn.k_norm.weight")
        out[q + "feed_forward.w1.weight"] = get(p + "mlp.gate_proj.weight")
        out[q + "feed_forward.w3.weight"] = get(p + "mlp.up_proj.weight")
        out[q + "feed_forward.w2.weight"] = get(p + "mlp.down_proj.weight")
        out[q + "attention_norm.weight"] = get(p + "input_layernorm.weight")
        out[q + "ffn_norm.weight"] = get(p + "post_attention_layernorm.weight")
    out["output.weight"] = out["tok_embeddings.weight"] if c.tie_word_embeddings else sd["lm_head.weight"]
    return out


def from_hf(hf_model: Any, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Transformer:
    """A ``Transformer`` with copies of a Qwen3ForCausalLM's weights (cast to dtype, on device)."""
    c = DecoderConfig.from_hf(hf_model.config)
    ref = next(hf_model.parameters())
    dtype = dtype or ref.dtype
    device = device or ref.device
    sd = {k: v.detach().to(device=device, dtype=dtype).clone()
          for k, v in hf_state_dict_to_decoder(hf_model.state_dict(), c).items()}
    if c.tie_word_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    with torch.device("meta"):
        model = Transformer(c)
    model.load_state_dict(sd, assign=True, strict=True)
    if c.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval().requires_grad_(False)


def weight_bytes_per_step(c: DecoderConfig, batch: int, itemsize: int = 2) -> int:
    """Weight bytes one decode step must read: every parameter once; with tied embeddings the LM
    head reads the table once; the embedding lookup reads only ``batch`` rows of it."""
    return itemsize * (c.num_params() + batch * c.dim)


def kv_bytes_per_step(c: DecoderConfig, batch: int, keys: float, itemsize: int = 2) -> float:
    """KV-cache bytes one decode step must read when it attends over ``keys`` positions."""
    return itemsize * c.n_layer * 2 * batch * c.n_kv_head * c.head_dim * keys


class Int4Linear(nn.Module):
    """A bias-free linear layer over group-wise int4 weights in the layout of ``aten._weight_int4pack_mm``."""

    def __init__(self, weight: Tensor, group: int = 128, inner_k_tiles: int = 8):
        super().__init__()
        n, k = weight.shape
        if k % group or k % (inner_k_tiles * 16):
            raise ValueError(f"int4: K = {k} must be a multiple of the group {group} and of {inner_k_tiles * 16}")
        w = weight.float().reshape(n, k // group, group)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-6)
        codes = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        zero = lo + 8 * scale  # the kernel computes (code - 8) * scale + zero
        packed = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles))
        sz = torch.cat([scale, zero], -1).to(torch.bfloat16)  # [N, K / group, 2]
        self.register_buffer("scales_and_zeros", sz.transpose(0, 1).contiguous())  # [K / group, N, 2]
        self.group, self.n = group, n

    def forward(self, x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, x.shape[-1]), self.weight, self.group,
                                               self.scales_and_zeros)
        return y.reshape(*x.shape[:-1], self.n)


def quantize_int4(model: nn.Module, group: int = 128) -> nn.Module:
    """Every ``nn.Linear`` of ``model`` (on a CUDA device, bf16) replaced by an ``Int4Linear`` of its weight; in place."""
    for name, mod in list(model.named_children()):
        if isinstance(mod, nn.Linear):
            setattr(model, name, Int4Linear(mod.weight.detach(), group))
        else:
            quantize_int4(mod, group)
    return model


def int4_weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads of an ``quantize_int4`` model's linear layers (packed codes, scales and zeros)."""
    return sum(m.weight.numel() * m.weight.element_size() + m.scales_and_zeros.numel() * 2
               for m in model.modules() if isinstance(m, Int4Linear))


__all__ = ["DecoderConfig", "Transformer", "decode_one_token", "prefill_tokens", "from_hf",
           "weight_bytes_per_step", "kv_bytes_per_step", "Int4Linear", "quantize_int4", "int4_weight_bytes"]
