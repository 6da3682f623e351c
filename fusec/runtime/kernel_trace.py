"""Each launch's GPU time inside CUDA-graph replays, from CUPTI's kernel records (GPU only, except
the pure ``attribute``).

Timing launches one by one with CUDA events (``Executor.profile``) counts the host's launch gap
into a short kernel's time: on an H100 those sums were 2-3.5x a plan's graph replay. Inside a
replay the GPU runs the kernels back to back, and CUPTI records each kernel's start and end:

1. an eager pass (``Executor.launch_each``) takes CUPTI's clock before each launch, so every kernel
   record falls between two marks: the names of the kernels each launch runs (a cuBLAS call may
   run more than one, a fusec launch runs one);
2. ``replays`` bound-graph replays (``plan.bind``), one at a time, with CUPTI's clock read between
   them; each replay's records are matched in order against those names (``attribute``). A kernel
   no launch ran eagerly (the graph's copies of bound inputs) counts as ``other``.

A launch's time is the median over replays of the sum of its kernels' durations; the replay's wall
time (first start to last end), busy time (all durations) and gaps (wall - busy) come with it.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fusec.errors import FusecError

Record = tuple[int, int, str]  # start ns, end ns, kernel name


def split_by_marks(records: Sequence[Record], marks: Sequence[int]) -> list[list[Record]]:
    """Records grouped by the window [marks[i], marks[i + 1]) their start falls in (len(marks) - 1
    groups; records outside every window are dropped)."""
    groups: list[list[Record]] = [[] for _ in range(max(0, len(marks) - 1))]
    for r in records:
        i = bisect.bisect_right(marks, r[0]) - 1
        if 0 <= i < len(groups):
            groups[i].append(r)
    return groups


def launch_kernels(eager: Sequence[Record], marks: Sequence[int]) -> list[list[str]]:
    """The kernel names each launch ran in the eager pass (records between its mark and the next).
    Every launch runs at least one kernel: one with none means records were lost, or stamped
    before their launch's mark, and any attribution would charge a neighbour: FusecError."""
    expected = [[name for _, _, name in g] for g in split_by_marks(eager, marks)]
    empty = next((i for i, names in enumerate(expected) if not names), None)
    if empty is not None:
        raise FusecError(f"CUPTI recorded no kernel for launch {empty} in the eager pass")
    return expected


def attribute(expected: Sequence[Sequence[str]], replay: Sequence[Record]) -> tuple[list[float], float]:
    """(ns per launch, ns of unmatched kernels) for one replay's records, sorted by start, matched
    in order against the kernel names each launch ran eagerly. A launch whose kernels are not all
    found gets NaN; a record that matches the next expected name is never skipped."""
    times = [0.0] * len(expected)
    other = 0.0
    j = 0
    for i, names in enumerate(expected):
        for name in names:
            while j < len(replay) and replay[j][2] != name:
                other += replay[j][1] - replay[j][0]
                j += 1
            if j == len(replay):
                times[i] = float("nan")
                continue
            times[i] += replay[j][1] - replay[j][0]
            j += 1
    other += sum(e - s for s, e, _ in replay[j:])
    return times, other


def covered(rec: list[tuple[int, int, Any]]) -> int:
    """Nanoseconds covered by at least one of the records' [start, end) intervals."""
    total, reach = 0, None
    for s, e, _ in sorted(rec, key=lambda r: r[0]):
        if reach is None or s >= reach:
            total += e - s
            reach = e
        elif e > reach:
            total += e - reach
            reach = e
    return total


def graph_launch_times(plan: Any, inputs: Mapping[str, Any], replays: int = 20,
                       entry: str | None = None) -> dict[str, Any]:
    """Per-launch median ms over ``replays`` bound-graph replays of ``plan`` (see the module doc):
    {"ms": [...], "wall_ms", "busy_ms", "gaps_ms", "other_ms", "overlap_ms", "replays",
    "kernels_per_launch"}. busy: the time at least one kernel ran; overlap: the kernel times beyond
    it (kernels launched with PDL run into the one before them), so the kernels' own times add up to
    busy + overlap.
    FusecError when CUPTI's kernel records are not available in this process."""
    import cupy

    from fusec.runtime.counters import DriverCounters

    if replays < 1:
        raise FusecError(f"replays must be >= 1, got {replays}")

    counters = DriverCounters.create()
    if not counters.available:
        raise FusecError(f"no CUPTI kernel records: {counters.reason}")
    marks: list[int] = []
    eager = counters.kernel_records(
        lambda: plan.launch_each(inputs, lambda i: marks.append(counters.timestamp()), entry=entry))
    expected = launch_kernels(eager, marks)
    bound = plan.bind({k: cupy.asarray(v) for k, v in inputs.items()}, entry=entry)  # bind takes device arrays
    for _ in range(3):
        bound.run()
    cupy.cuda.runtime.deviceSynchronize()
    rmarks: list[int] = []

    def replay_all() -> None:
        for _ in range(replays):
            rmarks.append(counters.timestamp())
            bound.run()
            cupy.cuda.runtime.deviceSynchronize()
        rmarks.append(counters.timestamp())

    per_replay = split_by_marks(counters.kernel_records(replay_all), rmarks)
    times, walls, busies, others, kernel_sums = [], [], [], [], []
    for rec in per_replay:
        if not rec:
            continue
        t, other = attribute(expected, rec)
        times.append(t)
        others.append(other)
        walls.append(max(e for _, e, _ in rec) - rec[0][0])
        busies.append(covered(rec))
        kernel_sums.append(sum(e - s for s, e, _ in rec))
    if not times:
        raise FusecError("CUPTI recorded no kernel during the graph replays")
    arr = np.array(times)
    lost = np.isnan(arr).all(axis=0)
    if lost.any():
        bad = int(lost.argmax())
        raise FusecError(f"launch {bad}'s kernels {expected[bad]} were not found in the graph replays")
    ms = np.nanmedian(arr, axis=0) * 1e-6
    return {"ms": [float(x) for x in ms], "wall_ms": float(np.median(walls)) * 1e-6,
            "busy_ms": float(np.median(busies)) * 1e-6, "gaps_ms": float(np.median(walls) - np.median(busies)) * 1e-6,
            "other_ms": float(np.median(others)) * 1e-6, "replays": len(times),
            "overlap_ms": float(np.median(kernel_sums) - np.median(busies)) * 1e-6,
            "kernels_per_launch": [len(x) for x in expected]}
