"""The engine's GPU timeline (fusec.runtime.generation._Timeline) on the CPU, with CuPy's events
faked: each run's time is read from the events around it once the second has completed (never
waited for), runs are counted per kind, a run queued after the GPU finished everything before it
counts as starved, and events are reused."""

from __future__ import annotations

import pytest

cupy = pytest.importorskip("cupy")


class _Clock:
    now = 0.0


class _Event:
    made = 0

    def __init__(self, *a, **kw):
        _Event.made += 1
        self.at, self.done = None, True

    def record(self, stream):
        self.at, self.done = _Clock.now, False

    def finish(self):
        self.done = True


def test_runs_are_timed_from_their_events_once_complete(monkeypatch):
    from fusec.runtime.generation import _Timeline

    monkeypatch.setattr(cupy.cuda, "Event", _Event)
    monkeypatch.setattr(cupy.cuda, "get_elapsed_time", lambda a, b: (b.at - a.at) * 1e3)
    t = _Timeline()

    def run(kind, ms):
        def launch():
            _Clock.now += ms / 1e3  # the run's GPU time, as the end event will record it
        t.around(kind, None, launch)

    run("decode", 1.5)
    run("join", 2.5)
    assert t.poll()["runs"] == {}  # nothing completed yet: nothing read, nothing waited for
    first = t._open[0]
    first[2].finish()
    got = t.poll()
    assert got["runs"] == {"decode": 1} and got["gpu_ms"] == {"decode": 1.5}
    for _, a, b in list(t._open):
        b.finish()
    got = t.poll()
    assert got["runs"] == {"decode": 1, "join": 1} and got["gpu_ms_per_run"] == {"decode": 1.5, "join": 2.5}
    assert got["starved_runs"] == 0  # each run was queued while the one before was in flight
    run("decode", 1.0)  # the join had completed: the GPU waited for this one
    t._open[-1][2].finish()
    got = t.poll()
    assert got["starved_runs"] == 1 and got["runs"]["decode"] == 2 and got["gpu_ms"]["decode"] == 2.5
    made = _Event.made
    for _ in range(5):  # steady state: events come back for reuse
        run("decode", 1.0)
        t._open[-1][2].finish()
        t.poll()
    assert _Event.made - made <= 2
