"""Weight sources for the model builders: seeded random weights, or a checkpoint (hf_weights).

A builder asks for every parameter by its Hugging Face name (without the ``transformer.`` /
``model.`` / ``bert.`` wrapper prefix), its shape and its kind; the source returns an fp32 array
of exactly that shape (``StoredWeights``: large matrices already in a compile's fp16/bf16). Random weights are drawn in the order the builder asks for them, so the
same seed always gives the same graph.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

# Kinds of parameter, which decide how random weights are drawn.
MATRIX = "matrix"  # projection / embedding weights: ~N(0, 0.02)
BIAS = "bias"  # biases, norm shifts: small but non-zero, so tests see them
NORM = "norm"  # norm scales: ~1 + small noise


class WeightSource(Protocol):
    def get(self, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        """The fp32 parameter ``name`` of exactly ``shape``."""
        ...

    def finish(self) -> None:
        """Called after the graph is built: raise if the source holds tensors nobody asked for."""
        ...


class RandomWeights:
    """Deterministic random fp32 weights from ``np.random.default_rng(seed)``."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def get(self, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        # Draw straight into float32 and scale in place: no float64 temporary, so a 0.6B-parameter
        # model costs its fp32 size once (and a few seconds), not twice.
        arr = self.rng.standard_normal(shape, dtype=np.float32)
        arr *= np.float32(0.02)
        if kind == NORM:
            arr += np.float32(1.0)
        return arr

    def finish(self) -> None:
        pass


class SplitFused:
    """A weight source for a model whose checkpoint fuses projections (Phi-3: ``qkv_proj`` holds
    q, k, v stacked by output rows; ``gate_up_proj`` holds gate then up): the builder asks for
    q/k/v_proj and gate/up_proj by name and gets the rows of the fused tensor, which is read
    once per layer. Other names pass through to ``source``."""

    def __init__(self, source: WeightSource, q_rows: int, kv_rows: int, ffn: int):
        self.source = source
        self._parts = {"q_proj": ("qkv_proj", 0, q_rows), "k_proj": ("qkv_proj", q_rows, q_rows + kv_rows),
                       "v_proj": ("qkv_proj", q_rows + kv_rows, q_rows + 2 * kv_rows),
                       "gate_proj": ("gate_up_proj", 0, ffn), "up_proj": ("gate_up_proj", ffn, 2 * ffn)}
        self._fused: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        prefix, _, last = name.rpartition(".")  # "layers.0.self_attn.q_proj", "weight"
        head, _, proj = prefix.rpartition(".")
        part = self._parts.get(proj)
        if part is None or last != "weight":
            return self.source.get(name, shape, kind)
        fused_name, lo, hi = part
        full = f"{head}.{fused_name}.weight"
        arr = self._fused.get(full)
        if arr is None:
            total = self._parts["v_proj"][2] if fused_name == "qkv_proj" else self._parts["up_proj"][2]
            arr = self._fused[full] = self.source.get(full, (total,) + tuple(shape[1:]), kind)
        out = np.ascontiguousarray(arr[lo:hi])
        if fused_name == "qkv_proj" and proj == "v_proj" or fused_name == "gate_up_proj" and proj == "up_proj":
            del self._fused[full]  # the last part asked for: the builder asks in this order
        return out

    def get_packed(self, name: str, shape: tuple[int, ...]) -> object:
        """The source's packed form of an unfused weight; a part of a fused one is read by ``get``
        (rows of a packed weight are not split)."""
        prefix, _, last = name.rpartition(".")
        getter = getattr(self.source, "get_packed", None)
        if getter is None or last == "weight" and prefix.rpartition(".")[2] in self._parts:
            return None
        return getter(name, shape)

    def finish(self) -> None:
        self.source.finish()


class StoredWeights:
    """``source``'s weights for a compile that stores them in half precision (``storage``: fp16 or
    bf16): each large matrix arrives already converted as the precision pass would convert it
    (``fusec.bulk.to_storage``), its fp32 array dropped as soon as it is converted. The builder
    reads such a weight through a CAST to fp32 (``Blocks.param``), which the precision pass drops:
    the plan is the same, and the fp32 copy of the weights (twice their stored size) is never held
    while a model compiles. Small tensors (norms, biases) stay fp32, as the reference has them."""

    MIN_ELEMENTS = 1 << 16

    def __init__(self, source: WeightSource, storage: str):
        from fusec.dtypes import DType

        self.source = source
        self.dtype = DType(storage)
        if self.dtype not in (DType.F16, DType.BF16):
            raise ValueError(f"weights are stored narrow as f16 or bf16, not {storage!r}")

    def get(self, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        from fusec.bulk import to_storage

        arr = self.source.get(name, shape, kind)
        if kind != MATRIX or arr.size < self.MIN_ELEMENTS:
            return arr
        return to_storage(arr, self.dtype.np)

    def get_packed(self, name: str, shape: tuple[int, ...]) -> object:
        """A packed weight as the source has it (already narrower than the storage dtype)."""
        getter = getattr(self.source, "get_packed", None)
        return None if getter is None else getter(name, shape)

    def finish(self) -> None:
        self.source.finish()


def model_weights(cfg: object, source: WeightSource) -> WeightSource:
    """``source`` as the builder of ``cfg`` (a ModelConfig) reads it: split where the checkpoint
    fuses projections (``cfg.fused_projections``)."""
    if not getattr(cfg, "fused_projections", False):
        return source
    hd = cfg.head_dim  # type: ignore[attr-defined]
    return SplitFused(source, cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size)  # type: ignore[attr-defined]


class RandomPackedWeights(RandomWeights):
    """Seeded random weights whose projections are random GGUF blocks, repacked as a GGUF file's
    are on load (``fusec.quant_gguf``): ``types(name)`` gives the GGUF type of projection ``name``
    (an HF name such as ``layers.3.mlp.down_proj.weight``), or None to keep it fp32. What a GGUF
    file of those types builds to, without the file (and without the ``gguf`` package)."""

    def __init__(self, types: object, seed: int = 0, scale: float = 2e-3):
        super().__init__(seed)
        self.types, self.scale = types, scale

    def get_packed(self, name: str, shape: tuple[int, ...]) -> object:
        from fusec.quant_gguf import random_blocks, repack

        t = self.types(name)  # type: ignore[operator]
        if t is None:
            return None
        n, k = shape
        return repack(random_blocks(t, n, k, self.rng, self.scale), t, n, k, name)


def q4_k_m_types(num_layers: int, vocab_lm_head: bool = True) -> object:
    """The tensor types llama.cpp's Q4_K_M gives a llama (``llama_tensor_get_type``): Q4_K (the
    embedding table too), except Q6_K for the LM head and for attn_v / ffn_down in the first and last
    eighth of the layers and every third layer between. ``vocab_lm_head``: the LM head is packed
    too (untied)."""
    def use_more_bits(i: int) -> bool:
        return i < num_layers // 8 or i >= 7 * num_layers // 8 or (i - num_layers // 8) % 3 == 2

    def types(name: str) -> str | None:
        if name == "lm_head.weight":
            return "Q6_K" if vocab_lm_head else None
        if name == "embed_tokens.weight":
            return "Q4_K"
        if not name.startswith("layers.") or not name.endswith("_proj.weight"):
            return None  # norms
        layer = int(name.split(".")[1])
        if name.endswith(("v_proj.weight", "down_proj.weight")) and use_more_bits(layer):
            return "Q6_K"
        return "Q4_K"

    return types


def stored(source: WeightSource, storage: str | None) -> WeightSource:
    """``source`` as a compile storing ``storage`` ("f16", "bf16"; anything else: fp32) reads it."""
    return StoredWeights(source, storage) if storage in ("f16", "bf16") else source
