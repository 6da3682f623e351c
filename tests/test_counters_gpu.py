"""CUDA driver counters (fusec.runtime.counters) on a GPU: each counter equals what a region did,
measured by CUPTI, for CuPy calls, library calls (cuBLAS), other threads and fusec's executor.

Allocations are raw driver allocations (cudaMalloc & co.): a CuPy memory-pool hit is none, so the
regions below either warm the pool (expecting 0) or use a fresh pool (expecting exactly 1)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("cupti", reason="cupti-python is not installed")

_SRC = r"""
extern "C" __global__ void inc(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


@pytest.fixture(scope="module")
def dc():
    from fusec.runtime.counters import DriverCounters

    c = DriverCounters.create()
    assert c.available, c.reason  # cupti imports and a GPU is here: CUPTI must work
    return c


@pytest.fixture(scope="module")
def kit():
    import cupy

    mod = cupy.RawModule(code=_SRC)
    inc, spin = mod.get_function("inc"), mod.get_function("spin")
    x = cupy.zeros(1024, cupy.float32)
    inc((4,), (256,), (x, np.int32(1024)))  # loads the module now, not inside a region
    stream = cupy.cuda.Stream(non_blocking=True)
    inc((4,), (256,), (x, np.int32(1024)), stream=stream)
    stream.synchronize()
    cupy.cuda.Device().synchronize()
    return {"cp": cupy, "inc": inc, "spin": spin, "x": x, "stream": stream}


def _launch(kit, stream=None):
    kit["inc"]((4,), (256,), (kit["x"], np.int32(1024)), stream=stream)


def _check_syncs(res):
    assert res["syncs"] == sum(res["sync_calls"].values()), res  # every sync is attributed to a call


def test_create_is_one_object_per_process(dc):
    from fusec.runtime.counters import DriverCounters

    assert DriverCounters.create() is dc and DriverCounters.create().available


def test_region_counts_each_thing_done(dc, kit):
    cp = kit["cp"]
    k, n_d2h, n_h2d, n_d2d, n_alloc = 7, 3 * 4096 + 4, 5000, 8192, 1 << 20
    d_src = cp.ones(n_d2h, cp.uint8)
    h_src = np.full(n_h2d, 3, np.uint8)
    d_dst = cp.empty(n_h2d, cp.uint8)
    a, b = cp.ones(n_d2d, cp.uint8), cp.empty(n_d2d, cp.uint8)
    pool = cp.cuda.MemoryPool()  # a fresh pool: its first malloc is one cudaMalloc
    gs = cp.cuda.Stream(non_blocking=True)
    gs.begin_capture()
    for _ in range(3):
        _launch(kit, gs)
    graph = gs.end_capture()
    graph.upload(gs)
    gs.synchronize()
    cp.cuda.Device().synchronize()

    dc.start()
    for _ in range(k):
        _launch(kit)
    cp.cuda.Device().synchronize()
    host = d_src.get()
    d_dst.set(h_src)
    b.data.copy_from_device_async(a.data, n_d2d, cp.cuda.get_current_stream())
    with cp.cuda.using_allocator(pool.malloc):
        fresh = cp.empty(n_alloc, cp.uint8)
    graph.launch(gs)
    dc.stop()
    res = dc.result()
    print("full region:", res)

    assert res["source"] == "cupti"
    assert res["kernel_launches"] == k  # the graph's 3 kernels are no launches
    assert res["graph_launches"] == 1
    assert (res["d2h_bytes"], res["h2d_bytes"], res["d2d_bytes"]) == (n_d2h, n_h2d, n_d2d)
    assert res["memcpy_calls"] == 3
    assert res["allocations"] == 1
    assert res["sync_calls"].get("cudaDeviceSynchronize") == 1
    assert res["syncs"] >= 2  # the device sync, and get() waits for its copy (blocking copy or stream sync)
    _check_syncs(res)
    assert int(host[0]) == 1 and cp.asnumpy(d_dst)[0] == 3
    assert dc.result() == res  # result() is stable and its own sync/flush is not counted
    del fresh
    pool.free_all_blocks()


def test_async_launches_on_preallocated_memory_count_no_sync_copy_or_allocation(dc, kit):
    k = 25
    dc.start()
    for _ in range(k):
        _launch(kit, kit["stream"])
    dc.stop()
    res = dc.result()
    print("async region:", res)
    assert res["source"] == "cupti" and res["api_calls"] >= k  # measured, not assumed
    assert res["kernel_launches"] == k
    assert res["syncs"] == 0 and res["sync_calls"] == {}
    assert res["allocations"] == 0 and res["frees"] == 0
    assert res["memcpy_calls"] == 0 and res["h2d_bytes"] == res["d2h_bytes"] == res["d2d_bytes"] == 0


def test_cupy_pool_hits_are_not_driver_allocations(dc, kit):
    cp = kit["cp"]
    n = (1 << 20) + 512
    warm = cp.empty(n, cp.uint8)
    del warm  # the block goes back to CuPy's pool
    dc.start()
    again = cp.empty(n, cp.uint8)  # served by the pool: no cudaMalloc
    dc.stop()
    assert dc.result()["allocations"] == 0
    pool = cp.cuda.MemoryPool()
    dc.start()
    with cp.cuda.using_allocator(pool.malloc):
        fresh = cp.empty(n, cp.uint8)
    dc.stop()
    assert dc.result()["allocations"] == 1
    del again, fresh
    pool.free_all_blocks()


def test_only_the_region_is_counted(dc, kit):
    cp = kit["cp"]
    d = cp.ones(4096, cp.uint8)
    cp.cuda.Device().synchronize()
    dc.start()
    _launch(kit)
    dc.stop()
    cp.cuda.Device().synchronize()  # after the region: not counted
    d.get()
    _launch(kit)
    res = dc.result()
    assert res["kernel_launches"] == 1
    assert res["syncs"] == 0 and res["memcpy_calls"] == 0 and res["d2h_bytes"] == 0


def test_start_stop_do_not_wait_and_late_copies_are_flushed(dc, kit):
    """A copy still queued behind a ~200 ms kernel when stop() returns is counted by result()."""
    cp = kit["cp"]
    s = kit["stream"]
    n = 1 << 16
    a, b = cp.ones(n, cp.uint8), cp.empty(n, cp.uint8)
    cp.cuda.Device().synchronize()
    clock_hz = cp.cuda.Device().attributes["ClockRate"] * 1e3
    t0 = time.perf_counter()
    kit["spin"]((1,), (1,), (np.int64(0.2 * clock_hz),), stream=s)
    dc.start()
    b.data.copy_from_device_async(a.data, n, s)
    dc.stop()
    host_s = time.perf_counter() - t0
    busy = not s.done
    res = dc.result()
    total_s = time.perf_counter() - t0
    assert busy, "the copy finished before stop(): the check means nothing"
    assert total_s > 0.1 and host_s < 0.5 * total_s, (host_s, total_s)
    assert res["d2d_bytes"] == n and res["memcpy_calls"] == 1 and res["syncs"] == 0 and res["kernel_launches"] == 0


def test_another_threads_sync_is_seen(dc, kit):
    cp = kit["cp"]

    def other():
        cp.cuda.Stream.null.synchronize()

    t = threading.Thread(target=other)
    dc.start()
    t.start()
    t.join()
    dc.stop()
    res = dc.result()
    assert res["syncs"] == 1 and sum(res["sync_calls"].values()) == 1, res


def test_library_launches_are_seen(dc, kit):
    cp = kit["cp"]
    a = cp.ones((256, 256), cp.float32)
    c = a @ a  # cuBLAS: handle, workspace and output block exist after this
    del c
    cp.cuda.Device().synchronize()
    dc.start()
    c = a @ a
    dc.stop()
    res = dc.result()
    print("cuBLAS matmul region:", res)
    assert res["kernel_launches"] >= 1 and res["syncs"] == 0 and res["allocations"] == 0
    del c


def _axpb_executor(n: int, cuda_graph: bool):
    import cupy
    from cupy_backends.cuda.libs import nvrtc

    from fusec.runtime.executor import Executor

    src = r"""extern "C" __global__ void axpb(float* y, const float* x, const float* w, float b, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = w[i] * x[i] + b; }"""
    cc = cupy.cuda.Device().compute_capability
    p = nvrtc.createProgram(src, "t.cu", [], [])
    nvrtc.compileProgram(p, [f"--gpu-architecture=sm_{cc}"])
    w = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    blobs = {"weights": w.tobytes(), "cubin/m0": nvrtc.getCUBIN(p)}
    y_off = ((n * 4 + 255) // 256) * 256
    manifest = {
        "memory": {"arena_bytes": 2 * y_off, "weights_bytes": w.nbytes},
        "modules": [{"id": "m0", "cubin": "cubin/m0", "source": "source/m0"}],
        "kernels": [{"module": "m0", "entry": "axpb", "smem": 0}],
        "launches": [{"type": "kernel", "kernel": 0, "grid": [(n + 127) // 128, 1, 1], "block": [128, 1, 1],
                      "smem": 0, "args": [["ptr", "arena", y_off], ["ptr", "arena", 0], ["ptr", "weights", 0],
                                          ["f32", 0.5], ["i32", n]], "label": "axpb"}],
        "inputs": [{"name": "x", "shape": [n], "dtype": "f32", "offset": 0}],
        "outputs": [{"name": "y", "shape": [n], "dtype": "f32", "offset": y_off}],
    }
    return Executor(manifest, lambda k: blobs[k], cuda_graph=cuda_graph)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_executor_run_measured(dc, kit, cuda_graph):
    """What Executor.run asserts (no sync, no D2H, no allocation) holds when measured."""
    cp = kit["cp"]
    n = 10_000
    ex = _axpb_executor(n, cuda_graph)
    x_host = np.ones(n, np.float32)
    x_dev = cp.asarray(x_host)
    ex.run({"x": x_dev})
    cp.cuda.Device().synchronize()
    for x, h2d, d2d in ((x_host, x_host.nbytes, 0), (x_dev, 0, x_host.nbytes)):
        dc.start()
        ex.run({"x": x})
        dc.stop()
        res = dc.result()
        print(f"executor run (graph={cuda_graph}, {'host' if h2d else 'device'} input):", res)
        assert res["syncs"] == 0 and res["d2h_bytes"] == 0 and res["allocations"] == 0
        assert res["h2d_bytes"] == h2d and res["d2d_bytes"] == d2d and res["memcpy_calls"] == 1
        assert res["pageable_memcpys"] == (1 if h2d else 0)  # numpy input: async copy from pageable memory
        assert (res["kernel_launches"], res["graph_launches"]) == ((0, 1) if cuda_graph else (1, 0))


def test_a_sync_and_a_copy_injected_into_a_plan_run_are_counted(dc, kit):
    """Issue 8's check: stats() of a real plan run counts a synchronize and a device-to-host copy
    that something inside the run made (here: one launch of the list is wrapped to do both)."""
    cp = kit["cp"]
    import fusec

    plan = fusec.compile("gpt2-tiny", dtype="fp16")
    from fusec.inputs import random_inputs
    from fusec.loader import load_graph

    inputs = random_inputs(load_graph("gpt2-tiny"), seed=1)
    plan.run(inputs, measure=True)
    clean = plan.stats()
    assert clean["counters"] == "cupti" and clean["syncs"] == 0 and clean["d2h_bytes"] == 0
    ex = plan._exec()
    probe = cp.arange(1000, dtype=cp.float32)  # 4000 bytes, allocated before the run
    inner = ex._launches[3]

    def leaky(stream):
        inner(stream)
        cp.cuda.Device().synchronize()  # a sync inside the run ...
        probe.get()  # ... and a D2H copy (CuPy: cudaMemcpyAsync + a stream sync)

    ex._launches[3] = leaky
    plan.run(inputs, measure=True)
    s = plan.stats()
    print("injected:", {k: s[k] for k in ("syncs", "d2h_bytes", "sync_calls")})
    assert s["syncs"] >= 2 and s["d2h_bytes"] == probe.nbytes
    assert s["sync_calls"].get("cudaDeviceSynchronize", 0) + s["sync_calls"].get("cuCtxSynchronize", 0) >= 1
