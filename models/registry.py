"""The built-in model registry: named configs, input-shape checking and ``build``.

Every built-in model takes ``input_ids: i64[B,S]`` and ``attention_mask: i64[B,S]`` (1 = token,
0 = padding). Decoders (gpt2, llama, qwen3) return ``logits: f32[B,S,V]``; encoders (bert) return
``last_hidden_state: f32[B,S,D]``. Shapes are static: a graph is built for one (B, S).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence

from fusec.errors import InputError, ModelError
from fusec.ir import Graph

from .rope import RopeScaling

INPUT_NAMES = ("input_ids", "attention_mask")
# Llama-style decoders: one builder (models/llama.py) whose options (the fields below) cover them all
LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3")
DECODER_FAMILIES = ("gpt2",) + LLAMA_STYLE
FAMILIES = DECODER_FAMILIES + ("bert",)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Dimensions of one transformer; field names are fusec's, HF config keys map onto them."""

    name: str
    family: str  # "gpt2" | "bert" | one of LLAMA_STYLE: selects the builder and the HF name map
    description: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    norm_eps: float
    activation: str  # HF ACT2FN name: "gelu_new" (tanh form), "gelu" (erf form), "silu", "relu"
    num_kv_heads: int = 0  # 0: same as num_heads (no GQA)
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_theta: float = 0.0  # Llama-style decoders only
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v/o biases (Llama's attention_bias)
    mlp_bias: bool = False  # llama gate/up/down biases
    qk_norm: bool = False  # qwen3, gemma3: RMSNorm over head_dim on q and k, before RoPE
    type_vocab_size: int = 0  # bert token types (type 0 is folded in as a constant)
    default_batch: int = 1
    default_seq: int = 16
    # ---- options of the Llama-style decoder layer (defaults: Llama) ----
    qkv_bias: bool = False  # qwen2: biases on q/k/v only (attention_bias puts them on o too)
    sliding_window: int = 0  # keys a windowed layer's query sees, itself included (0: no window)
    sliding_layers: tuple[bool, ...] = ()  # per layer: windowed? () = every layer when sliding_window
    attn_softcap: float = 0.0  # gemma2: scores = cap * tanh(scores / cap) (0: none)
    final_softcap: float = 0.0  # gemma2: logits = cap * tanh(logits / cap) (0: none)
    query_scale: float = 0.0  # attention scale (0: head_dim ** -0.5; gemma2/3: query_pre_attn_scalar ** -0.5)
    embed_scale: float = 1.0  # gemma: embeddings times sqrt(hidden_size)
    norm_offset: float = 0.0  # gemma: RMSNorm scales by (offset + w)
    sandwich_norms: bool = False  # gemma2/3: norms after attention and MLP too (4 per layer)
    rope_local_theta: float = 0.0  # gemma3: windowed layers' RoPE base, unscaled (0: as the others)
    rope_scaling: RopeScaling | None = None  # models/rope.py (windowed layers too unless rope_local_theta)
    rotary_dim: int = 0  # 0: head_dim; phi3's partial_rotary_factor rotates fewer dims
    fused_projections: bool = False  # phi3: q/k/v in one qkv_proj, gate/up in one gate_up_proj tensor

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ModelError(f"model {self.name!r}: unknown family {self.family!r}")
        # sizes first: a 0 or negative count would divide by zero below, or pass the products
        # checked below ((-4) * (-16) == 64), and 64.0 or "64" would fail far from here
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "max_positions",
                      "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            least = 0 if field in ("num_kv_heads", "head_dim") else 1  # 0: derived below
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise ModelError(f"model {self.name!r}: {field} is {value!r:.40}, not an integer >= {least}")
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim == 0:
            raise ModelError(f"model {self.name!r}: hidden size {self.hidden_size} is smaller than its "
                             f"{self.num_heads} heads (no head_dim)")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"model {self.name!r}: {self.num_heads} heads is not a multiple of "
                             f"{self.num_kv_heads} key/value heads")
        if self.family in ("gpt2", "bert") and self.head_dim * self.num_heads != self.hidden_size:
            raise ModelError(f"model {self.name!r}: hidden size {self.hidden_size} is not divisible "
                             f"by {self.num_heads} heads")
        self._check_decoder_options()

    def _check_decoder_options(self) -> None:
        for field in ("sliding_window", "rotary_dim"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ModelError(f"model {self.name!r}: {field} is {v!r:.40}, not an integer >= 0")
        for field in ("attn_softcap", "final_softcap", "query_scale", "norm_offset", "rope_local_theta"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
                raise ModelError(f"model {self.name!r}: {field} is {v!r:.40}, not a finite number >= 0")
        if not (isinstance(self.embed_scale, numbers.Real) and math.isfinite(self.embed_scale) and self.embed_scale > 0):
            raise ModelError(f"model {self.name!r}: embed_scale is {self.embed_scale!r:.40}, not a finite number > 0")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ModelError(f"model {self.name!r}: {len(self.sliding_layers)} layer types for {self.num_layers} layers")
        if self.rope_dims > self.head_dim or self.rope_dims % 2:
            raise ModelError(f"model {self.name!r}: rotary dims {self.rope_dims} must be even and at most "
                             f"head_dim {self.head_dim}")
        if self.rope_scaling is not None:
            self.rope_scaling.check(self.rope_dims)

    @property
    def rope_dims(self) -> int:
        """The dims RoPE rotates: ``rotary_dim``, or all of head_dim when it is 0."""
        return self.rotary_dim or self.head_dim

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (keys a query sees, itself included), 0 for full attention."""
        if not self.sliding_window or (self.sliding_layers and not self.sliding_layers[layer]):
            return 0
        return self.sliding_window

    def rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(RoPE base, scaling) of layer ``layer``: windowed layers have their own base where
        ``rope_local_theta`` is set (Gemma 3), unscaled."""
        if self.rope_local_theta and self.window(layer):
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @property
    def attention_scale(self) -> float:
        return self.query_scale or self.head_dim ** -0.5

    @property
    def is_decoder(self) -> bool:
        return self.family in DECODER_FAMILIES

    @property
    def output_name(self) -> str:
        return "logits" if self.is_decoder else "last_hidden_state"

    @property
    def default_shapes(self) -> dict[str, tuple[int, int]]:
        return {n: (self.default_batch, self.default_seq) for n in INPUT_NAMES}


_C = ModelConfig
_CONFIGS: dict[str, ModelConfig] = {c.name: c for c in [
    _C("gpt2-tiny", "gpt2", "tiny GPT-2 (2 layers, d=64) for tests", vocab_size=1000, hidden_size=64,
       num_layers=2, num_heads=4, intermediate_size=256, max_positions=128, norm_eps=1e-5,
       activation="gelu_new", tie_word_embeddings=True),
    _C("gpt2-small", "gpt2", "GPT-2 124M (HF gpt2 shape)", vocab_size=50257, hidden_size=768,
       num_layers=12, num_heads=12, intermediate_size=3072, max_positions=1024, norm_eps=1e-5,
       activation="gelu_new", tie_word_embeddings=True, default_batch=8, default_seq=128),
    _C("bert-tiny", "bert", "tiny BERT encoder (2 layers, d=128)", vocab_size=30522, hidden_size=128,
       num_layers=2, num_heads=2, intermediate_size=512, max_positions=512, norm_eps=1e-12,
       activation="gelu", type_vocab_size=2),
    _C("minilm", "bert", "all-MiniLM-L6-v2 shape (6 layers, d=384)", vocab_size=30522, hidden_size=384,
       num_layers=6, num_heads=12, intermediate_size=1536, max_positions=512, norm_eps=1e-12,
       activation="gelu", type_vocab_size=2, default_batch=32, default_seq=128),
    _C("bert-base", "bert", "BERT-base encoder (12 layers, d=768)", vocab_size=30522, hidden_size=768,
       num_layers=12, num_heads=12, intermediate_size=3072, max_positions=512, norm_eps=1e-12,
       activation="gelu", type_vocab_size=2, default_batch=32, default_seq=128),
    _C("llama-tiny", "llama", "tiny Llama (2 layers, d=64, GQA 4q/2kv)", vocab_size=1000, hidden_size=64,
       num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_positions=128,
       norm_eps=1e-5, activation="silu", rope_theta=10000.0),
    _C("qwen3-tiny", "qwen3", "tiny Qwen3 (2 layers, d=64, head_dim 32, q/k norm)", vocab_size=1000,
       hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=128,
       max_positions=128, norm_eps=1e-6, activation="silu", rope_theta=1e6, tie_word_embeddings=True,
       qk_norm=True),
    _C("qwen3-0.6b", "qwen3", "Qwen3-0.6B shape (28 layers, d=1024, 16q/8kv heads)", vocab_size=151936,
       hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
       intermediate_size=3072, max_positions=40960, norm_eps=1e-6, activation="silu", rope_theta=1e6,
       tie_word_embeddings=True, qk_norm=True, default_batch=1, default_seq=128),
]}
del _C


def names() -> list[str]:
    """The built-in model names, in a stable order."""
    return list(_CONFIGS)


def get_config(name: str) -> ModelConfig:
    """The config of a built-in model; ModelError (listing the known names) if there is none."""
    cfg = _CONFIGS.get(name) if isinstance(name, str) else None
    if cfg is None:
        raise ModelError(f"unknown built-in model {name!r} (known: {', '.join(_CONFIGS)})")
    return cfg


def check_shapes(cfg: ModelConfig, shapes: Mapping[str, Sequence[int]] | None) -> tuple[int, int]:
    """Resolve ``shapes`` (None: the defaults) to (batch, seq); InputError naming the bad input."""
    if shapes is None:
        return cfg.default_batch, cfg.default_seq
    if not isinstance(shapes, Mapping):
        raise InputError(f"shapes must map input names to shapes, got {type(shapes).__name__}")
    extra = [k for k in shapes if k not in INPUT_NAMES]
    if extra:
        raise InputError(f"model {cfg.name!r} has no input(s) {', '.join(repr(k) for k in extra)} "
                         f"(inputs: {', '.join(INPUT_NAMES)})")
    missing = [k for k in INPUT_NAMES if k not in shapes]
    if missing:
        raise InputError(f"model {cfg.name!r}: no shape given for input(s) {', '.join(repr(k) for k in missing)} "
                         f"(give both {INPUT_NAMES[0]!r} and {INPUT_NAMES[1]!r} as [batch, seq])")
    resolved: dict[str, tuple[int, ...]] = {}
    for name in INPUT_NAMES:
        raw = shapes[name]
        try:
            dims = tuple(raw)
        except TypeError:
            raise InputError(f"input {name!r}: shape must be a sequence of ints, got {raw!r}") from None
        if not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in dims):
            raise InputError(f"input {name!r}: shape must be a sequence of ints, got {list(dims)!r}")
        dims = tuple(int(d) for d in dims)
        if len(dims) != 2:
            raise InputError(f"input {name!r}: expected rank 2 [batch, seq], got {list(dims)}")
        if min(dims) <= 0:
            raise InputError(f"input {name!r}: dimensions must be positive, got {list(dims)}")
        if dims[1] > cfg.max_positions:
            raise InputError(f"input {name!r}: sequence length {dims[1]} exceeds the model's "
                             f"{cfg.max_positions} positions")
        resolved[name] = dims
    if resolved[INPUT_NAMES[0]] != resolved[INPUT_NAMES[1]]:
        raise InputError(f"input {INPUT_NAMES[1]!r}: shape {list(resolved[INPUT_NAMES[1]])} differs from "
                         f"{INPUT_NAMES[0]!r} {list(resolved[INPUT_NAMES[0]])}")
    b, s = resolved[INPUT_NAMES[0]]
    return b, s


def _builder(family: str) -> Callable[..., Graph]:
    if family == "gpt2":
        from .gpt2 import build_gpt2

        return build_gpt2
    if family == "bert":
        from .bert import build_bert

        return build_bert
    from .llama import build_llama

    return build_llama


def build(name: str, shapes: Mapping[str, Sequence[int]] | None = None,
          weights_dir: str | os.PathLike[str] | None = None, seed: int = 0, storage: str | None = None) -> Graph:
    """Build the verified graph of a built-in model for static input ``shapes``.

    Weights are seeded random fp32 (``seed``) unless ``weights_dir`` names a local Hugging Face
    checkpoint (config.json + *.safetensors); its config.json dims replace the named config's.
    ``storage`` ("f16"/"bf16"): a compile's storage dtype, in which large weights are held
    (``weights.StoredWeights``). Raises ModelError for an unknown name or an unusable checkpoint,
    InputError for bad shapes.
    """
    from .weights import RandomWeights, stored

    cfg = get_config(name)
    if weights_dir is None:
        weights = RandomWeights(seed)
    else:
        from .hf_weights import HFWeights, config_from_hf

        cfg = config_from_hf(cfg, weights_dir)
        weights = HFWeights(weights_dir, cfg)
    batch, seq = check_shapes(cfg, shapes)
    graph = _builder(cfg.family)(cfg, batch, seq, stored(weights, storage))
    weights.finish()
    graph.meta["model"] = {"name": cfg.name, "family": cfg.family,
                           "weights": "random" if weights_dir is None else "checkpoint"}
    return graph
