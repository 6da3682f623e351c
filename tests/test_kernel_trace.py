"""Attributing CUPTI kernel records to a plan's launches (fusec.runtime.kernel_trace) without a GPU:
grouping by clock marks, matching a replay's kernels in order against what each launch ran
eagerly, and the counters' buffer callback handing kernel records to a trace."""

from __future__ import annotations

import math

from fusec.runtime.counters import DriverCounters
from fusec.runtime.kernel_trace import attribute, split_by_marks


def test_records_fall_between_the_marks_of_their_start() -> None:
    recs = [(5, 9, "before"), (10, 12, "a"), (19, 30, "b"), (20, 21, "c"), (31, 32, "after")]
    assert split_by_marks(recs, [10, 20, 31]) == [[(10, 12, "a"), (19, 30, "b")], [(20, 21, "c")]]
    assert split_by_marks(recs, [10]) == [] and split_by_marks([], [0, 1, 2]) == [[], []]


def test_a_replay_is_matched_in_order_and_copies_count_as_other() -> None:
    # launch 0: a fusec kernel; launch 1: cuBLAS with a split-K reduction (two kernels); launch 2: fusec
    expected = [["fc_row"], ["gemm_main", "gemm_reduce"], ["fc_row"]]
    replay = [(0, 2, "memcpy32_post"), (3, 5, "fc_row"), (5, 15, "gemm_main"), (15, 16, "gemm_reduce"),
              (17, 20, "fc_row")]
    times, other = attribute(expected, replay)
    assert times == [2.0, 11.0, 3.0] and other == 2.0
    # the same kernel name twice in a row is two launches, not one
    times, other = attribute([["k"], ["k"]], [(0, 1, "k"), (1, 4, "k")])
    assert times == [1.0, 3.0] and other == 0.0


def test_a_launch_whose_kernels_are_missing_is_nan() -> None:
    times, other = attribute([["a"], ["b"], ["c"]], [(0, 1, "a"), (1, 2, "c"), (2, 5, "x")])
    assert times[0] == 1.0 and math.isnan(times[1]) and math.isnan(times[2])
    assert other == 1.0 + 3.0  # "c" and "x" were skipped looking for "b"


class _Rec:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_buffer_callback_hands_kernel_records_to_a_trace_without_a_region() -> None:
    dc = DriverCounters()
    dc._k_driver, dc._k_runtime, dc._k_memcpy, dc._k_memset, dc._k_kernel = 6, 5, 1, 2, 10
    dc._dir, dc._pageable, dc._async_flag = {1: "h2d"}, 1, 1  # as create() wires them, minus CUPTI
    dc._want = False
    dc._buffer_completed([_Rec(kind=10, start=7, end=9, name="fc_x")])
    assert dc._pending == [] and dc._callback_error is None  # no trace and no region: dropped
    sink: list = []
    dc._kernel_sink = sink
    dc._buffer_completed([_Rec(kind=10, start=7, end=9, name="fc_x"),
                          _Rec(kind=6, cbid=307, start=150, end=151, correlation_id=4, thread_id=9)])
    assert sink == [(7, 9, "fc_x")] and dc._pending == []  # the API record: no region wants it
    dc._want, dc._t0, dc._t1 = True, 100, 200
    dc._buffer_completed([_Rec(kind=10, start=11, end=12, name="fc_y"),
                          _Rec(kind=6, cbid=307, start=150, end=151, correlation_id=4, thread_id=9)])
    assert sink == [(7, 9, "fc_x"), (11, 12, "fc_y")] and dc._pending == [("api", "d", 307, 150, 151, 4, 9)]
