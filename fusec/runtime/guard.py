"""What a plan promises about threads, streams and memory, in code that needs no GPU to test.

- ``RunGuard``: one call at a time per plan. A plan's entry points and its ``with_cuda_graph``
  copies share one arena, so two runs in flight at once would overwrite each other's values:
  a run entered while another thread's run is in progress raises ``ConcurrentRunError`` at once
  (nothing is enqueued). Consecutive runs on different streams are ordered on the GPU: the new
  stream waits (an event, no host synchronization) for what was enqueued on the previous one.
- ``allocate``: device memory for a plan (arena, weights, state); out of memory is a
  ``DeviceMemoryError`` (a ``MemoryError`` and a ``FusecError``) naming the bytes asked for and
  the bytes free, after CuPy's cached blocks were returned to the driver and the request retried.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from fusec.errors import FusecError


class ConcurrentRunError(FusecError):
    """A plan was run from a second thread while a run was in progress."""


class DeviceMemoryError(FusecError, MemoryError):
    """The GPU has not enough free memory for a plan's buffers; the message says how much."""


def fmt_bytes(n: int) -> str:
    """A byte count for people: 512 B, 44.2 KiB, 39.9 MiB, 1.11 GiB."""
    n = int(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            v = n / size
            return f"{v:.2f} {unit}" if v < 10 else f"{v:.1f} {unit}"
    return f"{n} B"


class RunGuard:
    """One run at a time (see the module docstring); shared by every view of one plan."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._owner_name = ""
        self.last_stream: Any = None

    @contextlib.contextmanager
    def running(self) -> Iterator[RunGuard]:
        if not self._lock.acquire(blocking=False):
            me = threading.current_thread().name
            who = "this thread" if self._owner == threading.get_ident() else f"thread {self._owner_name!r}"
            raise ConcurrentRunError(
                f"plan run from thread {me!r} while {who} is running it: a plan runs one call at a time "
                "(its outputs are views of one arena); serialize the calls (a lock), or load the plan once "
                "per thread")
        self._owner, self._owner_name = threading.get_ident(), threading.current_thread().name
        try:
            yield self
        finally:
            self._owner = None
            self._lock.release()

    def follow(self, stream: Any, make_event: Any) -> bool:
        """Order ``stream`` after the previous run's stream (call inside ``running``): when it
        differs, an event recorded on the previous stream now, which ``stream`` waits for.
        ``make_event()`` makes an event with ``record(stream)``. True when a wait was enqueued."""
        prev, self.last_stream = self.last_stream, stream
        if prev is None or prev is stream or _ptr(prev) == _ptr(stream):
            return False
        ev = make_event()
        ev.record(prev)
        stream.wait_event(ev)
        return True


def _ptr(stream: Any) -> Any:
    return getattr(stream, "ptr", id(stream))


def allocate(cupy: Any, what: str, nbytes: int, zero: bool = False) -> Any:
    """``nbytes`` (at least 1) of device memory as a CuPy uint8 array (zeroed with ``zero``);
    DeviceMemoryError naming ``what``, the bytes asked for and free when the GPU has too little."""
    n = max(int(nbytes), 1)
    make = cupy.zeros if zero else cupy.empty
    oom = cupy.cuda.memory.OutOfMemoryError
    try:
        return make(n, dtype=cupy.uint8)
    except oom:
        pass
    cupy.get_default_memory_pool().free_all_blocks()  # cached blocks of earlier plans go back first
    try:
        return make(n, dtype=cupy.uint8)
    except oom:
        pass
    try:
        free, total = (int(x) for x in cupy.cuda.runtime.memGetInfo())
        room = f"{fmt_bytes(free)} ({free:,} bytes) free of {fmt_bytes(total)}"
    except Exception:  # the numbers are a courtesy; the error is the point
        room = "the free memory is unknown"
    raise DeviceMemoryError(f"out of GPU memory for the plan's {what}: asked for {fmt_bytes(n)} ({n:,} bytes), "
                            f"{room}") from None


def guarded(run: Any) -> Any:
    """Decorate ``Executor.run``: the call holds its device's ``RunGuard`` (``self.device.guard``)."""
    import functools

    @functools.wraps(run)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.device.guard.running():
            return run(self, *args, **kwargs)

    return call
