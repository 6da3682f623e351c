"""Latency measurement of compiled plans with CUDA events (GPU only).

``measure(plan, ...)`` times single requests: for each repeat it records a start event, runs the
plan (eager launches, one CUDA-graph replay, or one replay of a ``plan.bind()`` object), records an
end event and waits for it, so each sample is the latency of one request as the GPU saw it, host
launch overhead included (the GPU sits idle while the host enqueues). ``host_enqueue_ms`` is the
host time the call itself took (perf_counter around it; median). Inputs are uploaded once and
rotated among ``rotate`` different sets so that the caches do not see one input over and over.
Warm-up runs come first. Timed runs are not measured by the driver counters (``run(...,
measure=False)``); one more, untimed run after them is, for ``allocations`` (None for bound runs,
which are never measured). The counters' CUPTI tracing, when attached, still slows every
CUDA-graph launch of the process (see ``fusec.runtime.counters``): ``driver_counters`` in the
result says whether it was attached; ``fusec bench`` turns the counters off while it times unless
asked otherwise.

The per-kernel profile (``per_kernel``) lives in ``fusec.bench_kernels``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

MODES = ("eager", "cuda_graph", "bound")


def _percentiles(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)),
            "p90_ms": float(np.percentile(a, 90)), "min_ms": float(a.min()), "runs": int(a.size)}


def measure(plan: Any, cuda_graph: bool, warmup: int = 10, iters: int = 100, rotate: int = 4,
            seed: int = 0, batch: int = 1, bound: bool = False) -> dict[str, Any]:
    """Time ``plan`` (a ``fusec.Plan``) in eager or CUDA-graph mode; returns percentiles in ms.

    ``bound``: time ``plan.bind(inputs)`` replays instead of ``run()`` (``cuda_graph`` is then
    irrelevant: a bound run is always one graph launch); the rotated input sets are copied into the
    bound buffers before each timed run, outside the events.

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
    if bound:
        mine = {k: v.copy() for k, v in sets[0].items()}
        b = runner.bind(mine)

        def call(i: int) -> None:
            b.run(stream)
    else:
        def call(i: int) -> None:
            runner.run(sets[i % len(sets)], stream=stream, measure=False)

    def refill(i: int) -> None:
        if bound:
            with stream:
                for k, v in sets[i % len(sets)].items():
                    mine[k][...] = v

    for i in range(warmup):
        refill(i)
        call(i)
    stream.synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    samples, host = [], []
    for i in range(iters):
        refill(i)
        start.record(stream)
        t0 = time.perf_counter()
        call(i)
        host.append((time.perf_counter() - t0) * 1e3)
        for _ in range(max(1, batch) - 1):
            if bound:
                b.run(stream)
            elif cuda_graph:  # the inputs are staged: replay only, so the host never starves the GPU
                runner._exec().replay(stream)
            else:
                runner.run(sets[i % len(sets)], stream=stream, measure=False)
        end.record(stream)
        end.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, end) / max(1, batch))
    out = _percentiles(samples)
    out["mode"] = "bound" if bound else "cuda_graph" if cuda_graph else "eager"
    out["batch"] = max(1, batch)
    out["host_enqueue_ms"] = float(np.median(host))
    stats: dict[str, Any] = {}
    if not bound:  # (a bound run is never measured)
        runner.run(sets[0], stream=stream, measure=True)  # untimed and measured: the driver's allocations in one run
        stats = runner.stats()
    out["launches"] = stats.get("launches", len(plan.manifest.get("launches", [])))
    out["allocations"] = stats.get("allocations")
    out["driver_counters"] = counters_state()
    return out


def counters_state() -> str:
    """Whether fusec's driver counters were attached to this process, and what that costs timings."""
    from fusec.runtime.counters import DriverCounters

    inst = DriverCounters.peek()
    return "not created" if inst is None else inst.describe()
