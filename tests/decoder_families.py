"""Tiny random checkpoints of every Llama-style decoder family fusec generates from, saved with
``save_pretrained`` (an HF directory) and written as a GGUF file the way llama.cpp's converter
writes that architecture (tensor names, q/k row order for ``llama``, Gemma's folded ``1 + w``,
Phi-3's fused tensors, the metadata keys).

``CASES[name]``: ``Case(family, gguf_arch, make_config)``; ``make_config()`` returns the
transformers config (vocab ``VOCAB``, hidden 32-64, 2-6 layers). ``checkpoint(name, root)`` saves
the HF directory (weights drawn with ``torch.manual_seed(SEED)``, every parameter random, norms
included) and returns (directory, model); ``write_gguf(name, model, path)`` writes the GGUF file of
the same weights (F32, so both sources hold identical numbers).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

SEED = 0
VOCAB = 320


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    gguf_arch: str
    make_config: Callable[[], Any]
    window: int = 0  # the sliding window the prompts must outgrow (0: none)
    gguf_by_transformers: bool = False  # transformers' own GGUF loader reads this architecture


def _dec(**kw: Any) -> dict[str, Any]:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    base.update(kw)
    return base


def _llama() -> Any:
    import transformers as T

    return T.LlamaConfig(**_dec(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 32}))


def _mistral() -> Any:
    import transformers as T

    return T.MistralConfig(**_dec(head_dim=16, sliding_window=7, rope_theta=10000.0))


def _qwen2() -> Any:
    import transformers as T

    return T.Qwen2Config(**_dec(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 32}))


def _qwen3() -> Any:
    import transformers as T

    return T.Qwen3Config(**_dec(head_dim=16, tie_word_embeddings=True,
                                rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}))


def _gemma() -> Any:
    import transformers as T

    return T.GemmaConfig(**_dec(head_dim=16, tie_word_embeddings=True, rope_theta=10000.0))


def _gemma2() -> Any:
    import transformers as T

    return T.Gemma2Config(**_dec(head_dim=16, tie_word_embeddings=True, sliding_window=6, query_pre_attn_scalar=16,
                                 attn_logit_softcapping=2.0, final_logit_softcapping=5.0, rope_theta=10000.0))


def _gemma3() -> Any:
    import transformers as T

    return T.Gemma3TextConfig(**_dec(hidden_size=32, intermediate_size=64, num_hidden_layers=6, head_dim=16,
                                     tie_word_embeddings=True, sliding_window=6, query_pre_attn_scalar=16,
                                     rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                         "rope_theta": 1e6},
                                                      "sliding_attention": {"rope_type": "default",
                                                                            "rope_theta": 10000.0}}))


def _phi3() -> Any:
    import transformers as T

    half = 4  # rotary dims 8 of head_dim 16: partial_rotary_factor 0.5
    return T.Phi3Config(**_dec(sliding_window=9, original_max_position_embeddings=32,
                               rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5,
                                                "short_factor": [1.0 + 0.5 * i for i in range(half)],
                                                "long_factor": [2.0 + i for i in range(half)]}))


CASES: dict[str, Case] = {
    "llama3": Case("llama", "llama", _llama, gguf_by_transformers=True),
    "mistral": Case("mistral", "llama", _mistral, window=7),
    "qwen2": Case("qwen2", "qwen2", _qwen2),
    "qwen3": Case("qwen3", "qwen3", _qwen3),
    "gemma": Case("gemma", "gemma", _gemma),
    "gemma2": Case("gemma2", "gemma2", _gemma2, window=6),
    "gemma3": Case("gemma3", "gemma3", _gemma3, window=6),
    "phi3": Case("phi3", "phi3", _phi3, window=9),
}


def checkpoint(name: str, root: Path) -> tuple[Path, Any]:
    """Save case ``name`` with random weights under ``root/name``; (directory, torch model)."""
    import torch
    import transformers as T

    cfg = CASES[name].make_config()
    torch.manual_seed(SEED)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for p in model.parameters():  # norms and biases too: every option must show in the tokens
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else 1.0 / math.sqrt(p.shape[-1])))
    out = root / name
    model.save_pretrained(out)
    return out, model


# ---- GGUF, as llama.cpp's convert_hf_to_gguf.py writes each architecture -----------------------------

def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture (RoPE pairs made adjacent)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(name: str, model: Any) -> dict[str, np.ndarray]:
    """The GGUF tensors (by GGUF name, row-major HF shape) of case ``name``'s model."""
    import gguf

    case, cfg = CASES[name], model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    # llama.cpp's own HF -> GGUF tensor name map (gguf-py), independent of fusec's tables
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[case.gguf_arch.upper()], cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    gemma = case.gguf_arch.startswith("gemma")
    for key, arr in sd.items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        g = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert g is not None, key
        if case.gguf_arch == "llama" and (".q_proj." in key or ".k_proj." in key):
            arr = _permute(arr, cfg.num_attention_heads if ".q_proj." in key else cfg.num_key_value_heads)
        if gemma and g.endswith("norm.weight"):
            arr = arr + np.float32(1.0)  # the converter folds Gemma's (1 + w) into the stored weight
        out[g] = np.ascontiguousarray(arr, dtype=np.float32)
    rp = getattr(cfg, "rope_parameters", None) or {}
    if case.family == "llama" and rp.get("rope_type") == "llama3":  # llama.cpp stores Llama 3.1's scaling so
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        base = 1.0 / (rp["rope_theta"] ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
        scaled = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")[0].double().numpy()
        out["rope_freqs.weight"] = (base / scaled).astype(np.float32)
    if rp.get("rope_type") == "longrope":
        out["rope_factors_long.weight"] = np.asarray(rp["long_factor"], np.float32)
        out["rope_factors_short.weight"] = np.asarray(rp["short_factor"], np.float32)
    return out


def gguf_metadata(name: str, model: Any) -> dict[str, tuple[Any, str]]:
    """{key: (value, GGUF value type name)} of case ``name``, as the converter writes them."""
    case, cfg = CASES[name], model.config
    a = case.gguf_arch
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rp = getattr(cfg, "rope_parameters", None) or {}
    md: dict[str, tuple[Any, str]] = {
        f"{a}.context_length": (cfg.max_position_embeddings, "UINT32"),
        f"{a}.embedding_length": (cfg.hidden_size, "UINT32"),
        f"{a}.block_count": (cfg.num_hidden_layers, "UINT32"),
        f"{a}.feed_forward_length": (cfg.intermediate_size, "UINT32"),
        f"{a}.attention.head_count": (cfg.num_attention_heads, "UINT32"),
        f"{a}.attention.head_count_kv": (cfg.num_key_value_heads, "UINT32"),
        f"{a}.attention.layer_norm_rms_epsilon": (cfg.rms_norm_eps, "FLOAT32"),
    }
    if a == "gemma3":
        glob = rp["full_attention"]
        md[f"{a}.rope.freq_base"] = (glob["rope_theta"], "FLOAT32")
        if glob.get("rope_type") == "linear":
            md[f"{a}.rope.scaling.type"] = ("linear", "STRING")
            md[f"{a}.rope.scaling.factor"] = (glob["factor"], "FLOAT32")
    elif a != "gemma2":  # llama.cpp's Gemma 2 converter writes no RoPE base (10000)
        md[f"{a}.rope.freq_base"] = (rp.get("rope_theta", 10000.0), "FLOAT32")
    if a.startswith("gemma") or head_dim != cfg.hidden_size // cfg.num_attention_heads:
        md[f"{a}.attention.key_length"] = (head_dim, "UINT32")
        md[f"{a}.attention.value_length"] = (head_dim, "UINT32")
    if a == "phi3":
        rot = int(rp.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
        md[f"{a}.rope.dimension_count"] = (rot, "UINT32")
        md[f"{a}.rope.scaling.original_context_length"] = (cfg.original_max_position_embeddings, "UINT32")
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        md[f"{a}.rope.scaling.attn_factor"] = (math.sqrt(1 + math.log(scale) / math.log(
            cfg.original_max_position_embeddings)), "FLOAT32")
    elif a == "llama":
        md[f"{a}.rope.dimension_count"] = (head_dim, "UINT32")
    if rp.get("rope_type") in ("yarn", "linear") and a not in ("gemma3",):
        md[f"{a}.rope.scaling.type"] = (rp["rope_type"], "STRING")
        md[f"{a}.rope.scaling.factor"] = (rp["factor"], "FLOAT32")
        if rp["rope_type"] == "yarn":
            md[f"{a}.rope.scaling.original_context_length"] = (rp["original_max_position_embeddings"], "UINT32")
    if getattr(cfg, "sliding_window", None):
        md[f"{a}.attention.sliding_window"] = (cfg.sliding_window, "UINT32")
    if a == "gemma2":
        md[f"{a}.attn_logit_softcapping"] = (cfg.attn_logit_softcapping, "FLOAT32")
        md[f"{a}.final_logit_softcapping"] = (cfg.final_logit_softcapping, "FLOAT32")
    return md


def write_gguf(name: str, model: Any, path: Path, tokenizer_md: dict[str, tuple[Any, str]] | None = None,
               edit: Callable[[dict[str, Any], dict[str, np.ndarray]], None] | None = None) -> Path:
    """Write case ``name``'s model as a GGUF file (F32 tensors) with ``tokenizer_md`` (or a tiny
    byte-level BPE vocabulary of VOCAB tokens); ``edit(metadata, tensors)`` may change both first."""
    import gguf

    V = gguf.GGUFValueType
    w = gguf.GGUFWriter(os.fspath(path), CASES[name].gguf_arch)
    md = {**gguf_metadata(name, model), **(tokenizer_md or tiny_vocab())}
    tensors = gguf_tensors(name, model)
    if edit is not None:
        edit(md, tensors)
    for key, (value, vtype) in md.items():
        t = V[vtype]
        if t == V.ARRAY:
            sub = V.STRING if isinstance(value[0], str) else V.FLOAT32 if isinstance(value[0], float) else V.INT32
            w.add_key_value(key, value, t, sub)
        else:
            w.add_key_value(key, value, t)
    for tname, arr in tensors.items():
        w.add_tensor(tname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_vocab() -> dict[str, tuple[Any, str]]:
    """A GPT-2-style vocabulary of VOCAB tokens: 3 control tokens, the 256 byte symbols, and
    merges of letter pairs for the rest."""
    from fusec.text import _byte_alphabet

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pairs = [(x, y) for x in letters for y in letters][: VOCAB - 3 - 256]
    tokens = ["<|pad|>", "<|bos|>", "<|eos|>"] + list(_byte_alphabet().values()) + [x + y for x, y in pairs]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return {"tokenizer.ggml.model": ("gpt2", "STRING"), "tokenizer.ggml.pre": ("default", "STRING"),
            "tokenizer.ggml.tokens": (tokens, "ARRAY"), "tokenizer.ggml.merges": ([f"{x} {y}" for x, y in pairs], "ARRAY"),
            "tokenizer.ggml.token_type": (types, "ARRAY"), "tokenizer.ggml.bos_token_id": (1, "UINT32"),
            "tokenizer.ggml.eos_token_id": (2, "UINT32")}
