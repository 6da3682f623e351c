"""Attributing CUPTI kernel records to a plan's launches (fusec.runtime.kernel_trace) without a GPU:
grouping by clock marks, matching a replay's kernels in order against what each launch ran
eagerly, and the counters' buffer callback handing kernel records to a trace."""

from __future__ import annotations

import math

from fusec.runtime.counters import DriverCounters
from fusec.runtime.kernel_trace import attribute, launch_kernels, split_by_marks


def test_records_fall_between_the_marks_of_their_start() -> None:
    recs = [(5, 9, "before"), (10, 12, "a"), (19, 30, "b"), (20, 21, "c"), (31, 32, "after")]
    assert split_by_marks(recs, [10, 20, 31]) == [[(10, 12, "a"), (19, 30, "b")], [(20, 21, "c")]]
    assert split_by_marks(recs, [10]) == [] and split_by_marks([], [0, 1, 2]) == [[], []]


def test_a_launch_without_kernels_in_the_eager_pass_is_an_error() -> None:
    import pytest

    from fusec.errors import FusecError

    assert launch_kernels([(1, 2, "a"), (3, 4, "b"), (6, 7, "c")], [0, 5, 10]) == [["a", "b"], ["c"]]
    with pytest.raises(FusecError, match="no kernel for launch 1"):  # b's record came before launch 1's mark
        launch_kernels([(100, 110, "a"), (199, 209, "b")], [95, 200, 300])


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


class _FakeCupti:
    """What kernel_records calls of cupti-python, recording the calls; ``fail`` names one that raises."""

    class ActivityKind:
        CONCURRENT_KERNEL = 10

    def __init__(self, fail: str = "") -> None:
        self.fail, self.calls = fail, []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            raise RuntimeError(f"{name}: CUPTI_ERROR_NOT_SUPPORTED")

    def activity_flush_all(self, flag: int) -> None:
        self._call("flush")

    def activity_enable(self, kind: int) -> None:
        self._call("enable")

    def activity_disable(self, kind: int) -> None:
        self._call("disable")


def _traced(monkeypatch, fail: str = ""):  # noqa: ANN001, ANN202
    import cupy

    monkeypatch.setattr(cupy.cuda.runtime, "deviceSynchronize", lambda: None)
    dc = DriverCounters()
    dc.available, dc._cupti = True, _FakeCupti(fail)
    dc._k_driver, dc._k_runtime, dc._k_memcpy, dc._k_memset, dc._k_kernel = 6, 5, 1, 2, 10
    dc._dir, dc._pageable, dc._async_flag = {1: "h2d"}, 1, 1
    clock = iter(range(100, 10**6, 100))
    dc._get_timestamp = lambda: next(clock)
    return dc


def test_kernel_records_leave_nothing_on_when_cupti_refuses(monkeypatch) -> None:  # noqa: ANN001
    import pytest

    from fusec.errors import FusecError

    dc = _traced(monkeypatch, fail="enable")
    with pytest.raises(FusecError, match="no CUPTI kernel records: .*NOT_SUPPORTED"):
        dc.kernel_records(lambda: None)
    assert dc._kernel_sink is None and dc._cupti.calls[-1] == "disable"
    dc = _traced(monkeypatch, fail="disable")  # the window ran; turning records off failed
    with pytest.raises(FusecError, match="CUPTI kernel records failed"):
        dc.kernel_records(lambda: None)
    assert dc._kernel_sink is None


def test_kernel_records_pass_fns_error_on_and_turn_records_off(monkeypatch) -> None:  # noqa: ANN001
    import pytest

    dc = _traced(monkeypatch)

    def boom() -> None:
        raise ValueError("a launch failed")

    with pytest.raises(ValueError, match="a launch failed"):
        dc.kernel_records(boom)
    assert dc._kernel_sink is None and dc._cupti.calls == ["flush", "enable", "flush", "disable"]


def test_kernel_records_keep_the_window_and_report_a_lost_buffer(monkeypatch) -> None:  # noqa: ANN001
    import pytest

    from fusec.errors import FusecError

    dc = _traced(monkeypatch)
    dc._want = False

    def run() -> None:  # the clock read 100 before and reads 200 after: one record each side and one in
        dc._buffer_completed([_Rec(kind=10, start=s, end=s + 5, name=n) for s, n in ((50, "a"), (150, "b"), (250, "c"))])

    assert dc.kernel_records(run) == [(150, 155, "b")]

    def broken() -> None:
        dc._buffer_completed([_Rec(kind=10)])  # a record without its fields: the buffer is lost

    with pytest.raises(FusecError, match="reading CUPTI records failed"):
        dc.kernel_records(broken)


class _KindCupti(_FakeCupti):
    """Records which activity kinds are on."""

    def __init__(self) -> None:
        super().__init__()
        self.on: set[int] = set()

    def activity_enable(self, kind: int) -> None:
        self.calls.append(("enable", kind))
        self.on.add(kind)

    def activity_disable(self, kind: int) -> None:
        self.calls.append(("disable", kind))
        self.on.discard(kind)


def _lazy(monkeypatch):  # noqa: ANN001, ANN202
    """A DriverCounters in lazy mode as _init leaves it: API kinds (5, 6) on, copy kinds (1, 2) off."""
    import cupy

    monkeypatch.setattr(cupy.cuda.runtime, "deviceSynchronize", lambda: None)
    dc = _traced(monkeypatch)
    fake = _KindCupti()
    fake.on = {5, 6}
    dc._cupti, dc._enable, dc._disable = fake, fake.activity_enable, fake.activity_disable
    dc.mode, dc._copy_kinds, dc._names = "lazy", [1, 2], {"d": {}, "r": {}}
    return dc, fake


def test_lazy_counters_trace_copies_from_a_region_to_its_sync(monkeypatch) -> None:  # noqa: ANN001
    dc, fake = _lazy(monkeypatch)
    dc.start()
    assert fake.on == {1, 2, 5, 6}  # the region's copies are recorded
    dc.stop()
    assert fake.on == {1, 2, 5, 6}  # its copies may still be running: on until the sync
    dc.start()
    dc.stop()
    assert fake.calls.count(("enable", 1)) == 1  # no toggling per region
    res = dc.result()
    assert res["source"] == "cupti" and fake.on == {5, 6}  # after result()'s sync: off, API kinds kept
    dc.start()
    assert fake.on == {1, 2, 5, 6}
    dc.quiesce()  # what plan.bind does: bound runs are never measured
    assert fake.on == {5, 6}
    dc.quiesce()
    assert fake.calls.count(("disable", 1)) == 2
