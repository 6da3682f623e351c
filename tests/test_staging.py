"""The page-locked staging ring of ``PlanEngine.write_states`` (fusec.runtime.generation._Staging) on
the CPU, with CuPy's pinned allocation, events and copies replaced by fakes that record what would
reach the driver: slots are reused in turn, a slot still being copied out of is waited for (and
counted), a slot too small is replaced, and every copy reads the bytes it was given."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")


_STREAM = type("Stream", (), {"ptr": 7})()


class _Event:
    def __init__(self, disable_timing: bool = True):
        self.done, self.waited = True, 0

    def record(self, stream):
        self.done = False  # the copies queued before it have not run yet

    def synchronize(self):
        self.done, self.waited = True, self.waited + 1


class _Dst:
    def __init__(self, nbytes: int, ptr: int):
        self.nbytes, self.data = nbytes, type("P", (), {"ptr": ptr})()


@pytest.fixture
def fakes(monkeypatch):
    pinned: dict[int, bytearray] = {}
    copies: list[tuple[int, bytes]] = []

    class _Mem(bytearray):  # page-locked host memory: bytes numpy reads, at a pointer the copies name
        def __init__(self, size):
            super().__init__(size)
            self.ptr = ctypes.addressof((ctypes.c_char * size).from_buffer(self))  # as CuPy's: the buffer's address
            pinned[self.ptr] = self

    def memcpy(dst, src, n, kind, stream):
        base = max(p for p in pinned if p <= src)
        copies.append((dst, bytes(pinned[base][src - base:src - base + n])))

    monkeypatch.setattr(cupy.cuda, "alloc_pinned_memory", _Mem)
    monkeypatch.setattr(cupy.cuda, "Event", _Event)
    monkeypatch.setattr(cupy.cuda.runtime, "memcpyAsync", memcpy)
    return pinned, copies


def test_slots_are_reused_in_turn_the_ring_grows_while_busy_then_waits_and_a_small_slot_is_replaced(fakes):
    from fusec.runtime.generation import _Staging

    pinned, copies = fakes
    stage = _Staging(max_slots=2)
    a, b = np.arange(4, dtype=np.int64), np.full(3, 0.5, np.float32)
    dst_a, dst_b = _Dst(a.nbytes, 100), _Dst(b.nbytes, 200)
    assert stage.copy_in([(dst_a, a), (dst_b, b)], stream=_STREAM) == 0  # a new slot: nothing to wait for
    assert copies == [(100, a.tobytes()), (200, b.tobytes())]
    assert stage.copy_in([(dst_a, a + 1)], stream=_STREAM) == 0  # the first is busy: a second, no wait
    assert len(pinned) == 2
    assert stage.copy_in([(dst_a, a + 2)], stream=_STREAM) == 1  # at the limit: waits for the busy first
    assert len(pinned) == 2 and copies[-1] == (100, (a + 2).tobytes())
    for _, event, _ in stage._slots:
        event.synchronize()  # the copies ran
    assert stage.copy_in([(dst_a, a + 3)], stream=_STREAM) == 0  # the second, idle now: reused as it is
    assert len(pinned) == 2 and copies[-1] == (100, (a + 3).tobytes())
    big = np.arange(100, dtype=np.int64)
    assert stage.copy_in([(_Dst(big.nbytes, 300), big)], stream=_STREAM) == 0  # the first: idle but too small
    assert len(pinned) == 3 and copies[-1] == (300, big.tobytes())


def test_an_entry_runs_on_its_inputs_held_in_page_locked_memory_in_its_own_dtypes(fakes):
    """``PlanEngine._queue_run``: the entry's run reads its inputs out of the staging ring (so its
    copies only queue), converted to the entry's dtypes, and the slot is marked busy behind them."""
    from fusec.dtypes import DType
    from fusec.runtime.generation import PlanEngine

    pinned, _ = fakes
    seen = []

    class _Entry:
        def input_dtypes(self):
            return {"input_ids": DType.I64.np, "row": DType.I64.np}

        def run(self, feeds, stream=None, measure=False):
            seen.append({n: (a.ctypes.data, a.dtype, a.tolist()) for n, a in feeds.items()})

    engine = PlanEngine.__new__(PlanEngine)
    engine._staging, engine.syncs, engine.stream = None, 0, _STREAM
    engine._queue_run(_Entry(), {"input_ids": np.array([[5, 6, 7]], np.int32), "row": np.array([2])})
    (mem,) = pinned.values()
    lo, hi = mem.ptr, mem.ptr + len(mem)
    assert {n: (dt, v) for n, (_, dt, v) in seen[0].items()} == {"input_ids": (np.int64, [[5, 6, 7]]), "row": (np.int64, [2])}
    assert all(lo <= p < hi for p, _, _ in seen[0].values())
    assert engine._staging._slots[0][1].done is False  # recorded behind the run: reused only once it ran
