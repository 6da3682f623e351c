"""NVTX ranges around a plan's launches, for Nsight Systems and other NVTX-aware profilers.

Off unless asked: ``FUSEC_NVTX=1`` in the environment (read once, when fusec's runtime is
imported) or ``Plan.run(..., nvtx=True)``. When off, a run pays one boolean test. When on, a run
is one range ``fusec run`` holding one range per launch, named by its label
(``#3 fused fused[gemm_epilogue] epilogue``: node index, op, fusion rule; fusec's own words,
never a string from a model file); a CUDA-graph replay is one range ``fusec run (graph)``.
Ranges come from ``cupy.cuda.nvtx``; where CuPy was built without NVTX they are skipped.
"""

from __future__ import annotations

from typing import Any

def enabled() -> bool:
    """``FUSEC_NVTX`` now (read when a plan runs, not at import)."""
    from fusec import knobs

    return bool(knobs.get("FUSEC_NVTX"))


def _nvtx() -> Any:
    try:
        from cupy.cuda import nvtx
    except ImportError:
        return None
    return nvtx if getattr(nvtx, "available", True) else None


def run_with_ranges(executor: Any, stream: Any) -> None:
    """Enqueue ``executor``'s launches (or replay its graph) on ``stream`` inside NVTX ranges."""
    nvtx = _nvtx()
    name = "fusec run"
    if executor._graph is not None:
        if nvtx is not None:
            nvtx.RangePush(name + " (graph)")
        try:
            executor._graph.launch(stream)
        finally:
            if nvtx is not None:
                nvtx.RangePop()
        return
    records = executor.entry["launches"]
    if nvtx is None:
        for launch in executor._launches:
            launch(stream)
        return
    nvtx.RangePush(name)
    try:
        for launch, rec in zip(executor._launches, records):
            nvtx.RangePush(str(rec.get("label") or rec.get("type", "launch")))
            try:
                launch(stream)
            finally:
                nvtx.RangePop()
    finally:
        nvtx.RangePop()
