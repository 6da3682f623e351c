"""How experiments build, run and time plans. The flow (``fusec.ab.experiment``) only talks to a
``Runner``, so the CPU tests drive the whole decision flow with a fake one; ``GpuRunner`` is the
real thing (fusec.compile, the plan's executor, ``fusec.bench.measure``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from fusec.errors import FusecError


class Runner(Protocol):
    def environment(self) -> dict[str, Any]:
        """What the measurements depend on (GPU name, driver/NVRTC/CuPy/fusec versions)."""

    def build(self, model: Any, *, dtype: str, cuda_graph: bool, shapes: Mapping[str, Sequence[int]] | None = None,
              overrides: Mapping[str, bool] | None = None, choices: Mapping[str, str] | None = None,
              disabled: Sequence[str] = ()) -> Any:
        """A compiled plan of ``model`` (a Graph or a model name/path) with the given decisions."""

    def inputs(self, plan: Any, seed: int) -> dict[str, np.ndarray]:
        """Random inputs for ``plan``: non-zero floats, valid ids."""

    def outputs(self, plan: Any, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run ``plan`` once; its outputs on the host (fp32 for half dtypes)."""

    def time(self, plan: Any, cuda_graph: bool, iters: int) -> dict[str, Any]:
        """Latency distribution: {"median_ms", "p10_ms", "p90_ms", ...}."""


class NoGPUError(FusecError):
    pass


class GpuRunner:
    """Compiles with ``fusec.compile`` and measures on the current CUDA device."""

    def __init__(self, warmup: int = 20, batch: int = 10) -> None:
        from fusec import device

        if not device.gpu_available():
            raise NoGPUError("fusec ab measures fused against unfused kernels on a GPU, and CuPy sees no CUDA device "
                             "here; use `fusec compile --decisions LEDGER.json` with a ledger measured on a GPU")
        self.warmup = warmup
        self.batch = batch

    def environment(self) -> dict[str, Any]:
        import cupy

        from fusec import __version__
        from fusec.codegen.compile import nvrtc_version

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return {"gpu": name, "arch": f"sm_{props['major']}{props['minor']}",
                "driver": int(cupy.cuda.runtime.driverGetVersion()),
                "nvrtc": ".".join(map(str, nvrtc_version())), "cupy": str(cupy.__version__), "fusec": __version__}

    def build(self, model: Any, *, dtype: str, cuda_graph: bool, shapes: Mapping[str, Sequence[int]] | None = None,
              overrides: Mapping[str, bool] | None = None, choices: Mapping[str, str] | None = None,
              disabled: Sequence[str] = ()) -> Any:
        import fusec

        return fusec.compile(model, shapes=shapes, dtype=dtype, cuda_graph=cuda_graph, disabled_fusions=disabled,
                             fusion_overrides=overrides, choices=choices)

    def inputs(self, plan: Any, seed: int) -> dict[str, np.ndarray]:
        from fusec.inputs import random_inputs_for

        # standard normal floats: non-zero with probability 1; ids within their table
        return random_inputs_for(plan.manifest["inputs"], seed)

    def outputs(self, plan: Any, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import cupy

        from fusec.dtypes import DType

        res = plan.run(inputs)
        out = {}
        for d in plan.manifest["outputs"]:
            host = cupy.asnumpy(res[d["name"]])  # copy now: the views are valid until the next run
            if DType(d["dtype"]) == DType.BF16:
                host = (host.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            out[d["name"]] = host.astype(np.float32) if host.dtype.kind == "f" else host
        return out

    def time(self, plan: Any, cuda_graph: bool, iters: int) -> dict[str, Any]:
        from fusec.bench import measure

        # Regions take a few microseconds: time 10 back-to-back runs per sample, so per-sample
        # sync and event overhead (measured: p10-p90 spreads of 5-23 us on an H200, larger than
        # most fused/unfused differences) does not drown the difference being decided on.
        return measure(plan, cuda_graph=cuda_graph, warmup=self.warmup, iters=iters, rotate=4, batch=self.batch)
