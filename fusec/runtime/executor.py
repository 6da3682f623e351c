"""The runtime: an ``Executor`` executes a fixed list of launches over one device arena.

It knows only the plan (manifest + blobs), never the IR. At load it validates the manifest,
uploads the weights once (one buffer), allocates the arena once, loads the compiled modules and
resolves every launch argument to a fixed device address. ``run`` then:

1. checks every input's name, shape and dtype before any launch (``InputError`` names it);
2. copies the caller's inputs into their arena slots (host arrays: one H2D copy each; device
   arrays, CuPy or DLPack/``__cuda_array_interface__`` such as PyTorch CUDA tensors: one
   device-to-device copy, no host staging). Copying into fixed slots keeps every pointer of the
   launch list fixed, which is what makes the CUDA-graph replay possible;
3. enqueues the launches (or replays the captured CUDA graph) on the caller's stream or the
   plan's own; nothing in between allocates, synchronizes, or touches the host;
4. returns CuPy views of the output slots (valid until the next run), or copies them into
   caller-provided ``outputs`` arrays.

Manifest schema (the lowering writes it; see ``fusec.codegen.lower``):
  inputs/outputs: [{"name", "shape", "dtype", "offset"}]   (offsets into the arena)
  memory: {"arena_bytes", "weights_bytes"}
  modules: [{"id", "cubin": blob name, "source": blob name}]
  kernels: [{"module": module id, "entry": function name, "smem": dynamic shared bytes}]
  launches: [{"type": "kernel", "kernel": idx, "grid": [x,y,z], "block": [x,y,z], "smem",
              "args": [["ptr", "arena"|"weights", byte_offset] | ["i32"|"i64"|"f32", value]],
              "label": text}
             | {"type": "gemm", ..., GemmCall fields with a/b/c as ["arena"|"weights", offset]}]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fusec.dtypes import DType
from fusec.errors import InputError
from fusec.plan import entry_points as entries
from fusec.report import nvtx as _nvtx
from fusec.report.nvtx import run_with_ranges
from fusec.runtime.cublas import GemmCall
from fusec.runtime.guard import guarded
from fusec.runtime.plan_device import Device

_H2D, _D2D = 1, 3
_SCALAR = {"i32": np.int32, "i64": np.int64, "f32": np.float32, "u64": np.uint64}


class _AllocCounter:
    """Counts CuPy memory-pool allocations while installed (a measurement, not a promise)."""

    def __init__(self) -> None:
        from cupy.cuda import memory_hook

        counter = self

        class Hook(memory_hook.MemoryHook):
            name = "fusec_alloc_counter"

            def alloc_preprocess(self, **kw: Any) -> None:
                counter.count += 1

            def malloc_preprocess(self, **kw: Any) -> None:
                counter.count += 1

        self.count = 0
        self.hook = Hook()


class Executor:
    def __init__(self, manifest: Mapping[str, Any], blob: Any, cuda_graph: bool = False, entry: str = "main",
                 device: Device | None = None):
        """``blob(name) -> bytes-like`` gives the plan's parts (weights, cubins, sources); ``entry``
        names the entry point; ``device`` shares an existing plan's device memory and code."""
        import cupy

        self.manifest = dict(manifest)
        self.cuda_graph = cuda_graph
        self._cp = cupy
        all_entries = entries(self.manifest)
        if entry not in all_entries:
            raise InputError(f"the plan has no entry point {entry!r} (entries: {', '.join(map(repr, all_entries))})")
        self.entry = all_entries[entry]
        self.device = device if device is not None else Device(manifest, blob)
        self.arena, self.weights = self.device.arena, self.device.weights
        self._base = self.device.base
        self._functions = self.device.functions
        self._handle = self.device.handle
        self._launches = [self._prepare(L) for L in self.entry["launches"]]
        self._inputs = [(d["name"], tuple(d["shape"]), DType(d["dtype"]), int(d["offset"])) for d in self.entry["inputs"]]
        self._outputs = {d["name"]: self._view(int(d["offset"]), tuple(d["shape"]), DType(d["dtype"]))
                         for d in self.entry["outputs"]}
        self._graph = None
        self._stats: dict[str, Any] = {}
        self._measured: dict[str, Any] | None = None
        self._allocs = _AllocCounter()  # made once: run() only resets its count
        if cuda_graph:
            self._capture()  # at load, so that no run ever synchronizes, the first one included

    # ---- load-time preparation ------------------------------------------------------------
    def _addr(self, space: str, offset: int) -> int:
        return self._base[space] + int(offset)

    def _view(self, offset: int, shape: tuple[int, ...], dtype: DType):
        return self.device.view(self.arena, offset, shape, dtype)

    def _prepare(self, L: Mapping[str, Any]):
        if L["type"] == "kernel":
            fn = self._functions[int(L["kernel"])]
            args = tuple(np.uint64(self._addr(a[1], a[2])) if a[0] == "ptr" else _SCALAR[a[0]](a[1]) for a in L["args"])
            grid, block, smem = tuple(L["grid"]), tuple(L["block"]), int(L.get("smem", 0))
            if L.get("pdl") and self.device.pdl:  # overlaps the kernel before it (fusec.runtime.pdl)
                from fusec.runtime.pdl import PdlLaunch

                return PdlLaunch(fn.ptr, grid, block, smem, args)

            def launch(stream: Any) -> None:
                fn(grid, block, args, shared_mem=smem, stream=stream)

            return launch
        if L["type"] == "gemm":
            fields = {k: v for k, v in L.items() if k not in ("type", "label", "reads", "writes", "pdl")}
            for key in ("a", "b", "c", "bias", "c_in"):  # bias, c_in: cuBLASLt epilogues (runtime/cublaslt.py)
                if key in fields:
                    fields[key] = self._addr(*fields[key])
            call = GemmCall(**fields)
            handle = self._handle
            if call.epilogue is not None or call.c_in is not None:
                from fusec.runtime.lt_pick import prepare

                prepare(call, handle)  # cuBLASLt: descriptors and the timed algorithm pick, before any capture

            def gemm(stream: Any) -> None:
                call(handle, stream.ptr)

            gemm.lt = call._lt  # type: ignore[attr-defined]  # profile() labels the algorithm picked
            return gemm
        raise ValueError(f"unknown launch type {L['type']!r}")

    # ---- running ----------------------------------------------------------------------------
    def _device_array(self, x: Any):
        """A CuPy view of a device array (no copy), or None for host data."""
        cp = self._cp
        if isinstance(x, cp.ndarray):
            return x
        if hasattr(x, "__cuda_array_interface__"):
            return cp.asarray(x)
        if hasattr(x, "__dlpack_device__") and hasattr(x, "is_cuda") and x.is_cuda:
            return cp.from_dlpack(x)
        return None

    def _check_and_stage(self, inputs: Mapping[str, Any]) -> list[tuple[int, Any, int, bool]]:
        names = [n for n, *_ in self._inputs]
        missing = [n for n in names if n not in inputs]
        extra = [n for n in inputs if n not in names]
        if missing or extra:
            raise InputError("inputs do not match the plan: " + "; ".join(
                ([f"missing {', '.join(map(repr, missing))}"] if missing else [])
                + ([f"unexpected {', '.join(map(repr, extra))}"] if extra else []))
                + f" (the plan takes {', '.join(map(repr, names))})")
        staged = []
        for name, shape, dt, off in self._inputs:
            x = inputs[name]
            dev = self._device_array(x)
            if dev is None:
                if hasattr(x, "detach"):  # a CPU torch tensor
                    x = x.detach().numpy()
                host = np.asarray(x)
                if host.dtype != dt.np and dt.is_int and host.dtype.kind in "iu":
                    host = host.astype(dt.np)  # int32/int64 token ids: converted on the host
                arr, is_dev = host, False
            else:
                arr, is_dev = dev, True
            got_dt = str(arr.dtype)
            if tuple(arr.shape) != shape:
                raise InputError(f"input {name!r}: expected shape {list(shape)}, got {list(arr.shape)}")
            if np.dtype(arr.dtype) != dt.np and not (dt == DType.BF16 and arr.dtype == np.uint16):
                raise InputError(f"input {name!r}: expected dtype {dt.value}, got {got_dt}")
            if is_dev:
                arr = arr if arr.flags.c_contiguous else None
                if arr is None:
                    raise InputError(f"input {name!r}: device arrays must be C-contiguous")
            else:
                arr = np.ascontiguousarray(arr)
            staged.append((off, arr, int(arr.nbytes), is_dev))
        return staged

    @guarded  # one call at a time per device: another thread's call meanwhile raises ConcurrentRunError
    def run(self, inputs: Mapping[str, Any], stream: Any = None, outputs: Mapping[str, Any] | None = None,
            measure: bool = False, nvtx: bool | None = None) -> dict[str, Any]:
        """Run the plan once; see the module docstring for the contract. ``measure``: count what
        the driver does during the run (CUPTI; ``stats()`` reports it). ``nvtx``: NVTX ranges around
        the launches (default: ``FUSEC_NVTX``; see ``fusec.report.nvtx``)."""
        cp = self._cp
        staged = self._check_and_stage(inputs)  # everything refused before any device work
        if outputs is not None:
            for name, arr in outputs.items():
                want = self._outputs.get(name)
                if want is None:
                    raise InputError(f"outputs: the plan has no output {name!r}")
                if not isinstance(arr, cp.ndarray) or arr.shape != want.shape or arr.dtype != want.dtype \
                        or not arr.flags.c_contiguous:
                    raise InputError(f"outputs[{name!r}]: expected a contiguous CuPy array {want.dtype}{list(want.shape)}")
        # Default: the caller's current CuPy stream, so that what the caller does next with the
        # outputs (on that stream) is ordered after the run.
        stream = stream if stream is not None else cp.cuda.get_current_stream()
        self.device.guard.follow(stream, lambda: cp.cuda.Event(disable_timing=True))  # after the last run's stream
        counter = self._allocs
        counter.count = 0
        driver = self.device.counters if measure else None
        if driver is not None and driver.available:
            driver.start()
        t0 = time.perf_counter()
        with counter.hook:
            h2d, d2d = self._stage(staged, stream)
            if nvtx or (nvtx is None and _nvtx.enabled()):
                run_with_ranges(self, stream)
            elif self._graph is not None:
                self._graph.launch(stream)
            else:
                for launch in self._launches:
                    launch(stream)
            result = dict(self._outputs)
            if outputs is not None:
                for name, arr in outputs.items():
                    src = self._outputs[name]
                    cp.cuda.runtime.memcpyAsync(arr.data.ptr, src.data.ptr, src.nbytes, _D2D, stream.ptr)
                    result[name] = arr
        t1 = time.perf_counter()
        if driver is not None and driver.available:
            driver.stop()
        self._measured = None if driver is None else driver
        self._stats = {
            "launches": len(self._launches),
            "graph_replays": 1 if self._graph is not None else 0,
            "pool_allocations": counter.count,  # CuPy memory-pool requests seen by a hook
            "staged_h2d_bytes": h2d,  # the inputs this run copied in, as the executor issued them
            "staged_d2d_bytes": d2d,
            "arena_bytes": int(self.arena.nbytes),
            "weights_bytes": int(self.weights.nbytes),
            "state_bytes": int(self.device.state.nbytes),
            "host_enqueue_ms": (t1 - t0) * 1e3,
        }
        return result

    def _capture(self) -> None:
        # Warm up once outside capture (module load, cuBLAS heuristics), then capture the
        # launch list on a capture-capable (non-default) stream; the graph replays on any stream.
        # The warm-up computes on whatever the arena holds and writes the plan's state (a
        # generation's tokens, caches): the state is put back as it was, so loading a plan, or a
        # CUDA-graph copy of one in use, changes no state.
        cap = self._cp.cuda.Stream(non_blocking=True)
        state = self.device.state
        saved = state.copy() if state.nbytes else None
        self._cp.cuda.get_current_stream().synchronize()
        for launch in self._launches:
            launch(cap)
        cap.synchronize()
        if saved is not None:
            state[...] = saved
            self._cp.cuda.get_current_stream().synchronize()
        cap.begin_capture()
        try:
            for launch in self._launches:
                launch(cap)
        finally:
            graph = cap.end_capture()
        graph.upload(cap)
        cap.synchronize()
        self._graph = graph

    def input_dtypes(self) -> dict[str, Any]:
        """{input name: the numpy dtype the entry takes it in}."""
        return {name: dt.np for name, _, dt, _ in self._inputs}

    def replay(self, stream: Any) -> None:
        """Replay the captured graph on the inputs already staged (benchmarks: no host work)."""
        if self._graph is None:
            raise RuntimeError("replay() needs a plan loaded with cuda_graph=True")
        self._graph.launch(stream)

    def _stage(self, staged: list[tuple[int, Any, int, bool]], stream: Any) -> tuple[int, int]:
        """Enqueue the checked inputs' copies into their arena slots; (H2D bytes, D2D bytes)."""
        h2d = d2d = 0
        for off, arr, n, is_dev in staged:
            if is_dev:
                self._cp.cuda.runtime.memcpyAsync(self._base["arena"] + off, arr.data.ptr, n, _D2D, stream.ptr)
                d2d += n
            else:
                self._cp.cuda.runtime.memcpyAsync(self._base["arena"] + off, arr.ctypes.data, n, _H2D, stream.ptr)
                h2d += n
        return h2d, d2d

    @guarded
    def step(self, inputs: Mapping[str, Any], after: Any) -> None:
        """A diagnostic run (``fusec.debug.bisect``): stage ``inputs``, then the launches one at a
        time, eager (never the CUDA graph), calling ``after(i)`` once launch ``i`` has finished on
        the GPU (one synchronize per launch), while what it wrote is still in the arena."""
        self._one_by_one(inputs, None, after)

    @guarded
    def launch_each(self, inputs: Mapping[str, Any], before: Callable[[int], None]) -> None:
        """Stage ``inputs``, then run launch by launch, synchronizing after each and calling
        ``before(i)`` ahead of launch i and ``before(len(launches))`` at the end (a diagnostic: it
        lets what the GPU records be attributed to launches; ``fusec.runtime.kernel_trace``)."""
        self._one_by_one(inputs, before, None)

    def _one_by_one(self, inputs: Mapping[str, Any], before: Callable[[int], None] | None,
                    after: Callable[[int], None] | None) -> None:
        cp = self._cp
        stream = cp.cuda.Stream(non_blocking=True)
        self.device.guard.follow(stream, lambda: cp.cuda.Event(disable_timing=True))
        self._stage(self._check_and_stage(inputs), stream)
        stream.synchronize()  # the staging copies lie before launch 0
        for i, launch in enumerate(self._launches):
            if before is not None:
                before(i)
            launch(stream)
            stream.synchronize()
            if after is not None:
                after(i)
        if before is not None:
            before(len(self._launches))

    def profile(self, inputs: Mapping[str, Any], repeats: int = 5) -> list[dict[str, Any]]:
        """Time each launch alone (CUDA events around it; synchronizes: a diagnostic, not a run).

        Returns one record per launch, in order: {"index", "label", "kind", "ms"} with the median
        over ``repeats`` runs. Kernel launches run back to back in a normal run, so the sum is an
        upper bound of the eager run's GPU time."""
        cp = self._cp
        stream = cp.cuda.Stream(non_blocking=True)
        self.run(inputs, stream=stream)
        stream.synchronize()
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in self._launches]
        samples: list[list[float]] = [[] for _ in self._launches]
        for _ in range(repeats):
            for launch, (a, b) in zip(self._launches, events):
                a.record(stream)
                launch(stream)
                b.record(stream)
            stream.synchronize()
            for i, (a, b) in enumerate(events):
                samples[i].append(cp.cuda.get_elapsed_time(a, b))
        out = []
        for i, L in enumerate(self.entry["launches"]):
            kind = self.manifest["kernels"][L["kernel"]]["entry"] if L["type"] == "kernel" else \
                f"cublas {L['dtype']} m={L['m']} n={L['n']} k={L['k']} b={L['batch']}"
            rec = {"index": i, "label": L.get("label", ""), "kind": kind, "ms": float(np.median(samples[i]))}
            lt = getattr(self._launches[i], "lt", None)
            if lt is not None:
                rec["algo"] = f"algo {lt.algo_index}/{len(lt.candidates)}"
                rec["kind"] += " " + rec["algo"]
            out.append(rec)
        return out

    def stats(self) -> dict[str, Any]:
        """Counters of the last run. What the driver did (``counters: "cupti"``: syncs, allocations,
        h2d/d2h/d2d bytes, kernel and graph launches, measured by CUPTI for the whole process) or,
        where CUPTI cannot be used, ``counters: "unavailable: <reason>"`` and no such numbers.
        Reading the driver's counters waits for the run to finish (a sync outside the run)."""
        out = dict(self._stats)
        out.update(measured(self._measured))
        return out


def measured(counters: Any) -> dict[str, Any]:
    """The driver's counters of the last region as stats entries (see ``Executor.stats``)."""
    if counters is None:
        return {"counters": "off (not measured: run with measure=True)"}
    if not counters.available:
        return {"counters": f"unavailable: {counters.reason}"}
    res = dict(counters.result())
    res.pop("source", None)
    return {"counters": "cupti", **res}
