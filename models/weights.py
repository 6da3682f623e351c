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

    def finish(self) -> None:
        self.source.finish()


def stored(source: WeightSource, storage: str | None) -> WeightSource:
    """``source`` as a compile storing ``storage`` ("f16", "bf16"; anything else: fp32) reads it."""
    return StoredWeights(source, storage) if storage in ("f16", "bf16") else source
