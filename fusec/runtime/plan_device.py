"""A plan's device memory and code (``Device``), made once per plan and shared by its entry points
and by its CUDA-graph copies; ``fusec.runtime.executor.Executor`` runs one entry's launches over it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fusec.dtypes import DType
from fusec.errors import InputError
from fusec.plan import entry_points as entries
from fusec.plancheck import complete_cubin
from fusec.runtime.cublas import Handle
from fusec.runtime.guard import RunGuard, allocate


class Device:
    """A plan's device memory and code, made once per plan and shared by its entry points: the
    weights (uploaded once), the state region (zeroed once, kept across runs and entries), one
    arena sized for the largest entry (entries never run at once), the loaded kernels and the
    cuBLAS handle."""

    def __init__(self, manifest: Mapping[str, Any], blob: Any):
        import cupy

        self.manifest = dict(manifest)
        self._cp = cupy
        mem = self.manifest["memory"]
        # a loaded plan's weights: checksum checked here, on first use, then uploaded from the file mapping
        wbytes = np.frombuffer(blob("weights"), dtype=np.uint8) if int(mem["weights_bytes"]) else np.zeros(1, np.uint8)
        self.arena = allocate(cupy, "arena", int(mem["arena_bytes"]))  # out of memory: MemoryError, asked/free
        self.weights = allocate(cupy, "weights", wbytes.nbytes)
        self.weights.set(wbytes)  # the one upload of the weights
        self.state = allocate(cupy, "state", int(mem.get("state_bytes", 0)), zero=True)
        # The upload above is a copy from pageable host memory on CuPy's current stream: it may return
        # before the DMA lands, and runs use their own (non-blocking) streams, which do not wait for it.
        cupy.cuda.get_current_stream().synchronize()
        self.guard = RunGuard()  # one run at a time over this arena (a Plan installs its own, shared by its copies)
        self.state_layout = {r["name"]: r for r in self.manifest.get("state", [])}
        self.base = {"arena": self.arena.data.ptr, "weights": self.weights.data.ptr, "state": self.state.data.ptr}
        self._modules = {}
        for m in self.manifest["modules"]:
            mod = cupy.cuda.function.Module()
            mod.load(complete_cubin(bytes(blob(m["cubin"]))))  # plans saved short before
            self._modules[m["id"]] = mod
        self.functions = []
        for k in self.manifest["kernels"]:
            fn = self._modules[k["module"]].get_function(k["entry"])
            if int(k.get("smem", 0)) > 0:
                # opt in to the dynamic shared memory asked for: without it, static + dynamic must
                # stay within 48 KB (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8)
                cupy.cuda.driver.funcSetAttribute(fn.ptr, 8, int(k["smem"]))
            self.functions.append(fn)
        # programmatic dependent launch: launch records that allow it overlap the kernel before them,
        # unless FUSEC_PDL=0 or cuda-bindings is missing (then every launch is plain: same results)
        from fusec import knobs
        from fusec.runtime import pdl

        self.pdl = bool(knobs.get("FUSEC_PDL")) and pdl.available()
        gemms = any(L["type"] == "gemm" for e in entries(self.manifest).values() for L in e["launches"])
        self.handle = Handle() if gemms else None
        self._counters: Any = None  # attached on first use: only a caller that measures pays for CUPTI

    @property
    def counters(self) -> Any:
        """The process's driver counters, attached now if they are not yet (CUPTI: once attached,
        every graph launch pays for its activity records; see fusec.runtime.counters)."""
        if self._counters is None:
            from fusec.runtime.counters import DriverCounters

            self._counters = DriverCounters.create()
        return self._counters

    @property
    def attached_counters(self) -> Any:
        """The counters if something attached them already, else None (never attaches)."""
        return self._counters

    def addr(self, space: str, offset: int) -> int:
        return self.base[space] + int(offset)

    def view(self, buf: Any, offset: int, shape: tuple[int, ...], dtype: DType):
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return buf[offset: offset + n].view(dtype.np if dtype != DType.BF16 else np.uint16).reshape(shape)

    def state_array(self, name: str):
        """A CuPy view of state ``name`` (valid as long as the plan's device state lives)."""
        rec = self.state_layout.get(name)
        if rec is None:
            raise InputError(f"the plan has no state {name!r} (states: {', '.join(map(repr, self.state_layout))})")
        return self.view(self.state, int(rec["offset"]), tuple(rec["shape"]), DType(rec["dtype"]))

    def set_state(self, name: str, value: Any) -> None:
        """Write state ``name`` from host data (one H2D copy; a setup step, not part of any run).
        Returns once the copy has landed: a copy from pageable memory may return before its DMA
        does, and the next run's stream (non-blocking: a generation engine's) would not wait for it
        (the positions, done flags and seed of a generation then raced its prefill: found on the H100
        as two generations with one seed that differed)."""
        dst = self.state_array(name)
        host = np.ascontiguousarray(np.asarray(value).astype(dst.dtype, copy=False)).reshape(dst.shape)
        stream = self._cp.cuda.get_current_stream()
        dst.set(host, stream=stream)
        stream.synchronize()

    def read_state(self, name: str) -> np.ndarray:
        """State ``name`` on the host (one D2H copy; synchronizes with the current stream)."""
        return self.state_array(name).get()
