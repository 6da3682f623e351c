"""Latency measurement of compiled plans with CUDA events (GPU only).

``measure(plan, ...)`` times single requests: for each repeat it records a start event, runs the
plan (eager launches, or one CUDA-graph replay), records an end event and waits for it, so each
sample is the latency of one request as the GPU saw it, host launch overhead included (the GPU
sits idle while the host enqueues). Inputs are uploaded once and rotated among ``rotate``
different sets so that the caches do not see one input over and over. Warm-up runs come first.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _percentiles(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)),
            "p90_ms": float(np.percentile(a, 90)), "min_ms": float(a.min()), "runs": int(a.size)}


def measure(plan: Any, cuda_graph: bool, warmup: int = 10, iters: int = 100, rotate: int = 4,
            seed: int = 0, batch: int = 1) -> dict[str, Any]:
    """Time ``plan`` (a ``fusec.Plan``) in eager or CUDA-graph mode; returns percentiles in ms.

    ``batch`` > 1: each sample is ``batch`` runs back to back between one pair of events, divided
    by ``batch`` (steady-state time per run, without the per-sample synchronization and event
    overhead that swamps regions of a few microseconds: the A/B experiments use this). In graph
    mode the extra runs are bare graph replays on the staged inputs: measured on an H200, the
    ~20 us of Python work in each run() starved the GPU and hid the regions' differences."""
    import cupy

    from fusec.inputs import random_inputs_for

    runner = plan.with_cuda_graph(cuda_graph)
    sets = [{k: cupy.asarray(v) for k, v in random_inputs_for(plan.manifest["inputs"], seed + i).items()}
            for i in range(max(1, rotate))]
    stream = cupy.cuda.Stream(non_blocking=True)
    for i in range(warmup):
        runner.run(sets[i % len(sets)], stream=stream)
    stream.synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    samples = []
    for i in range(iters):
        start.record(stream)
        runner.run(sets[i % len(sets)], stream=stream)
        for _ in range(max(1, batch) - 1):
            if cuda_graph:  # the inputs are staged: replay only, so the host never starves the GPU
                runner._exec().replay(stream)
            else:
                runner.run(sets[i % len(sets)], stream=stream)
        end.record(stream)
        end.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, end) / max(1, batch))
    out = _percentiles(samples)
    out["mode"] = "cuda_graph" if cuda_graph else "eager"
    out["batch"] = max(1, batch)
    out["launches"] = runner.stats().get("launches")
    out["allocations"] = runner.stats().get("allocations")
    return out
