"""A plan entry bound to fixed buffers: ``run()`` is one CUDA-graph launch and nothing else.

``Executor.run`` checks every input, stages it into the arena and measures the driver on each call:
about 20 us of Python, more than a small model's GPU time. ``plan.bind(inputs, outputs)`` moves all
of that to bind time:

    bound = plan.bind({"input_ids": ids_dev}, {"logits": logits_dev})   # caller's CuPy arrays
    ids_dev[...] = next_batch                                            # the caller writes its buffer
    bound.run()                                                          # one graph launch

At bind, the caller's device arrays are checked once (name, shape, dtype, C-contiguous, on the
device) and one CUDA graph is captured: a device-to-device copy from each bound input into its arena
slot, the entry's whole launch list, and a copy from each bound output slot into the caller's array.
Inputs left unbound are read from the plan's own input buffers, ``bound.inputs[name]`` (CuPy views
of the arena slots: write them in place); outputs left unbound are ``bound.outputs[name]`` (views,
valid until the next run). ``run(stream)`` launches that graph on ``stream`` (default: the current
CuPy stream): no checks, no staging, no allocation, no driver counters. ``host_enqueue_ms`` is the
host time of the last ``run()``.

The bound buffers are read and written by address at every replay: the caller keeps them alive and
does not reallocate them; runs of the same plan (bound or not) run one at a time, as for ``run()``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from fusec.errors import InputError

_D2D = 3


class BoundRun:
    def __init__(self, executor: Any, inputs: Mapping[str, Any] | None = None,
                 outputs: Mapping[str, Any] | None = None) -> None:
        import cupy

        self._cp = cupy
        ex = executor
        self.executor = ex
        arena = ex.device.base["arena"]
        slots = {name: (shape, dt, off) for name, shape, dt, off in ex._inputs}
        self.inputs = {name: ex._view(off, shape, dt) for name, (shape, dt, off) in slots.items()}
        self.outputs = dict(ex._outputs)
        copies_in: list[tuple[int, int, int]] = []
        for name, arr in (inputs or {}).items():
            if name not in slots:
                raise InputError(f"bind: the plan has no input {name!r} (inputs: {', '.join(map(repr, slots))})")
            want = self.inputs[name]
            arr = self._check(arr, want, f"input {name!r}")
            copies_in.append((arena + slots[name][2], arr.data.ptr, want.nbytes))
            self.inputs[name] = arr
        copies_out: list[tuple[int, int, int]] = []
        for name, arr in (outputs or {}).items():
            want = self.outputs.get(name)
            if want is None:
                raise InputError(f"bind: the plan has no output {name!r} (outputs: {', '.join(map(repr, self.outputs))})")
            arr = self._check(arr, want, f"output {name!r}")
            copies_out.append((arr.data.ptr, want.data.ptr, want.nbytes))
            self.outputs[name] = arr
        self._keep = (inputs, outputs)  # the caller's arrays stay referenced while bound
        self.host_enqueue_ms: float | None = None
        self._graph = self._capture(copies_in, ex._launches, copies_out)
        # bound runs are never measured: in the counters' "lazy" mode (the default), copy tracing left on
        # by a measured run would cost each launch ~1 us per graph node (a no-op in mode "always")
        if ex.device.attached_counters is not None:
            ex.device.attached_counters.quiesce()

    def _check(self, arr: Any, want: Any, what: str) -> Any:
        cp = self._cp
        if not isinstance(arr, cp.ndarray):
            if hasattr(arr, "__cuda_array_interface__"):
                arr = cp.asarray(arr)  # a view (e.g. a PyTorch CUDA tensor): no copy
            else:
                raise InputError(f"bind: {what} must be a device array (CuPy, or __cuda_array_interface__), "
                                 f"got {type(arr).__name__}")
        if tuple(arr.shape) != tuple(want.shape) or arr.dtype != want.dtype or not arr.flags.c_contiguous:
            raise InputError(f"bind: {what}: expected a C-contiguous {want.dtype}{list(want.shape)} device array, "
                             f"got {arr.dtype}{list(arr.shape)}{'' if arr.flags.c_contiguous else ' (not contiguous)'}")
        return arr

    def _capture(self, copies_in: list[tuple[int, int, int]], launches: list[Any],
                 copies_out: list[tuple[int, int, int]]) -> Any:
        cp = self._cp
        stream = cp.cuda.Stream(non_blocking=True)

        def enqueue() -> None:
            for dst, src, n in copies_in:
                cp.cuda.runtime.memcpyAsync(dst, src, n, _D2D, stream.ptr)
            for launch in launches:
                launch(stream)
            for dst, src, n in copies_out:
                cp.cuda.runtime.memcpyAsync(dst, src, n, _D2D, stream.ptr)

        enqueue()  # once outside capture: cuBLASLt algorithms, lazy module state
        stream.synchronize()
        stream.begin_capture()
        try:
            enqueue()
        finally:
            graph = stream.end_capture()
        graph.upload(stream)
        stream.synchronize()
        return graph

    def run(self, stream: Any = None) -> None:
        """Replay: copy the bound inputs in, run the entry, copy the bound outputs out (one graph
        launch on ``stream``, default the current CuPy stream)."""
        t0 = time.perf_counter()
        self._graph.launch(stream if stream is not None else self._cp.cuda.get_current_stream())
        self.host_enqueue_ms = (time.perf_counter() - t0) * 1e3


def bind(plan: Any, inputs: Mapping[str, Any] | None = None, outputs: Mapping[str, Any] | None = None,
         entry: str | None = None) -> BoundRun:
    """``plan.bind``: a ``BoundRun`` of ``plan``'s entry ``entry`` (default: the first)."""
    return BoundRun(plan._exec(entry), inputs, outputs)
