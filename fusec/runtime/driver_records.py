"""CUDA API records of one measured region, turned into counters (pure: no CUPTI, no GPU).

``fusec.runtime.counters.DriverCounters`` collects CUPTI activity records as tuples (the format is
below) and hands those of a region to ``aggregate``; ``classify_api`` sorts CUDA driver and runtime
API names into counter classes.

Counters of ``result()``:

* ``syncs``: explicit host synchronizations (``cu/cudaStreamSynchronize``, ``cuCtxSynchronize``,
  ``cudaDeviceSynchronize``, ``cu/cudaEventSynchronize``, ...) plus blocking copies (a
  non-async copy between host and device: it waits for the device). ``sync_calls`` names them
  (``{"cudaDeviceSynchronize": 1, "cudaMemcpy": 1}``), so every sync is attributable.
* ``h2d_bytes``, ``d2h_bytes``, ``d2d_bytes`` (device, array and peer copies), ``h2h_bytes``,
  ``memcpy_calls`` (copies executed, graph copy nodes included), ``pageable_memcpys`` (copies
  from/to pageable host memory: an async one may still block the host), ``memset_calls``.
* ``allocations``: device allocations that reached the driver (``cuMemAlloc*``, ``cudaMalloc*``,
  ``cudaMallocAsync``, ``cuMemCreate``, ...). A CuPy memory-pool hit is no allocation: CuPy's
  pool calls ``cudaMalloc`` only when it has no free block of that size. ``host_allocations``
  (pinned host memory) and ``frees`` are counted apart.
* ``kernel_launches``: launch API calls (``cuLaunchKernel*``, ``cudaLaunchKernel*``, cooperative
  launches); kernels that run inside a replayed CUDA graph are not launches. ``graph_launches``:
  ``cuGraphLaunch``/``cudaGraphLaunch`` calls.
* ``api_calls`` (all CUDA API calls seen), ``region_ms`` (host time of the window).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_SUFFIX = re.compile(r"(_v\d+|_ptsz|_ptds)$")

_KERNEL_LAUNCH = frozenset({
    "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernelMultiDevice",
    "cuLaunchGrid", "cuLaunchGridAsync", "cuLaunch",
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
    "cudaLaunchCooperativeKernelMultiDevice", "cudaLaunch",
})
_GRAPH_LAUNCH = frozenset({"cuGraphLaunch", "cudaGraphLaunch"})
_ALLOC = frozenset({
    "cuMemAlloc", "cuMemAllocPitch", "cuMemAllocManaged", "cuMemAllocAsync", "cuMemAllocFromPoolAsync",
    "cuMemCreate", "cu64MemAlloc", "cu64MemAllocPitch", "cuArrayCreate", "cuArray3DCreate",
    "cuMipmappedArrayCreate",
    "cudaMalloc", "cudaMallocPitch", "cudaMalloc3D", "cudaMallocArray", "cudaMalloc3DArray",
    "cudaMallocMipmappedArray", "cudaMallocManaged", "cudaMallocAsync", "cudaMallocFromPoolAsync",
})
_HOST_ALLOC = frozenset({
    "cuMemAllocHost", "cuMemHostAlloc", "cu64MemHostAlloc", "cuMemHostRegister",
    "cudaMallocHost", "cudaHostAlloc", "cudaHostRegister",
})
_FREE = frozenset({
    "cuMemFree", "cuMemFreeAsync", "cuMemFreeHost", "cuMemHostUnregister", "cuMemRelease", "cu64MemFree",
    "cuArrayDestroy", "cuMipmappedArrayDestroy",
    "cudaFree", "cudaFreeAsync", "cudaFreeHost", "cudaHostUnregister", "cudaFreeArray", "cudaFreeMipmappedArray",
})

# Classes whose nested driver call (inside a runtime call of the same class) is not counted again.
_DEDUPED = ("sync", "kernel_launch", "graph_launch", "alloc", "host_alloc", "free")


def api_base_name(name: str) -> str:
    """``cudaLaunchKernel_ptsz_v7000`` -> ``cudaLaunchKernel``; ``cuMemAlloc_v2`` -> ``cuMemAlloc``."""
    prev = None
    while prev != name:
        prev, name = name, _SUFFIX.sub("", name)
    return name


def classify_api(name: str) -> str | None:
    """The counter class of a CUDA driver/runtime API name, or None for calls that count nothing.

    Classes: ``sync``, ``kernel_launch``, ``graph_launch``, ``alloc``, ``host_alloc``, ``free``,
    ``memcpy``, ``memset``."""
    base = api_base_name(name)
    if base in _KERNEL_LAUNCH:
        return "kernel_launch"
    if base in _GRAPH_LAUNCH:
        return "graph_launch"
    if base.endswith("Synchronize") and base.startswith("cu"):
        return "sync"  # cuCtx/cuStream/cuEvent, cudaDevice/cudaThread/cudaStream/cudaEvent/cudaExecutionCtx
    if base in _ALLOC:
        return "alloc"
    if base in _HOST_ALLOC:
        return "host_alloc"
    if base in _FREE:
        return "free"
    if "Memcpy" in base and not base.startswith(("cuGraph", "cudaGraph")):
        return "memcpy"
    if "Memset" in base and not base.startswith(("cuGraph", "cudaGraph")):
        return "memset"
    return None


# Copy directions, by CUPTI's CUpti_ActivityMemcpyKind name.
COPY_DIRECTION = {
    "HTOD": "h2d", "HTOA": "h2d",
    "DTOH": "d2h", "ATOH": "d2h",
    "DTOD": "d2d", "DTOA": "d2d", "ATOD": "d2d", "ATOA": "d2d", "PTOP": "d2d",
    "HTOH": "h2h",
}

# Record tuples (what the CUPTI buffer callback keeps; ``aggregate`` consumes them):
#   ("api", domain "d"|"r", api name (a cbid until result() names it), start_ns, end_ns, correlation_id, thread_id)
#   ("copy", direction "h2d"|"d2h"|"d2d"|"h2h"|"?", bytes, is_async, pageable, correlation_id, runtime_correlation_id)
#   ("set", bytes, correlation_id, runtime_correlation_id)


def aggregate(records: Iterable[tuple], t0: int, t1: int) -> dict[str, Any]:
    """Counters of the region ``[t0, t1]`` (CUPTI ns) from record tuples (see above)."""
    api = [r for r in records if r[0] == "api" and t0 <= r[3] <= t1]
    # CUPTI numbers driver and runtime calls from one counter; a copy carries the id of the call
    # that issued it (``correlation_id``; ``runtime_correlation_id`` is 0 or that runtime call's).
    ids = {r[5]: r[2] for r in api}
    outer: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for r in api:
        cls = classify_api(r[2])
        if r[1] == "r" and cls in _DEDUPED:
            outer.setdefault((cls, r[6]), []).append((r[3], r[4]))

    out: dict[str, Any] = {
        "source": "cupti", "syncs": 0, "sync_calls": {}, "h2d_bytes": 0, "d2h_bytes": 0, "d2d_bytes": 0,
        "h2h_bytes": 0, "memcpy_calls": 0, "pageable_memcpys": 0, "memset_calls": 0, "allocations": 0,
        "host_allocations": 0, "frees": 0, "kernel_launches": 0, "graph_launches": 0, "api_calls": len(api),
        "region_ms": max(t1 - t0, 0) / 1e6,
    }
    key = {"kernel_launch": "kernel_launches", "graph_launch": "graph_launches", "alloc": "allocations",
           "host_alloc": "host_allocations", "free": "frees", "sync": "syncs"}
    sync_calls: dict[str, int] = out["sync_calls"]
    for r in api:
        cls = classify_api(r[2])
        if cls not in key:
            continue
        if r[1] == "d" and any(s <= r[3] and r[4] <= e for s, e in outer.get((cls, r[6]), ())):
            continue  # the driver call a runtime call of the same class made: counted once, as the runtime call
        out[key[cls]] += 1
        if cls == "sync":
            base = api_base_name(r[2])
            sync_calls[base] = sync_calls.get(base, 0) + 1

    for r in records:
        if r[0] == "copy":
            _, direction, nbytes, is_async, pageable, corr, rt_corr = r
            name = ids.get(corr) or (ids.get(rt_corr) if rt_corr else None)
            if name is None:
                continue  # issued outside the region
            out["memcpy_calls"] += 1
            if direction in ("h2d", "d2h", "d2d", "h2h"):
                out[direction + "_bytes"] += nbytes
            if pageable:
                out["pageable_memcpys"] += 1
            if not is_async and direction in ("h2d", "d2h"):
                # A blocking copy between host and device: the host waits for the device.
                out["syncs"] += 1
                base = api_base_name(name)
                sync_calls[base] = sync_calls.get(base, 0) + 1
        elif r[0] == "set":
            _, nbytes, corr, rt_corr = r
            if corr in ids or (rt_corr and rt_corr in ids):
                out["memset_calls"] += 1
    return out
