"""CUDA driver counters (fusec.runtime.counters) without a GPU: what an unusable CUPTI reports, the
classification of API names, and the aggregation of CUPTI records into a region's counters."""

from __future__ import annotations

import numbers

import pytest

from fusec.runtime import counters
from fusec.runtime.counters import DriverCounters
from fusec.runtime.driver_records import aggregate, api_base_name, classify_api

_NUMERIC_KEYS = ("syncs", "h2d_bytes", "d2h_bytes", "d2d_bytes", "memcpy_calls", "allocations",
                 "kernel_launches", "graph_launches")


def _usable_here() -> bool:
    from conftest import gpu_available

    if not gpu_available():
        return False
    try:
        from cupti import cupti  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture
def fresh():
    counters._reset_for_tests()
    yield
    counters._reset_for_tests()


def _assert_unavailable(res: dict) -> None:
    assert res["source"] == "unavailable"
    assert isinstance(res["reason"], str) and res["reason"]
    assert not [k for k, v in res.items() if isinstance(v, numbers.Number)], res  # no numbers, no zeros
    assert not set(_NUMERIC_KEYS) & set(res)


def test_create_without_gpu_or_cupti_reports_a_reason(fresh):
    if _usable_here():
        pytest.skip("this machine has a GPU and cupti: tests/test_counters_gpu.py covers it")
    c = DriverCounters.create()
    assert c.available is False
    assert isinstance(c.reason, str) and c.reason
    c.start()  # no-ops, never raise
    c.stop()
    _assert_unavailable(c.result())
    assert c.result()["reason"] == c.reason


def test_disabled_by_environment(fresh, monkeypatch):
    monkeypatch.setenv("FUSEC_CUPTI", "0")
    c = DriverCounters.create()
    assert not c.available and "FUSEC_CUPTI" in c.reason
    _assert_unavailable(c.result())


def test_bad_mode_is_a_reason_not_an_exception(fresh, monkeypatch):
    monkeypatch.setenv("FUSEC_CUPTI_MODE", "sometimes")
    c = DriverCounters.create()
    assert not c.available and "sometimes" in c.reason


def test_create_is_a_process_wide_singleton(fresh, monkeypatch):
    monkeypatch.setenv("FUSEC_CUPTI", "0")
    assert DriverCounters.create() is DriverCounters.create()


def test_cupti_missing_is_reported(fresh, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cupti", None)  # import cupti -> ImportError
    c = DriverCounters.create()
    assert not c.available
    assert "cupti" in c.reason.lower() or "gpu" in c.reason.lower()


@pytest.mark.parametrize("name,base", [
    ("cudaLaunchKernel_v7000", "cudaLaunchKernel"),
    ("cudaLaunchKernel_ptsz_v7000", "cudaLaunchKernel"),
    ("cuMemAlloc_v2", "cuMemAlloc"),
    ("cuLaunchHostFunc_v2_ptsz", "cuLaunchHostFunc"),
    ("cudaStreamSynchronize_ptsz_v7000", "cudaStreamSynchronize"),
    ("cuCtxSynchronize", "cuCtxSynchronize"),
    ("cuMemcpyDtoHAsync_v2_ptsz", "cuMemcpyDtoHAsync"),
])
def test_api_base_name(name, base):
    assert api_base_name(name) == base


@pytest.mark.parametrize("cls,names", [
    ("kernel_launch", ["cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz",
                       "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernelMultiDevice", "cuLaunchGrid",
                       "cuLaunchGridAsync", "cudaLaunchKernel_v7000", "cudaLaunchKernel_ptsz_v7000",
                       "cudaLaunchKernelExC_v11060", "cudaLaunchCooperativeKernel_v9000"]),
    ("graph_launch", ["cuGraphLaunch", "cuGraphLaunch_ptsz", "cudaGraphLaunch_v10000", "cudaGraphLaunch_ptsz_v10000"]),
    ("sync", ["cuCtxSynchronize", "cuCtxSynchronize_v2", "cuStreamSynchronize", "cuStreamSynchronize_ptsz",
              "cuEventSynchronize", "cudaDeviceSynchronize_v3020", "cudaThreadSynchronize_v3020",
              "cudaStreamSynchronize_v3020", "cudaStreamSynchronize_ptsz_v7000", "cudaEventSynchronize_v3020",
              "cudaExecutionCtxSynchronize_v13010"]),
    ("alloc", ["cuMemAlloc_v2", "cuMemAllocPitch_v2", "cuMemAllocManaged", "cuMemAllocAsync", "cuMemAllocAsync_ptsz",
               "cuMemAllocFromPoolAsync", "cuMemCreate", "cudaMalloc_v3020", "cudaMallocAsync_v11020",
               "cudaMallocAsync_ptsz_v11020", "cudaMallocManaged_v6000", "cudaMallocPitch_v3020",
               "cudaMallocFromPoolAsync_v11020", "cudaMalloc3D_v3020"]),
    ("host_alloc", ["cuMemAllocHost_v2", "cuMemHostAlloc", "cudaMallocHost_v3020", "cudaHostAlloc_v3020"]),
    ("free", ["cuMemFree_v2", "cuMemFreeAsync", "cuMemFreeHost", "cudaFree_v3020", "cudaFreeAsync_v11020",
              "cudaFreeHost_v3020"]),
    ("memcpy", ["cuMemcpyHtoD_v2", "cuMemcpyDtoHAsync_v2", "cuMemcpyAsync_ptsz", "cudaMemcpy_v3020",
                "cudaMemcpyAsync_v3020", "cudaMemcpy2DAsync_v3020", "cudaMemcpyPeer_v4000"]),
    ("memset", ["cuMemsetD8_v2", "cuMemsetD32Async", "cudaMemset_v3020", "cudaMemsetAsync_v3020"]),
])
def test_classify_api(cls, names):
    for name in names:
        assert classify_api(name) == cls, name


@pytest.mark.parametrize("name", [
    "cuLaunchHostFunc", "cudaLaunchHostFunc_v10000", "cuStreamWaitEvent", "cudaStreamWaitEvent_v3020",
    "cuStreamQuery", "cudaEventQuery_v3020", "cuEventRecord", "cudaEventRecord_v3020", "cuModuleGetFunction",
    "cuGraphAddMemcpyNode", "cudaGraphAddMemsetNode_v10000", "cuGraphUpload", "cudaGetDevice_v3020",
    "cuGraphAddMemAllocNode", "cuCtxGetCurrent", "cudaStreamBeginCapture_v10000",
])
def test_calls_that_count_nothing(name):
    assert classify_api(name) is None


def _api(dom, name, start, end, corr, tid=1):
    return ("api", dom, name, start, end, corr, tid)


def test_aggregate_counts_only_the_window():
    recs = [
        _api("r", "cudaDeviceSynchronize_v3020", 5, 6, 1),             # before the region
        _api("d", "cuLaunchKernel", 10, 11, 2),
        _api("d", "cuLaunchKernel", 12, 13, 3),
        _api("r", "cudaGraphLaunch_v10000", 14, 15, 4),
        _api("r", "cudaMemcpyAsync_v3020", 16, 17, 5),
        ("copy", "h2d", 4096, True, True, 0, 5),                       # issued by corr 5 (runtime)
        _api("d", "cuMemcpyDtoH_v2", 18, 30, 6),
        ("copy", "d2h", 100, False, True, 6, 0),                       # blocking, issued by corr 6 (driver)
        _api("r", "cudaMemcpyAsync_v3020", 31, 32, 7),
        ("copy", "d2d", 64, True, False, 0, 7),
        _api("r", "cudaMemsetAsync_v3020", 33, 34, 8),
        ("set", 64, 0, 8),
        _api("r", "cudaStreamSynchronize_v3020", 35, 40, 9),
        _api("r", "cudaMallocHost_v3020", 41, 42, 10),
        _api("r", "cudaFree_v3020", 43, 44, 11),
        _api("r", "cudaMemcpyAsync_v3020", 60, 61, 12),                # after the region
        ("copy", "h2d", 1 << 20, True, False, 0, 12),
        ("copy", "d2h", 1 << 20, True, False, 99, 0),                  # issued before the region
    ]
    res = aggregate(recs, 10, 50)
    assert res["source"] == "cupti"
    assert res["kernel_launches"] == 2 and res["graph_launches"] == 1
    assert (res["h2d_bytes"], res["d2h_bytes"], res["d2d_bytes"]) == (4096, 100, 64)
    assert res["memcpy_calls"] == 3 and res["pageable_memcpys"] == 2 and res["memset_calls"] == 1
    assert res["syncs"] == 2 and res["sync_calls"] == {"cuMemcpyDtoH": 1, "cudaStreamSynchronize": 1}
    assert res["allocations"] == 0 and res["host_allocations"] == 1 and res["frees"] == 1
    assert res["api_calls"] == 10


def test_aggregate_matches_copies_as_cupti_numbers_them():
    """As seen on an H100 (CUPTI 13.4): driver and runtime calls share one correlation counter, and
    a copy issued by a runtime call carries that call's id with runtime_correlation_id 0."""
    recs = [
        _api("r", "cudaGetDevice_v3020", 10, 11, 13),
        ("copy", "d2h", 5000, True, True, 14, 0),
        _api("r", "cudaMemcpyAsync_v3020", 12, 13, 14),
        _api("r", "cudaStreamSynchronize_v3020", 14, 15, 15),
        _api("d", "cuLaunchKernel", 16, 17, 16),
        ("copy", "h2d", 3000, True, True, 21, 0),                      # its call came after the region
        _api("r", "cudaMemcpyAsync_v3020", 30, 31, 21),
    ]
    res = aggregate(recs, 10, 20)
    assert (res["d2h_bytes"], res["h2d_bytes"], res["memcpy_calls"]) == (5000, 0, 1)
    assert res["syncs"] == 1 and res["sync_calls"] == {"cudaStreamSynchronize": 1}
    assert res["kernel_launches"] == 1 and res["api_calls"] == 4


def test_aggregate_counts_a_runtime_call_and_its_nested_driver_call_once():
    recs = [
        _api("r", "cudaMalloc_v3020", 10, 20, 1, tid=7),
        _api("d", "cuMemAlloc_v2", 12, 18, 2, tid=7),        # inside cudaMalloc: the same allocation
        _api("d", "cuMemAlloc_v2", 12, 18, 3, tid=8),        # another thread: another allocation
        _api("r", "cudaDeviceSynchronize_v3020", 21, 30, 4, tid=7),
        _api("d", "cuCtxSynchronize", 22, 29, 5, tid=7),
        _api("r", "cudaLaunchKernel_v7000", 31, 33, 6, tid=7),
        _api("d", "cuLaunchKernel", 34, 35, 7, tid=7),        # after it: its own launch
    ]
    res = aggregate(recs, 0, 100)
    assert res["allocations"] == 2
    assert res["syncs"] == 1 and res["sync_calls"] == {"cudaDeviceSynchronize": 1}
    assert res["kernel_launches"] == 2


def test_aggregate_async_region_is_all_zeros_measured():
    recs = [_api("d", "cuLaunchKernel", 10 + i, 10 + i, i) for i in range(5)]
    res = aggregate(recs, 0, 100)
    assert res["kernel_launches"] == 5
    assert all(res[k] == 0 for k in ("syncs", "allocations", "memcpy_calls", "h2d_bytes", "d2h_bytes", "d2d_bytes"))


class _Rec:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _reader(t0, t1):
    """A DriverCounters wired as create() wires it, minus CUPTI (for the buffer callback alone)."""
    dc = DriverCounters()
    dc._k_driver, dc._k_runtime, dc._k_memcpy, dc._k_memset = 6, 5, 1, 2
    dc._dir, dc._pageable, dc._async_flag = {1: "h2d", 2: "d2h", 8: "d2d"}, 1, 1
    dc._t0, dc._t1, dc._want = t0, t1, True
    return dc


def test_buffer_callback_keeps_what_the_region_needs():
    dc = _reader(100, 200)
    dc._buffer_completed([
        _Rec(kind=6, cbid=307, start=150, end=151, correlation_id=4, thread_id=9),   # in the window
        _Rec(kind=5, cbid=41, start=50, end=60, correlation_id=3, thread_id=9),      # before it
        _Rec(kind=5, cbid=41, start=250, end=260, correlation_id=5, thread_id=9),    # after it
        _Rec(kind=1, copy_kind=2, bytes=64, flags_=1, src_kind=3, dst_kind=1, correlation_id=4,
             runtime_correlation_id=0),
        _Rec(kind=2, bytes=32, correlation_id=4, runtime_correlation_id=0),
        _Rec(kind=42),                                                                # another kind
    ])
    assert dc._callback_error is None
    assert dc._pending == [("api", "d", 307, 150, 151, 4, 9), ("copy", "d2h", 64, True, True, 4, 0),
                           ("set", 32, 4, 0)]


def test_buffer_callback_drops_buffers_no_region_waits_for_and_reports_errors():
    dc = _reader(100, 200)
    dc._want = False
    dc._buffer_completed([_Rec(kind=6, cbid=307, start=150, end=151, correlation_id=4, thread_id=9)])
    assert dc._pending == []
    dc._want = True
    dc._buffer_completed([_Rec(kind=1)])  # a record without its fields
    assert dc._callback_error and "AttributeError" in dc._callback_error
