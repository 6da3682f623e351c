"""Weight sources for the model builders: seeded random weights, or a checkpoint (hf_weights).

A builder asks for every parameter by its Hugging Face name (without the ``transformer.`` /
``model.`` / ``bert.`` wrapper prefix), its shape and its kind; the source returns an fp32 array
of exactly that shape. Random weights are drawn in the order the builder asks for them, so the
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
