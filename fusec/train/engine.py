"""The reference engine of a training plan: the same entry-point graphs as the GPU plan, run by the
numpy reference (``fusec.reference``), with the state held in host arrays. Slow, exact, and
available on every machine; ``fusec.runtime.training.CudaEngine`` is its GPU twin (same methods).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fusec import reference
from fusec.ir import Graph


class ReferenceEngine:
    backend = "reference"

    def __init__(self, graphs: Mapping[str, Graph]):
        self.graphs = dict(graphs)
        first = next(iter(self.graphs.values()))
        self.state = {src.name: np.zeros(src.shape, src.dtype.np) for src, _ in first.state_pairs()}
        self._losses: list[float] = []
        self.steps = 0

    def _run(self, entry: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        g = self.graphs[entry]
        out = reference.run(g, {**inputs, **self.state})
        for src, dst in g.state_pairs():
            if dst is not src:
                self.state[src.name] = out[dst.name]
        return {v.name: out[v.name] for v in g.user_outputs()}

    def init(self, seed: int) -> None:
        self._run("init", {"seed": np.array([seed], np.int64)})

    def train_step(self, inputs: Mapping[str, np.ndarray]) -> None:
        out = self._run("train_step", inputs)
        self._losses.append(float(out["loss"]))
        self.steps += 1

    def losses(self) -> np.ndarray:
        out, self._losses = np.array(self._losses, np.float32), []
        return out

    def eval(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._run("eval", inputs)

    def read_state(self, name: str) -> np.ndarray:
        return np.array(self.state[name], copy=True)

    def write_state(self, name: str, value: np.ndarray) -> None:
        cur = self.state[name]
        self.state[name] = np.asarray(value).astype(cur.dtype).reshape(cur.shape).copy()

    def stats(self) -> dict[str, Any]:
        return {"backend": self.backend, "steps": self.steps}
