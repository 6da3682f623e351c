"""The Llama-style decoder families fusec generates from, as data: what each architecture is
(traits no file states, because the architecture implies them), which names its files use, and
which architectures are refused.

Both loaders read this table: ``models/hf_config.py`` (config.json's ``model_type``) and
``models/gguf_arch.py`` (GGUF's ``general.architecture``). Everything a file does state (sizes,
windows, soft-caps, RoPE) is read from the file by one key table per format; the family supplies
only the defaults HF's config class would use for a missing key and the traits below.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fusec.errors import ModelError


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # fusec's family (ModelConfig.family)
    hf_types: tuple[str, ...]  # config.json model_type values
    gguf_arch: str | None  # GGUF general.architecture (Mistral ships as "llama")
    # traits of the architecture
    norm_offset: float = 0.0  # Gemma RMSNorm: (1 + w); GGUF files store the 1 folded in
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and after the MLP
    qkv_bias: bool = False  # Qwen2: q/k/v biases always
    qk_norm: bool = False  # Qwen3, Gemma 3
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj
    # HF config class defaults for keys a config.json may leave out
    activation: str = "silu"
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    tie: bool = False
    query_pre_attn_scalar: float = 0.0  # Gemma 2/3 (0: the attention scale is head_dim ** -0.5)
    rope_theta: float = 10000.0
    rope_local_theta: float = 0.0  # Gemma 3's windowed layers
    # which layers have the sliding window, when the file does not list them: "all", "none",
    # "qwen" (use_sliding_window and layer >= max_window_layers), or N: all but every N-th layer
    window_layers: str | int = "none"
    activation_aliases: tuple[tuple[str, str], ...] = ()  # legacy config values HF rewrites
    # GGUF: the layer counts of the 27B models, whose attention scale llama.cpp takes as
    # (hidden_size / heads) ** -0.5 (the file has no key for it)
    gguf_scale_by_width: tuple[int, ...] = ()

    def sliding(self, layers: int, hf: dict[str, Any] | None = None) -> tuple[bool, ...]:
        """Per layer, windowed or not, by the family's rule (``hf``: config.json, for "qwen");
        () for every layer. The caller has checked ``layers`` against the file."""
        rule = self.window_layers
        if rule == "all":
            return ()  # ModelConfig: every layer
        if rule == "qwen":
            hf = hf or {}
            if hf.get("use_sliding_window") is not True:
                return (False,) * layers
            start = hf.get("max_window_layers", 28)
            if isinstance(start, bool) or not isinstance(start, int):
                raise ModelError(f"max_window_layers is {start!r:.60}, not an integer")
            return tuple(i >= start for i in range(layers))
        if isinstance(rule, int):
            return tuple(bool((i + 1) % rule) for i in range(layers))
        return (False,) * layers


_GEMMA = dict(norm_offset=1.0, embed_scale=True, activation="gelu_pytorch_tanh", head_dim=256, tie=True)
FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("llama", ("llama",), "llama", window_layers="all"),
    Family("mistral", ("mistral",), None, window_layers="all"),
    Family("qwen2", ("qwen2",), "qwen2", qkv_bias=True, window_layers="qwen", rope_theta=1e6),
    Family("qwen3", ("qwen3",), "qwen3", qk_norm=True, head_dim=128, window_layers="qwen", rope_theta=1e6),
    Family("gemma", ("gemma",), "gemma", activation_aliases=(("gelu", "gelu_pytorch_tanh"),), **_GEMMA),
    Family("gemma2", ("gemma2",), "gemma2", sandwich_norms=True, query_pre_attn_scalar=256, window_layers=2,
           gguf_scale_by_width=(46,), **_GEMMA),
    Family("gemma3", ("gemma3_text",), "gemma3", sandwich_norms=True, qk_norm=True, query_pre_attn_scalar=256,
           window_layers=6, rope_theta=1e6, rope_local_theta=10000.0, gguf_scale_by_width=(62,), **_GEMMA),
    Family("phi3", ("phi3",), "phi3", fused_projections=True, window_layers="all"),
]}
BY_HF_TYPE = {t: f for f in FAMILIES.values() for t in f.hf_types}
BY_GGUF_ARCH = {f.gguf_arch: f for f in FAMILIES.values() if f.gguf_arch}

# Refused in one line, naming the architecture: mixture-of-experts decoders (HF model_type and
# GGUF architecture names) and multimodal checkpoints (the text model alone of a Gemma 3 4B+
# ships as a GGUF file, which fusec reads).
MOE = frozenset({"qwen2_moe", "qwen3_moe", "qwen3_next", "mixtral", "llama4", "llama4_text", "deepseek_v2",
                 "deepseek_v3", "dbrx", "olmoe", "jamba", "granitemoe", "phimoe", "gpt_oss", "minimax",
                 "minimax_m2", "qwen2moe", "qwen3moe", "qwen3nextmoe", "deepseek2", "grok", "arctic",
                 "bailingmoe", "ernie4_5_moe", "ernie4_5-moe", "glm4moe", "glm4_moe", "hunyuan-moe", "hunyuan_v1_moe"})
MULTIMODAL = frozenset({"gemma3", "gemma3n", "llava", "llava_next", "mllama", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
                        "paligemma", "idefics3", "smolvlm", "mistral3", "pixtral", "phi4_multimodal",
                        "phi3_v", "qwen2_audio", "qwen2_5_omni", "llama4"})


def refusal(arch: Any, *, gguf: bool, experts: int = 0) -> str | None:
    """Why ``arch`` (a model_type or GGUF architecture) cannot generate, or None if it can.
    ``experts`` > 0: the file declares that many experts (Mixtral ships as GGUF "llama")."""
    known = ", ".join(sorted(BY_GGUF_ARCH if gguf else BY_HF_TYPE))
    shown = f"{arch!r:.60}"
    if experts or arch in MOE:
        return f"{shown} is a mixture-of-experts model, which fusec does not run (supported: {known})"
    if not gguf and arch in MULTIMODAL:
        return (f"{shown} is a multimodal model; fusec runs text decoders only (supported: {known}; "
                "a Gemma 3 text model is model_type 'gemma3_text')")
    if arch not in (BY_GGUF_ARCH if gguf else BY_HF_TYPE):
        return f"architecture {shown} is not supported (supported: {known})"
    return None
