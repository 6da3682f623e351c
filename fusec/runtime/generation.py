"""Generation on the GPU: a ``fusec.generation.Engine`` over a generation plan's two entry points.

The decode entry is captured once as a CUDA graph (the plan is compiled with ``cuda_graph``) and
each step is one ``cudaGraphLaunch`` on the engine's stream: the positions, the cache and the
drawn tokens all live in the plan's state region, so nothing is re-captured and nothing crosses
between host and device until the tokens are read back. The decode loop is one measured region:
``stats()["decode"]`` reports what the driver did over all steps (CUPTI) and per step.

For a server (``fusec.serve.batcher``), ``fetch`` reads a state back without waiting: an
asynchronous copy into pinned host memory on the engine's stream and an event behind it; the host
polls the event (``cudaEventQuery``, no synchronization) and keeps decode steps queued meanwhile.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fusec.errors import InputError


class PlanEngine:
    def __init__(self, plan: Any):
        import cupy

        if "generation" not in plan.manifest or set(plan.entries) - {"admit", "join"} != {"prefill", "decode"}:
            raise InputError("this plan cannot generate: compile it with `fusec compile MODEL --generate`")
        self.plan = plan
        self.meta = plan.manifest["generation"]
        self._prefill = plan._exec("prefill")
        self._decode = plan._exec("decode")
        self._admit = plan._exec("admit") if "admit" in plan.entries else None
        self._join = plan._exec("join") if "join" in plan.entries else None
        self.device = self._decode.device
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._events = (cupy.cuda.Event(), cupy.cuda.Event())
        self._steps = 0
        self._prefill_stats: dict[str, Any] = {}
        self._decode_counts: dict[str, Any] = {}
        self.last_prefill_ms: float | None = None
        self._pinned: dict[str, _PinnedPool] = {}  # state name -> page-locked buffers for its reads (fetch)
        self._views: dict[str, Any] = {}  # state name -> its CuPy view (fetch)
        self._staging: _Staging | None = None
        self.syncs = 0  # host synchronizations this engine made (stream or event waits), counted where made
        self.timeline: _Timeline | None = None  # GPU time of each run, when turned on (a server: ``gpu_timeline``)

    def _sync(self) -> None:
        self.syncs += 1
        self.stream.synchronize()

    def gpu_timeline(self) -> dict[str, Any]:
        """GPU time of the runs queued since the first call (timing events around each run, read
        once they completed: no wait). The first call turns the events on."""
        if self.timeline is None:
            self.timeline = _Timeline()
        return self.timeline.poll()

    def _run(self, kind: str, launch: Callable[[], None]) -> None:
        if self.timeline is None:
            launch()
        else:
            self.timeline.around(kind, self.stream, launch)

    def set_state(self, name: str, value: np.ndarray) -> None:
        self._sync()
        self.device.set_state(name, value)

    def write_states(self, values: dict[str, np.ndarray]) -> None:
        """Write several states (whole arrays) without waiting: the values are copied into a
        page-locked staging buffer and the copies queued on the engine's stream, after the work
        queued so far (which still reads the old values) and before any run queued later."""
        if self._staging is None:
            self._staging = _Staging()
        dsts = [self.device.state_array(name) for name in values]
        hosts = [np.ascontiguousarray(np.asarray(v).astype(d.dtype, copy=False)).reshape(d.shape)
                 for v, d in zip(values.values(), dsts)]
        self.syncs += self._staging.copy_in(list(zip(dsts, hosts)), self.stream)

    def fetch(self, name: str) -> _Fetch:
        """State ``name`` as it will be after the work queued so far, without waiting for it (see
        the module docstring): ``ready()`` polls, ``get()`` waits by polling."""
        src = self._views.get(name)
        if src is None:  # made once per state: a server fetches every step
            src = self._views[name] = self.device.state_array(name)
        pool = self._pinned.get(name)
        if pool is None:  # one per state: "cur" every step, or "tokens" every few (fusec.serve.batcher)
            pool = self._pinned[name] = _PinnedPool(src.nbytes)
        return pool.copy(src, self.stream)

    def read_state(self, name: str) -> np.ndarray:
        self._sync()
        return self.device.read_state(name)

    def prefill(self, input_ids: np.ndarray, lengths: np.ndarray, timed: bool = True, measure: bool = False) -> None:
        """Run the prefill (rows with length 0 are left as they are); ``timed``: wait for it and
        record ``last_prefill_ms`` (a server queues it and goes on); ``measure``: count what the
        driver does (attaches the counters: only when asked)."""
        feeds = {"input_ids": np.asarray(input_ids, np.int64), "lengths": np.asarray(lengths, np.int64)}
        if not timed:
            self._run("prefill", lambda: self._queue_run(self._prefill, feeds))
            self._steps = 0
            return
        if measure:  # attach the counters (hundreds of ms the first time) before the timed region
            _ = self.device.counters
        a, b = self._events
        a.record(self.stream)
        self._prefill.run(feeds, stream=self.stream, measure=measure)
        b.record(self.stream)
        b.synchronize()
        self.syncs += 1
        import cupy

        self.last_prefill_ms = float(cupy.cuda.get_elapsed_time(a, b))
        self._prefill_stats = self._prefill.stats()
        self._steps = 0

    def admit(self, feeds: dict[str, np.ndarray]) -> None:
        """One run of the admit entry (``fusec.generation.admit_feeds``), queued on the stream."""
        if self._admit is None:
            raise InputError("this plan has no admit entry (compile it with an admit batch)")
        self._run("admit", lambda: self._queue_run(self._admit, feeds))
        self._steps = 0

    def join(self, feeds: dict[str, np.ndarray]) -> None:
        """One run of the join entry (``fusec.generation.join_feeds``): a decode step of every row
        that also prefills up to J prompts into free rows, queued on the stream."""
        if self._join is None:
            raise InputError("this plan has no join entry (compile it with a join count: --join J)")
        self._run("join", lambda: self._queue_run(self._join, feeds))
        self._steps += 1

    def _queue_run(self, ex: Any, feeds: dict[str, np.ndarray]) -> None:
        """Run entry ``ex`` on the stream, its inputs copied from page-locked memory (``_Staging``):
        queued behind the steps in flight without waiting for them."""
        if self._staging is None:
            self._staging = _Staging()
        want = ex.input_dtypes()  # the entry's own dtypes: no conversion in run
        names = list(feeds)
        views, waits = self._staging.hold([np.asarray(feeds[n]).astype(want.get(n), copy=False)
                                           if n in want else np.asarray(feeds[n]) for n in names])
        self.syncs += waits
        ex.run(dict(zip(names, views)), stream=self.stream, measure=False)
        self._staging.queued(self.stream)

    def decode(self) -> None:
        if self._decode._graph is not None:
            self._run("decode", lambda: self._decode.replay(self.stream))
        else:
            self._run("decode", lambda: self._decode.run({}, stream=self.stream, measure=False))
        self._steps += 1

    def sync(self) -> None:
        self._sync()

    def finished(self) -> bool | None:
        return None  # asking would be a device-to-host copy per step: never

    def measure(self, on: bool) -> None:
        c = self.device.counters
        if not c.available:
            return
        if on:
            self._steps = 0
            c.start()
        else:
            c.stop()
            self._decode_counts = c.result()  # waits for the steps to finish (outside the region)

    def stats(self) -> dict[str, Any]:
        from fusec.runtime.executor import measured

        launches = len(self._decode.entry["launches"])
        layers = int(self.meta.get("num_layers", 0)) or 1
        decode: dict[str, Any] = {"steps": self._steps, "launches_per_step": launches,
                                  "kernels_per_layer": round(launches / layers, 2),
                                  "cuda_graph": self._decode._graph is not None}
        c = self.device.attached_counters
        if c is None:
            decode["counters"] = "off (not measured: generate with measure=True, fusec generate --stats)"
        elif not c.available:
            decode["counters"] = f"unavailable: {c.reason}"
        elif self._decode_counts:
            decode["counters"] = "cupti"
            counts = {k: v for k, v in self._decode_counts.items() if isinstance(v, (int, float)) and k != "region_ms"}
            decode["total"] = counts
            steps = max(self._steps, 1)
            decode["per_step"] = {k: counts.get(k, 0) / steps for k in
                                  ("syncs", "allocations", "h2d_bytes", "d2h_bytes", "kernel_launches", "graph_launches")}
        prefill = dict(self._prefill_stats) or measured(None)
        return {"backend": "cuda", "prefill": prefill, "decode": decode}


_H2D, _D2H = 1, 2  # cudaMemcpyKind


class _Staging:
    """Page-locked buffers for host-to-device copies, taken in turn: a buffer is reused once the
    copies out of it have run (its event). When the next one is still busy the ring grows by one
    (a host allocation, made only until the ring covers the copies in flight) up to ``max_slots``;
    past that the host waits for it (a synchronization, counted). A copy from pageable memory may
    wait for the stream's queued work before it returns (CUDA's documentation of cudaMemcpyAsync;
    measured: 2.8 ms of host time per join step at 32 rows on the H100, benchmarks/RESULTS.md);
    from these it only queues."""

    def __init__(self, max_slots: int = 32):
        self._slots: list[tuple[Any, Any, int]] = []  # (pinned memory, event, bytes)
        self._max, self._next = max_slots, 0
        self._open: Any = None  # the event of the slot last handed out by ``hold``

    def hold(self, arrays: list[np.ndarray]) -> tuple[list[np.ndarray], int]:
        """Copies of ``arrays`` in page-locked memory, valid until the copies out of them that the
        caller queues (then ``queued``) have run; and the waits made (0 or 1) for a slot."""
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // 16) * 16
        i, slots, waits = self._next, self._slots, 0
        busy = i < len(slots) and not slots[i][1].done  # its copies have not run yet
        if i == len(slots) or (busy and len(slots) < self._max):
            slots.insert(i, self._new(total))  # the busy one, if any, comes next in turn
        else:
            if busy:
                slots[i][1].synchronize()
                waits = 1
            if slots[i][2] < total:  # too small: a bigger one in its place
                slots[i] = self._new(total)
        self._next = (i + 1) % len(slots)
        mem, self._open, size = slots[i]
        buf = np.frombuffer(mem, np.uint8, size)
        views = []
        for a, off in zip(arrays, offsets):
            a = np.ascontiguousarray(a)
            view = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
            view[...] = a
            views.append(view)
        return views, waits

    @staticmethod
    def _new(nbytes: int) -> tuple[Any, Any, int]:
        import cupy

        size = max(nbytes, 256)
        return cupy.cuda.alloc_pinned_memory(size), cupy.cuda.Event(disable_timing=True), size

    def queued(self, stream: Any) -> None:
        """The copies out of the last ``hold`` are queued on ``stream``: its slot is free once they ran."""
        self._open.record(stream)

    def copy_in(self, pairs: list[tuple[Any, np.ndarray]], stream: Any) -> int:
        """Queue ``dst <- host`` for each pair on ``stream``; returns the waits made (0 or 1)."""
        import cupy

        views, waits = self.hold([host for _, host in pairs])
        for (dst, _), view in zip(pairs, views):
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr, view.ctypes.data, view.nbytes, _H2D, stream.ptr)
        self.queued(stream)
        return waits


class _Timeline:
    """GPU time of an engine's runs from timing events recorded before and after each, read once
    the second has completed (``cudaEventElapsedTime`` on completed events: no wait). Per kind of
    run: count and milliseconds; and ``starved``: runs queued when the GPU had already finished
    everything before them (it waited for the host)."""

    def __init__(self) -> None:
        self._spare: list[Any] = []
        self._open: collections.deque[tuple[str, Any, Any]] = collections.deque()
        self._last: Any = None  # the end event of the run queued last
        self._last_read = False  # ``poll`` has read it (reused once another run is queued)
        self.runs: dict[str, int] = {}
        self.ms: dict[str, float] = {}
        self.starved = 0

    def _event(self) -> Any:
        import cupy

        return self._spare.pop() if self._spare else cupy.cuda.Event()

    def around(self, kind: str, stream: Any, launch: Callable[[], None]) -> None:
        if self._last is not None and self._last.done:
            self.starved += 1
        if self._last_read:
            self._spare.append(self._last)
        a = self._event()
        a.record(stream)
        launch()
        b = self._event()
        b.record(stream)
        self._open.append((kind, a, b))
        self._last, self._last_read = b, False

    def poll(self) -> dict[str, Any]:
        import cupy

        while self._open and self._open[0][2].done:
            kind, a, b = self._open.popleft()
            self.runs[kind] = self.runs.get(kind, 0) + 1
            self.ms[kind] = self.ms.get(kind, 0.0) + float(cupy.cuda.get_elapsed_time(a, b))
            self._spare.append(a)
            if b is self._last:
                self._last_read = True
            else:
                self._spare.append(b)
        return {"runs": dict(self.runs), "gpu_ms": {k: round(v, 3) for k, v in self.ms.items()},
                "gpu_ms_per_run": {k: round(v / self.runs[k], 4) for k, v in self.ms.items()},
                "starved_runs": self.starved}


class _Fetch:
    """One asynchronous read-back (``PlanEngine.fetch``)."""

    def __init__(self, pool: _PinnedPool, slot: int, event: Any, nbytes: int, dtype: Any, shape: tuple[int, ...]):
        self._pool, self._slot, self._event = pool, slot, event
        self._spec = (nbytes, dtype, shape)
        self._value: np.ndarray | None = None

    def ready(self) -> bool:
        return self._value is not None or bool(self._event.done)

    def get(self, poll_s: float = 50e-6) -> np.ndarray:
        if self._value is None:
            while not self._event.done:  # cudaEventQuery: no synchronization, the GIL is released
                time.sleep(poll_s)
            nbytes, dtype, shape = self._spec
            count = nbytes // np.dtype(dtype).itemsize
            self._value = np.frombuffer(self._pool.buffer(self._slot), dtype, count).reshape(shape).copy()
            self._pool.release(self._slot)
        return self._value


class _PinnedPool:
    """Page-locked host buffers (and their events) for ``fetch``, allocated once and reused."""

    def __init__(self, nbytes: int, slots: int = 16):
        import cupy

        self.nbytes = nbytes
        self._mem = [cupy.cuda.alloc_pinned_memory(max(nbytes, 64)) for _ in range(slots)]
        self._free = list(range(slots))
        self._events = [cupy.cuda.Event(disable_timing=True) for _ in range(slots)]

    def buffer(self, slot: int) -> Any:
        return self._mem[slot]  # a CuPy PinnedMemoryPointer: numpy reads it through the buffer protocol

    def copy(self, src: Any, stream: Any) -> _Fetch:
        import cupy

        if src.nbytes > self.nbytes:
            raise ValueError(f"fetch: {src.nbytes} bytes, the pool holds {self.nbytes}")
        if not self._free:  # more reads in flight than slots: one more buffer (a host allocation)
            self._mem.append(cupy.cuda.alloc_pinned_memory(max(self.nbytes, 64)))
            self._events.append(cupy.cuda.Event(disable_timing=True))
            self._free.append(len(self._mem) - 1)
        slot = self._free.pop()
        cupy.cuda.runtime.memcpyAsync(self._mem[slot].ptr, src.data.ptr, src.nbytes, _D2H, stream.ptr)
        event = self._events[slot]
        event.record(stream)
        return _Fetch(self, slot, event, src.nbytes, src.dtype, tuple(src.shape))

    def release(self, slot: int) -> None:
        self._free.append(slot)


def generate_with_plan(plan: Any, prompts: Sequence[Any], max_new_tokens: int, seed: int = 0, stream_every: int = 0,
                       on_tokens: Callable[[list[list[int]]], None] | None = None, chat: bool = False,
                       sampling: Any = None, measure: bool = False) -> Any:
    """Generate from a generation plan (``fusec compile --generate``) on the GPU: ``prompts`` are
    token-id lists, or strings when the plan carries a tokenizer; ``sampling`` one
    ``fusec.sampling.Sampling`` for every prompt or one per prompt (default greedy); ``measure``:
    driver counters in ``stats`` (``fusec.generation.iter_generate``). The plan's engine (weights
    uploaded, decode step captured) is made once and kept on the plan."""
    from fusec.genmodel import encode_prompts, plan_tokenizer
    from fusec.textgen import run

    engine = getattr(plan, "_engine", None)
    if engine is None:
        engine = plan._engine = PlanEngine(plan)
    tok = plan_tokenizer(plan)
    ids = encode_prompts(tok, prompts, chat)
    res = run(engine, ids, tok, int(engine.meta["vocab_size"]), max_new_tokens=max_new_tokens, seed=seed,
              stream_every=stream_every, on_tokens=on_tokens, sampling=sampling, measure=measure)
    res.backend = "cuda"
    return res
