"""Counters of what the CUDA driver actually did during a region, measured with NVIDIA CUPTI.

``Executor.run`` used to report ``syncs`` and ``d2h_bytes`` as promises (literals). This module
measures them instead, for the whole process: a synchronization or a copy made by any library
inside the region (CuPy, cuBLAS, PyTorch, ...) is seen, because CUPTI observes the CUDA driver and
runtime APIs themselves, not fusec's own calls.

    counters = DriverCounters.create()      # never raises; one CUPTI client per process
    counters.start()                        # cheap: no sync, no allocation
    ...                                     # the measured region (e.g. one plan run)
    counters.stop()                         # cheap: no sync
    counters.result()                       # {"source": "cupti", "syncs": ..., "d2h_bytes": ...}

How it measures (CUPTI Activity API, through the ``cupti-python`` package):

* activity kinds ``DRIVER`` and ``RUNTIME`` give one record per CUDA API call (name, host
  timestamps, thread, correlation id); ``MEMCPY`` and ``MEMSET`` give one record per copy/set with
  its direction, size, async flag and host memory kind (pageable or pinned), correlated to the API
  call that issued it (also a copy node of a replayed CUDA graph, correlated to the graph launch).
* a region is the host-time window ``[start(), stop()]`` on CUPTI's clock. API records whose start
  lies in the window belong to the region; copy/set records belong to it when they correlate to
  one of those API records (their own timestamps are GPU times and may lie after ``stop()``).
* API calls are classified by name (``classify_api``): synchronize calls, kernel launches, graph
  launches, device/host allocations, frees, copies. When a runtime call (``cudaMalloc``) and a
  driver call of the same class (``cuMemAlloc``) nest on one thread, only the outer one counts.

The counters ``result()`` reports are listed in ``fusec.runtime.driver_records``.

Modes (``FUSEC_CUPTI_MODE``, default ``lazy``): ``always`` enables the activity kinds once, at
``create()``; ``start()``/``stop()`` then only read CUPTI's clock (0.3 to 0.9 us each on an H100),
and of the records CUPTI delivers, those of calls outside the latest region are dropped at once
(cupti-python still makes a Python object of each record of a delivered buffer, on CUPTI's thread).
But with the MEMCPY or MEMSET kind enabled every CUDA-graph launch costs ~1 us of GPU time per
graph node (H100: Qwen3-0.6B's 256-launch prefill 1.497 -> 1.654 ms; benchmarks/cupti_cost.py).
``lazy`` keeps the API kinds on as ``always`` does and turns the copy kinds on at a region's
``start()``, and off again once the region's copies have run: in ``result()`` (after its device
sync) or ``quiesce()`` (``plan.bind`` calls it), so that later runs do not pay the copy kinds' GPU
time. Measured on an H200 (``benchmarks/cupti_modes.py``, GPT-2 small fp16 8x128, a bound CUDA
graph of 90 nodes after one measured run): 0.831 ms with the counters off, 0.898 in ``always``,
0.865 in ``lazy``, where what is left is the API records' host time delaying the launch (the bound
run's host time 10, 60 and 45 us); the measured runs counted the same in both modes, and the
counters, kernel-trace, bench, runtime, end-to-end and generation GPU tests passed in ``lazy``.
(A mode ``toggle`` that turned every kind off at ``stop()`` was removed: it cost ~100 us of host time
per region on an H100 and missed a region's asynchronous copies that ran after ``stop()``.)
In every mode, once CUPTI is attached each CUDA API call of the process costs a little more (about
0.4 us per call on an H100, region or not). ``FUSEC_CUPTI=0`` turns the counters off;
``fusec bench`` and ``fusec ab`` set it for themselves unless it is set (``off_while_timing``).

``result()`` synchronizes the current device and forces a flush of CUPTI's buffers
(``activity_flush_all(1)``): copy records are only written once the device has finished them.
Its own work lies after ``stop()`` and is never counted. It reports the most recent region of the
process (the counters are one process-wide object); regions do not nest: ``start()`` opens a new
one. ``start()``/``stop()`` are meant for one thread; the calls they count may come from any.

Limits: CUPTI sees CUDA API calls and the copies/sets they issue. It cannot see a copy done by a
kernel (e.g. CuPy's copy of a non-contiguous array), implicit synchronization inside a call that
is not a synchronize or blocking copy (``cudaFree``, a ``cudaMemcpyAsync`` to pageable memory: see
``frees`` and ``pageable_memcpys``), CuPy memory-pool reuse, or work of other processes; kernels
inside a replayed graph are not counted (only the graph launch is); ``result()`` synchronizes only
the current device. CUPTI takes one subscriber per process: ``create()`` reports another one
(Nsight Systems, ``torch.profiler``) as unavailable when CUPTI says so; while fusec holds the slot,
such a profiler cannot attach in this process (``FUSEC_CUPTI=0`` leaves it free).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from fusec.errors import FusecError
from fusec.runtime.driver_records import COPY_DIRECTION, aggregate

# ---- the CUPTI client (one per process) -----------------------------------------------------------

_BUFFER_BYTES = 4 << 20
_MODES = ("always", "lazy")


def _unavailable(reason: str) -> dict[str, Any]:
    return {"source": "unavailable", "reason": reason}


class DriverCounters:
    """Process-wide CUDA driver counters (see the module docstring). Use ``create()``."""

    _instance: DriverCounters | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.available = False
        self.reason = "not initialized"
        self.mode = "lazy"
        self._copy_kinds: list[Any] = []  # lazy: MEMCPY and MEMSET, on from a region's start() to its sync
        self._copies_on = False
        self._cupti: Any = None
        self._kinds: list[Any] = []
        self._pending: list[tuple] = []
        self._plock = threading.Lock()
        self._want = False  # a region was opened and its records are not consumed yet
        self._last_records: list[tuple] = []
        self._t0: int | None = None
        self._t1: int | None = None
        self._open = False
        self._region_error: str | None = None
        self._callback_error: str | None = None
        self._last: dict[str, Any] | None = None
        self._subscriber: Any = None
        self._names: dict[str, dict[int, str]] = {}
        self._dir: dict[int, str] = {}
        self._kernel_sink: list[tuple[int, int, str]] | None = None  # kernel_records() collects here
        self._kernel_error: str | None = None
        self._k_kernel = -1

    # -- creation ---------------------------------------------------------------------------
    @classmethod
    def peek(cls) -> DriverCounters | None:
        """The process's counters if ``create()`` has made them, else None; attaches nothing."""
        return cls._instance

    @classmethod
    def forget_unattached(cls) -> None:
        """Drop the process's instance if it never attached CUPTI (made while ``FUSEC_CUPTI=0``, or
        without a GPU), so that a later ``create()`` tries again; an attached one stays."""
        with cls._lock:
            inst = cls._instance
            if inst is not None and not inst.available and inst._cupti is None:
                cls._instance = None

    def describe(self) -> str:
        """One line on what the counters cost timings: off, or on with the tracing that slows
        every CUDA-graph launch (mode ``always``: the copy kinds stay on) or only the host's CUDA
        calls (``lazy``: the copy kinds only inside measured runs)."""
        if not self.available:
            return f"off ({self.reason})"
        if self.mode == "always":
            return (f"on ({self.reason}): CUPTI's copy tracing adds ~1 us of GPU time per node to every "
                    "CUDA-graph launch; FUSEC_CUPTI=0 times without it")
        return (f"on ({self.reason}): copy tracing only inside measured runs; CUPTI's API records add host time to "
                "every CUDA call; FUSEC_CUPTI=0 times without them")

    @classmethod
    def create(cls) -> DriverCounters:
        """The process's counters; never raises. ``available`` False comes with ``reason``."""
        with cls._lock:
            if cls._instance is None:
                inst = cls()
                try:
                    inst._init()
                except Exception as e:  # noqa: BLE001 -- whatever CUPTI says, report it and stay usable
                    inst._fail(f"CUPTI initialization failed: {type(e).__name__}: {_describe(e)}")
                cls._instance = inst
            return cls._instance

    def _fail(self, reason: str) -> None:
        self.available = False
        self.reason = reason
        c = self._cupti
        if c is not None:
            for k in self._kinds:
                try:
                    c.activity_disable(k)
                except Exception:  # noqa: BLE001
                    pass
            if self._subscriber is not None:
                try:
                    c.unsubscribe(self._subscriber)
                except Exception:  # noqa: BLE001
                    pass
                self._subscriber = None

    def _init(self) -> None:
        from fusec import knobs
        from fusec.errors import InputError

        try:
            if not knobs.get("FUSEC_CUPTI"):
                return self._fail("disabled by FUSEC_CUPTI=0")
            mode = knobs.get("FUSEC_CUPTI_MODE")
        except InputError as e:  # a knob's text that is not of its kind: no counters, and why
            return self._fail(str(e))
        self.mode = mode
        try:
            import cupy

            ndev = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # noqa: BLE001
            return self._fail(f"no CUDA GPU (CuPy: {type(e).__name__}: {_describe(e)})")
        if ndev < 1:
            return self._fail("no CUDA GPU (CuPy sees no device)")
        try:
            from cupti import cupti as c
        except Exception as e:  # noqa: BLE001 -- ImportError, or a missing libcupti
            return self._fail(f"cupti-python is not usable ({type(e).__name__}: {_describe(e)}); "
                              "install it with `pip install cupti-python`")
        self._cupti = c

        # Claim the process's one CUPTI subscriber slot, so that a second tool fails loudly
        # instead of silently taking the activity buffers over (and so that we see one that came first).
        # The activity records below need no subscriber: a CUPTI that refuses one for another
        # reason (subscribe_v2 of a newer CUPTI on an older driver) still counts.
        multiple = int(getattr(c.Result, "ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED", -1))
        self._userdata: dict = {}
        self.note = ""
        params = None
        try:
            params = c.SubscriberParams()
            params.struct_size = c.SUBSCRIBER_PARAMS_SIZE
            params.subscriber_name = "fusec.runtime.counters"
            self._subscriber = c.subscribe_v2(_no_callback, self._userdata, params.ptr)
        except Exception as e:  # noqa: BLE001
            first = e
            if getattr(e, "status", None) != multiple:
                try:
                    self._subscriber = c.subscribe(_no_callback, self._userdata)
                    first = None
                except Exception as e2:  # noqa: BLE001
                    first = e2 if getattr(e2, "status", None) == multiple else first
            if first is not None and getattr(first, "status", None) == multiple:
                old = getattr(params, "old_subscriber_name", "") if params is not None else ""
                return self._fail("another CUPTI subscriber exists in this process"
                                  + (f" ({old!r})" if old else "") + f": {_describe(first)}")
            if first is not None:
                self.note = f"; no subscriber slot claimed ({_describe(first)})"

        self._k_driver = int(c.ActivityKind.DRIVER)
        self._k_runtime = int(c.ActivityKind.RUNTIME)
        self._domain = {"d": int(c.CallbackDomain.DRIVER_API), "r": int(c.CallbackDomain.RUNTIME_API)}
        self._names: dict[str, dict[int, str]] = {"d": {}, "r": {}}  # cbid -> API name, filled in result()
        self._dir = {int(m): COPY_DIRECTION.get(m.name, "?") for m in c.ActivityMemcpyKind}
        self._pageable = int(c.ActivityMemoryKind.PAGEABLE)
        self._async_flag = int(c.ActivityFlag.MEMCPY_ASYNC)
        self._k_memcpy = int(c.ActivityKind.MEMCPY)
        self._k_memset = int(c.ActivityKind.MEMSET)
        self._k_kernel = int(c.ActivityKind.CONCURRENT_KERNEL)
        c.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
        kinds = [c.ActivityKind.DRIVER, c.ActivityKind.RUNTIME, c.ActivityKind.MEMCPY, c.ActivityKind.MEMSET]
        for k in kinds:  # enable once to learn now (not inside a run) whether this CUPTI can
            c.activity_enable(k)
            self._kinds.append(k)
        if self.mode == "lazy":
            self._copy_kinds = [c.ActivityKind.MEMCPY, c.ActivityKind.MEMSET]
            for k in self._copy_kinds:
                c.activity_disable(k)
        self._get_timestamp = c.get_timestamp
        self._enable = c.activity_enable
        self._disable = c.activity_disable
        self.available = True
        self.reason = f"CUPTI via cupti-python, mode {self.mode}{self.note}"

    # -- CUPTI buffer callbacks ---------------------------------------------------------------
    def _api_name(self, dom: str, cbid: int) -> str:
        names = self._names[dom]
        name = names.get(cbid)
        if name is None:
            try:
                name = self._cupti.get_callback_name(self._domain[dom], cbid)
                name = name.decode() if isinstance(name, bytes) else str(name)
            except Exception:  # noqa: BLE001
                name = f"cbid{cbid}"
            names[cbid] = name
        return name

    @staticmethod
    def _buffer_requested() -> tuple[int, int]:
        return _BUFFER_BYTES, 0

    def _buffer_completed(self, activities: Any) -> None:
        try:
            self._keep(activities)
        except Exception as e:  # noqa: BLE001 -- runs on a CUPTI thread: report it in result()
            self._callback_error = f"reading CUPTI records failed: {type(e).__name__}: {e}"
            if self._kernel_sink is not None:  # and in kernel_records (a region's start() clears the other)
                self._kernel_error = self._callback_error

    def _keep(self, activities: Any) -> None:
        sink = self._kernel_sink
        if not self._want and sink is None:
            return  # no region and no kernel trace waits for records: drop the buffer unread
        want = self._want
        batch: list[tuple] = []
        keep = batch.append
        kernels: list[tuple[int, int, str]] = []
        kd, kr, kc, ks, kk = self._k_driver, self._k_runtime, self._k_memcpy, self._k_memset, self._k_kernel
        direction, pageable, async_flag = self._dir, self._pageable, self._async_flag
        # Calls outside the latest region are dropped here, cheaply (result() filters exactly).
        t0 = self._t0 if self._t0 is not None else 0
        t1 = self._t1 if self._t1 is not None else 1 << 64
        for a in activities:
            k = int(a.kind)
            if k == kk:
                if sink is not None:
                    kernels.append((int(a.start), int(a.end), str(a.name)))
                continue
            if not want:
                continue
            if k == kd or k == kr:  # the API name is looked up in result(), not on CUPTI's thread
                st = int(a.start)
                if st < t0 or st > t1:
                    continue
                keep(("api", "d" if k == kd else "r", int(a.cbid), st, int(a.end), int(a.correlation_id),
                      int(a.thread_id)))
            elif k == kc:
                flags = int(_field(a, "flags_", "flags"))
                keep(("copy", direction.get(int(a.copy_kind), "?"), int(a.bytes), bool(flags & async_flag),
                      int(a.src_kind) == pageable or int(a.dst_kind) == pageable, int(a.correlation_id),
                      int(getattr(a, "runtime_correlation_id", 0) or 0)))
            elif k == ks:
                keep(("set", int(a.bytes), int(a.correlation_id), int(getattr(a, "runtime_correlation_id", 0) or 0)))
        with self._plock:
            if want:
                self._pending.extend(batch)
            if sink is not None:
                sink.extend(kernels)

    # -- regions ------------------------------------------------------------------------------
    def start(self) -> None:
        """Open a measured region (no sync, no allocation). Ends any region still open."""
        if not self.available:
            return
        # Every record delivered so far belongs to calls made before this point: drop them.
        with self._plock:
            self._pending = []
        self._want = True
        self._last_records = []
        self._region_error = None
        self._callback_error = None
        self._last = None
        if self._copy_kinds and not self._copies_on:
            try:
                for k in self._copy_kinds:
                    self._enable(k)
                self._copies_on = True
            except Exception as e:  # noqa: BLE001
                self._region_error = f"activity_enable failed: {_describe(e)}"
        self._open = True
        self._t1 = None
        self._t0 = self._get_timestamp()

    def stop(self) -> None:
        """Close the region (no sync)."""
        if not self.available or not self._open:
            return
        self._t1 = self._get_timestamp()
        self._open = False

    def result(self) -> dict[str, Any]:
        """Counters of the last closed region (see the module docstring).

        Synchronizes the current device and flushes CUPTI's buffers first (copy records are only
        written once the device has run them); that work lies after the region and is not counted."""
        if not self.available:
            return _unavailable(self.reason)
        if self._last is not None:
            return dict(self._last)
        if self._t0 is None or self._t1 is None:
            return _unavailable("no measured region yet (call start() and stop() first)")
        if self._region_error is not None:
            return _unavailable(self._region_error)
        try:
            try:
                import cupy

                cupy.cuda.runtime.deviceSynchronize()
            except ImportError:
                pass
            self._cupti.activity_flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
        except Exception as e:  # noqa: BLE001
            return _unavailable(f"flushing CUPTI buffers failed: {_describe(e)}")
        self._copies_off()  # the region's copies have run and their records are in
        if self._callback_error is not None:
            return _unavailable(self._callback_error)
        with self._plock:
            records, self._pending = self._pending, []
        self._want = False
        records = [r if r[0] != "api" else (r[0], r[1], self._api_name(r[1], r[2]), *r[3:]) for r in records]
        self._last_records = records  # kept until the next start(), for diagnostics
        self._last = aggregate(records, self._t0, self._t1)
        return dict(self._last)

    def quiesce(self) -> None:
        """Lazy mode: wait for the device, collect what the open or last region's copies recorded,
        and turn the copy kinds off (they cost every graph launch ~1 us per node while on). A setup
        step (``plan.bind`` calls it): it synchronizes. Nothing to do in the other modes."""
        if not self.available or not self._copies_on:
            return
        try:
            import cupy

            cupy.cuda.runtime.deviceSynchronize()
            self._cupti.activity_flush_all(1)
        except Exception as e:  # noqa: BLE001
            self._region_error = f"flushing CUPTI buffers failed: {_describe(e)}"
        self._copies_off()

    def _copies_off(self) -> None:
        if self._copies_on:
            self._copies_on = False
            for k in self._copy_kinds:
                try:
                    self._disable(k)
                except Exception as e:  # noqa: BLE001
                    self._region_error = f"activity_disable failed: {_describe(e)}"

    # -- kernel records (a diagnostic for fusec.runtime.kernel_trace) ---------------------------
    def timestamp(self) -> int:
        """CUPTI's clock now (ns): the clock of the kernel records' start and end."""
        return int(self._get_timestamp())

    def kernel_records(self, fn: Callable[[], None]) -> list[tuple[int, int, str]]:
        """Run ``fn()`` with CUPTI's kernel records on; return (start, end, name) of every kernel
        that started inside it, sorted by start (GPU times on ``timestamp()``'s clock).
        Synchronizes the device before and after. FusecError when CUPTI is not usable here or
        fails (kernel records are then off again and nothing is left collecting); an error of
        ``fn`` itself propagates as it is."""
        if not self.available:
            raise FusecError(f"no CUPTI kernel records: {self.reason}")
        import cupy

        c = self._cupti
        sink: list[tuple[int, int, str]] = []
        self._kernel_error = None
        try:
            cupy.cuda.runtime.deviceSynchronize()
            c.activity_flush_all(1)
            self._kernel_sink = sink
            c.activity_enable(c.ActivityKind.CONCURRENT_KERNEL)
        except Exception as e:  # noqa: BLE001 -- CUPTI or the device refused: say so, leave nothing on
            self._kernel_sink = None
            self._quietly(c.activity_disable, c.ActivityKind.CONCURRENT_KERNEL)
            raise FusecError(f"no CUPTI kernel records: {_describe(e)}") from None
        try:
            t0 = self.timestamp()
            fn()
            cupy.cuda.runtime.deviceSynchronize()
            t1 = self.timestamp()
        finally:
            flushed = self._quietly(c.activity_flush_all, 1)  # delivers the window's records to the sink
            self._kernel_sink = None
            disabled = self._quietly(c.activity_disable, c.ActivityKind.CONCURRENT_KERNEL)
        if flushed or disabled:
            raise FusecError(f"CUPTI kernel records failed: {flushed or disabled}")
        if self._kernel_error is not None:
            raise FusecError(self._kernel_error)
        with self._plock:
            recs = [r for r in sink if t0 <= r[0] <= t1]
        return sorted(recs)

    @staticmethod
    def _quietly(call: Callable[..., Any], *args: Any) -> str:
        """Run a CUPTI call; "" when it succeeded, else what it said."""
        try:
            call(*args)
        except Exception as e:  # noqa: BLE001
            return _describe(e)
        return ""


@contextlib.contextmanager
def off_while_timing(keep: bool = False) -> Iterator[None]:
    """FUSEC_CUPTI=0 inside, unless ``keep`` (the caller needs CUPTI, e.g. for kernel records) or
    FUSEC_CUPTI is set: attached counters add host time to every CUDA call (and in mode ``always`` ~1 us
    of GPU time per node to every graph launch; see the module docstring), which a benchmark must not
    time (``fusec bench``, ``fusec ab``).
    It acts only if the process has not created its counters yet (they are one per process);
    ``DriverCounters.peek().describe()`` says what held."""
    if keep or "FUSEC_CUPTI" in os.environ or DriverCounters.peek() is not None:
        yield
        return
    os.environ["FUSEC_CUPTI"] = "0"
    try:
        yield
    finally:
        os.environ.pop("FUSEC_CUPTI", None)
        DriverCounters.forget_unattached()  # the process's later plans get their counters


def _no_callback(userdata: Any, domain: Any, cbid: Any, data: Any) -> None:
    return None


def _field(obj: Any, *names: str) -> Any:
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    return 0


def _describe(e: BaseException) -> str:
    status = getattr(e, "status", None)
    if status is not None:
        try:
            from cupti import cupti as c

            return f"{c.Result(status).name} ({status}) {e}".strip()
        except Exception:  # noqa: BLE001
            pass
    return str(e) or type(e).__name__


def _reset_for_tests() -> None:
    """Forget the process's instance (tests only; CUPTI itself stays as it is)."""
    with DriverCounters._lock:
        inst = DriverCounters._instance
        if inst is not None and inst.available:
            inst._fail("reset")
        DriverCounters._instance = None
