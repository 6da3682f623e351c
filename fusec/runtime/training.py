"""Training on the GPU: ``CudaEngine`` runs a training plan's three entry points (fusec.train.graphs)
as one fusec plan: one weights buffer, one arena, and the state region holding the parameters,
AdamW's moments and the step counter for the plan's life.

``train_step`` is captured as a CUDA graph when the plan is made; a step is then the batch's
host-to-device copies into their fixed arena slots and one graph launch on the engine's stream:
no synchronization, no allocation. The step's loss is copied (device to device) into a ring of
losses that ``losses()`` reads back in one copy when asked. Capturing runs each entry's launch
list once (the warm-up), which moves the state; the engine therefore makes every entry's
executor before the caller initializes or loads the state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

RING = 4096  # losses kept on the device between reads


class CudaEngine:
    backend = "cuda"

    def __init__(self, graphs: Mapping[str, Any], arch: str | None = None, cuda_graph: bool = True,
                 progress: Callable[[str, str], None] | None = None):
        import cupy

        from fusec.compiler import compile_entries

        self.plan = compile_entries(dict(graphs), dtype="fp32", cuda_graph=cuda_graph, arch=arch, progress=progress,
                                    source={"model": next(iter(graphs.values())).name, "kind": "other"})
        self._ex = {name: self.plan._exec(name) for name in graphs}  # captured now: see the module docstring
        self.device = self._ex["train_step"].device
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._ring = cupy.zeros(RING, dtype=cupy.float32)
        self._count = 0  # steps whose loss sits in the ring
        self._pending: list[np.ndarray] = []
        self.steps = 0
        self._last_stats: dict[str, Any] = {}

    def init(self, seed: int) -> None:
        self._ex["init"].run({"seed": np.array([seed], np.int64)}, stream=self.stream, measure=False)
        self.stream.synchronize()

    def train_step(self, inputs: Mapping[str, np.ndarray], measure: bool = False) -> None:
        if self._count == RING:
            self._drain()
        slot = self._ring[self._count:self._count + 1].reshape(())
        self._ex["train_step"].run(inputs, stream=self.stream, outputs={"loss": slot}, measure=measure)
        self._count += 1
        self.steps += 1
        if measure:
            self._last_stats = self._ex["train_step"].stats()

    def _drain(self) -> None:
        if self._count:
            self._pending.append(self._ring[:self._count].get(stream=self.stream))
            self._count = 0

    def losses(self) -> np.ndarray:
        self._drain()
        out = np.concatenate(self._pending) if self._pending else np.zeros(0, np.float32)
        self._pending = []
        return out

    def eval(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self._ex["eval"].run(inputs, stream=self.stream, measure=False)
        return {k: v.get(stream=self.stream) for k, v in out.items()}

    def read_state(self, name: str) -> np.ndarray:
        self.stream.synchronize()
        return self.device.read_state(name)

    def write_state(self, name: str, value: np.ndarray) -> None:
        self.stream.synchronize()
        self.device.set_state(name, value)

    def eager_step(self, inputs: Mapping[str, Any], measure: bool = False) -> dict[str, Any]:
        """One ``train_step`` launched kernel by kernel, not as the graph (to count the kernels a
        step runs); returns the run's stats."""
        ex = self.plan.with_cuda_graph(False)._exec("train_step")
        ex.run(inputs, stream=self.stream, measure=measure)
        self.steps += 1
        return ex.stats()

    def replay(self) -> None:
        """One ``train_step`` on the inputs already staged (benchmarks: the graph launch alone)."""
        self._ex["train_step"].replay(self.stream)

    def stats(self) -> dict[str, Any]:
        """What the driver did during the last measured step (``train_step(..., measure=True)``)."""
        return {"backend": self.backend, "steps": self.steps, **self._last_stats}
