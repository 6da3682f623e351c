"""A Chrome/Perfetto trace of one plan run: one slice per launch, named after the ops it fuses.

The file is Trace Event Format JSON (``{"traceEvents": [...]}``), which ui.perfetto.dev and
chrome://tracing open as they are. Two tracks:

- process "GPU", thread "stream": one complete event (``"ph": "X"``) per launch, at its GPU start
  time and duration, named after its kernel's ops (``matmul+add+gelu``); ``args`` hold the launch
  index, its label, the fused ops, the fusion rule, the kernel (or cuBLAS call) and grid/block;
- process "host", thread "enqueue": the host time each launch took to enqueue.

How GPU times are taken (``otherData.gpu_timing``): a CUDA event is recorded before and after
every launch of one eager run on a private stream, after ``warmup`` runs (module loading, cuBLAS
heuristics; the warm-up run also stages the inputs into their arena slots). Event timestamps have
a resolution of about half a microsecond, and the events themselves add a little time between
launches; a plan loaded for CUDA-graph replay is traced eagerly (the graph replays the same
launches). The two clocks meet at one point: host time 0 is when the first event was recorded.
CUPTI kernel records are not used: CUPTI admits one client per process, and fusec's driver
counters (``fusec.runtime.counters``) hold it without kernel activity.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

GPU_PID, HOST_PID = 1, 2
GPU_TIMING = "cuda-events"


def trace_document(launches: Sequence[Mapping[str, Any]], gpu: Sequence[tuple[float, float]],
                   host: Sequence[tuple[float, float]] = (), meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The trace of one run. ``launches``: described launches (``Subject.describe()``); ``gpu`` and
    ``host``: (start_us, duration_us) per launch, in launch order; ``meta`` goes to ``otherData``."""
    if len(gpu) != len(launches) or (host and len(host) != len(launches)):
        raise ValueError(f"{len(launches)} launches, {len(gpu)} GPU timings, {len(host)} host timings")
    events: list[dict[str, Any]] = [
        _meta_event("process_name", GPU_PID, {"name": "GPU"}),
        _meta_event("thread_name", GPU_PID, {"name": "stream"}),
        _meta_event("process_sort_index", GPU_PID, {"sort_index": 0}),
    ]
    if host:
        events += [_meta_event("process_name", HOST_PID, {"name": "host"}),
                   _meta_event("thread_name", HOST_PID, {"name": "enqueue"}),
                   _meta_event("process_sort_index", HOST_PID, {"sort_index": 1})]
    for L, (start, dur) in zip(launches, gpu):
        args = {"launch": L["index"], "label": L["label"], "ops": list(L.get("ops") or []), "kernel": L.get("kernel")}
        for key in ("rule", "node", "grid", "block"):
            if L.get(key) is not None:
                args[key] = L[key]
        events.append({"name": L["name"], "cat": "gemm" if L.get("type") == "gemm" else "kernel", "ph": "X",
                       "ts": round(float(start), 3), "dur": round(float(dur), 3), "pid": GPU_PID, "tid": 1,
                       "args": args})
    for L, (start, dur) in zip(launches, host):
        events.append({"name": L["name"], "cat": "enqueue", "ph": "X", "ts": round(float(start), 3),
                       "dur": round(float(dur), 3), "pid": HOST_PID, "tid": 1, "args": {"launch": L["index"]}})
    gpu_total = max((s + d for s, d in gpu), default=0.0)
    other = {"gpu_timing": GPU_TIMING, "launches": len(launches), "gpu_span_us": round(gpu_total, 3),
             "gpu_busy_us": round(sum(d for _, d in gpu), 3), **dict(meta or {})}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _meta_event(name: str, pid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": 1, "args": args}


def write_trace(path: str | os.PathLike[str], doc: Mapping[str, Any]) -> None:
    """Write the trace JSON atomically (ASCII only: names from a model file stay escaped)."""
    from fusec.fsutil import atomic_write

    with atomic_write(path, what="trace file") as f:
        f.write(json.dumps(doc, ensure_ascii=True, separators=(",", ":")).encode("ascii"))


def measure(plan: Any, inputs: Mapping[str, Any], entry: str | None = None,
            warmup: int = 1) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Time one eager run of ``plan``'s entry launch by launch (GPU only; synchronizes).

    Returns (gpu, host): per launch, (start, duration) in microseconds; GPU times from CUDA events
    relative to an event recorded just before the first launch, host enqueue times relative to
    the moment that event was recorded."""
    import cupy as cp

    ex = plan._exec(entry)  # the entry's Executor: its prepared launch callables, in order
    launches = list(ex._launches)
    stream = cp.cuda.Stream(non_blocking=True)
    for _ in range(max(1, int(warmup))):  # also stages the inputs into their (fixed) arena slots
        plan.run(inputs, stream=stream, entry=entry, measure=False)
    stream.synchronize()
    begin = cp.cuda.Event()
    marks = [(cp.cuda.Event(), cp.cuda.Event()) for _ in launches]
    host: list[tuple[float, float]] = []
    begin.record(stream)
    h0 = time.perf_counter()
    for launch, (a, b) in zip(launches, marks):
        a.record(stream)
        t = time.perf_counter()
        launch(stream)
        host.append(((t - h0) * 1e6, (time.perf_counter() - t) * 1e6))
        b.record(stream)
    stream.synchronize()
    gpu = [(cp.cuda.get_elapsed_time(begin, a) * 1e3, cp.cuda.get_elapsed_time(a, b) * 1e3) for a, b in marks]
    return gpu, host


def profile_plan(plan: Any, launches: Sequence[Mapping[str, Any]], inputs: Mapping[str, Any], *,
                 entry: str | None = None, warmup: int = 1, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Measure one run and return its trace document (``launches``: the entry's described launches)."""
    gpu, host = measure(plan, inputs, entry=entry, warmup=warmup)
    from fusec.device import describe

    info = {"warmup_runs": max(1, int(warmup)), "arch": plan.arch, "dtype": plan.dtype,
            "entry": entry or plan.entries[0], "device": describe(),
            "clock_alignment": "host time 0 = when the event before the first launch was recorded",
            "launch_mode": "eager" + (" (the plan replays these launches as one CUDA graph in a normal run)"
                                      if plan.cuda_graph else ""),
            "cupti": "not used for kernel times (one CUPTI client per process: fusec's driver counters)"}
    info.update(meta or {})
    return trace_document(launches, gpu, host, info)
