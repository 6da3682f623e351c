"""Host overhead of the CUPTI driver counters (fusec.runtime.counters), and what they report.

    python benchmarks/cupti_check.py                 # every mode, each in its own process; a table
    python benchmarks/cupti_check.py --mode always   # one mode, JSON on stdout
    python benchmarks/cupti_check.py --stages        # what each step of attaching CUPTI costs
    python benchmarks/cupti_check.py --dump          # the raw CUPTI records of one small region

Per mode, in one process: host microseconds (the minimum of 3 medians) of an iteration of K tiny
kernel launches and of a fusec plan run (gpt2-tiny, eager and CUDA graph): before CUPTI is
attached (baseline; plan baselines come from mode ``none``, a process run with FUSEC_CUPTI=0),
then with the counters created and no region open (idle; plans run with measure=False; in mode
``always`` the API records are written already), then with every iteration in a region (plans: the
executor's own start()/stop(), measure=True), also as a mean over back-to-back regions (buffer
reading included); start() and stop() alone; result() after one region. Host times only: the
launches are asynchronous and the GPU keeps up (synchronized every 50 iterations, outside timings)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

_SRC = r'extern "C" __global__ void inc(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.0f; }'


def _median_us(fn, iters: int, sync=None, every: int = 50) -> float:
    samples = []
    for i in range(iters):
        if sync is not None and i % every == 0:
            sync()
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def _setup():
    import cupy

    inc = cupy.RawModule(code=_SRC).get_function("inc")
    x = cupy.zeros(1024, cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    args = (x, np.int32(1024))

    def kernels(k: int):
        def run():
            for _ in range(k):
                inc((4,), (256,), args, stream=stream)
        return run

    stream.synchronize()
    return cupy, stream, kernels


def _plans(cupy, stream) -> dict:
    """gpt2-tiny plan runs, eager and CUDA graph: {name: run(measure)}. Building a plan creates the
    counters (fusec's executor wraps every run in a region unless measure=False)."""
    plans = {}
    try:
        import fusec
        from fusec.inputs import random_inputs
        from fusec.loader import load_graph

        inputs = random_inputs(load_graph("gpt2-tiny"), seed=0)
        dev_inputs = {k: cupy.asarray(v) for k, v in inputs.items()}
        for graph in (False, True):
            plan = fusec.compile("gpt2-tiny", dtype="fp16", cuda_graph=graph)
            plan.run(dev_inputs, stream=stream, measure=False)
            plans["plan_graph" if graph else "plan_eager"] = (
                lambda measure, p=plan: p.run(dev_inputs, stream=stream, measure=measure))
    except Exception as e:  # noqa: BLE001 -- the kernel loops still say what matters
        print(f"(no fusec plan: {type(e).__name__}: {e})", file=sys.stderr)
    stream.synchronize()
    return plans


def _best(out: dict, key: str, fn, iters: int, sync) -> None:
    """The minimum of 3 medians (interleaving callers' loops gives less noise than one long run)."""
    v = _median_us(fn, iters, sync)
    out[key] = min(v, out.get(key, v))


_ITERS = {"k1": 2000, "k20": 600, "plan_eager": 200, "plan_graph": 400}


def one_mode(mode: str) -> dict:
    """Mode ``none`` runs with FUSEC_CUPTI=0 (no CUPTI in the process): the baselines."""
    os.environ["FUSEC_CUPTI_MODE" if mode != "none" else "FUSEC_CUPTI"] = mode if mode != "none" else "0"
    cupy, stream, kernels = _setup()
    sync = stream.synchronize
    loops = {"k1": kernels(1), "k20": kernels(20)}
    out: dict = {"mode": mode, "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    for fn in loops.values():
        fn()
    for _ in range(3):  # before CUPTI is attached
        for name, fn in loops.items():
            _best(out, f"{name}_baseline_us", fn, _ITERS[name], sync)
    from fusec.runtime.counters import DriverCounters

    t = time.perf_counter()
    dc = DriverCounters.create()  # before the plans, so that this is what attaches CUPTI
    out["create_ms"] = (time.perf_counter() - t) * 1e3
    out["available"], out["reason"] = dc.available, dc.reason
    plans = _plans(cupy, stream)
    if mode == "none":
        for _ in range(3):
            for name, run in plans.items():
                _best(out, f"{name}_baseline_us", lambda run=run: run(False), _ITERS[name], sync)
        return out
    if not dc.available:
        return out

    def region(fn):
        def wrapped():
            dc.start()
            fn()
            dc.stop()
        return wrapped

    # idle: CUPTI attached, no region; region: wrapped in start()/stop() (plans: the executor's own).
    work = {name: (fn, region(fn)) for name, fn in loops.items()}
    work.update({name: (lambda run=run: run(False), lambda run=run: run(True)) for name, run in plans.items()})
    for _ in range(3):
        for name, (idle, measured) in work.items():
            _best(out, f"{name}_idle_us", idle, _ITERS[name], sync)
            _best(out, f"{name}_region_us", measured, _ITERS[name], sync)
    for name, (_idle, measured) in work.items():
        out[f"{name}_region_overhead_us"] = out[f"{name}_region_us"] - out[f"{name}_idle_us"]
        if f"{name}_baseline_us" in out:
            out[f"{name}_idle_overhead_us"] = out[f"{name}_idle_us"] - out[f"{name}_baseline_us"]
        # Mean, not median, of region runs back to back with no result(): the CUPTI buffers that
        # fill meanwhile are read on CUPTI's thread, a cost a median would hide.
        sync()
        t = time.perf_counter()
        for _ in range(5 * _ITERS[name]):
            measured()
        out[f"{name}_region_mean_us"] = (time.perf_counter() - t) / (5 * _ITERS[name]) * 1e6
        measured()
        out[f"{name}_counts"] = {k: v for k, v in dc.result().items() if v}
        samples = []
        for _ in range(100 if name.startswith("plan") else 200):
            measured()
            t = time.perf_counter()
            dc.result()
            samples.append(time.perf_counter() - t)
        out[f"{name}_result_us"] = statistics.median(samples) * 1e6

    # start() and stop() alone, around nothing.
    starts, stops = _time_pairs(dc, 5000)
    out["start_us"], out["stop_us"] = statistics.median(starts) * 1e6, statistics.median(stops) * 1e6
    return out


def _time_pairs(dc, n: int):
    starts, stops = [], []
    for _ in range(n):
        a = time.perf_counter()
        dc.start()
        b = time.perf_counter()
        dc.stop()
        c = time.perf_counter()
        starts.append(b - a)
        stops.append(c - b)
    return starts, stops


def stages() -> dict:
    """What each step of attaching CUPTI costs a loop of 20 launches, in one process (no fusec)."""
    from cupti import cupti as c

    cupy, stream, kernels = _setup()
    k20, sync = kernels(20), stream.synchronize
    k20()

    def measure() -> float:
        return min(_median_us(k20, 600, sync) for _ in range(3))

    out = {"baseline": measure()}
    ud: dict = {}
    params = c.SubscriberParams()
    params.struct_size = c.SUBSCRIBER_PARAMS_SIZE
    params.subscriber_name = "cupti_check"
    sub = c.subscribe_v2(lambda *a: None, ud, params.ptr)
    out["subscribed"] = measure()
    c.activity_register_callbacks(lambda: (4 << 20, 0), lambda acts: None)
    out["buffer_callbacks"] = measure()
    api = [c.ActivityKind.DRIVER, c.ActivityKind.RUNTIME]
    copies = [c.ActivityKind.MEMCPY, c.ActivityKind.MEMSET]
    for k in api:
        c.activity_enable(k)
    out["api_records_on"] = measure()
    for k in copies:
        c.activity_enable(k)
    out["api_and_copy_records_on"] = measure()
    for k in api + copies:
        c.activity_disable(k)
    out["all_off_again"] = measure()
    for k in api + copies:
        samples = []
        for _ in range(200):
            t = time.perf_counter()
            c.activity_enable(k)
            c.activity_disable(k)
            samples.append(time.perf_counter() - t)
        out[f"enable_disable_{k.name}_us"] = statistics.median(samples) * 1e6
    c.unsubscribe(sub)
    return out


def dump() -> None:
    import cupy

    from fusec.runtime.counters import DriverCounters

    dc = DriverCounters.create()
    print("available:", dc.available, dc.reason)
    if not dc.available:
        return
    inc = cupy.RawModule(code=_SRC).get_function("inc")
    x = cupy.zeros(1024, cupy.float32)
    d = cupy.ones(5000, cupy.uint8)
    h = np.ones(3000, np.uint8)
    pool = cupy.cuda.MemoryPool()
    inc((4,), (256,), (x, np.int32(1024)))
    cupy.cuda.Device().synchronize()
    dc.start()
    inc((4,), (256,), (x, np.int32(1024)))
    cupy.cuda.Device().synchronize()
    d.get()
    d[:3000].set(h)
    d2 = cupy.empty_like(d)
    d2.data.copy_from_device_async(d.data, 5000, cupy.cuda.get_current_stream())
    with cupy.cuda.using_allocator(pool.malloc):
        y = cupy.empty(1 << 20, cupy.uint8)
    cupy.cuda.Stream.null.synchronize()
    dc.stop()
    res = dc.result()
    for r in dc._last_records[:80]:
        print("  ", r)
    print("result:", json.dumps(res))
    del y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["none", "lazy", "always"])
    ap.add_argument("--dump", action="store_true")
    ap.add_argument("--stages", action="store_true", help="what each step of attaching CUPTI costs 20 launches")
    ap.add_argument("--json", help="write every mode's numbers here")
    args = ap.parse_args()
    if args.dump:
        return dump()
    if args.stages:
        print(json.dumps(stages()))
        return
    if args.mode:
        print(json.dumps(one_mode(args.mode)))
        return
    rows = []
    for mode in ("none", "lazy", "always"):
        env = dict(os.environ, FUSEC_CUPTI="0") if mode == "none" else dict(os.environ)
        p = subprocess.run([sys.executable, __file__, "--mode", mode], capture_output=True, text=True, env=env)
        if p.stderr.strip():
            print(f"mode {mode} stderr:\n{p.stderr[-1500:]}")
        if p.returncode != 0:
            continue
        rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k.endswith("_counts")}))
    base = {k: v for r in rows if r["mode"] == "none" for k, v in r.items() if k.endswith("_baseline_us")}
    print("\nhost us per iteration (min of 3 medians): baseline (no CUPTI) / idle (CUPTI attached, no region;"
          " +vs baseline) / region (+vs idle), region mean; result() us")
    for r in rows:
        for w in ("k1", "k20", "plan_eager", "plan_graph"):
            b = r.get(f"{w}_baseline_us", base.get(f"{w}_baseline_us"))
            line = f"{r['mode']:>6} {w:>10}: " + (f"{b:8.1f}" if b is not None else "       -")
            if f"{w}_region_us" in r:
                idle = r[f"{w}_idle_us"]
                line += (f" / {idle:8.1f} ({idle - b:+6.1f})" if b is not None else f" / {idle:8.1f}")
                line += (f" / {r[f'{w}_region_us']:8.1f} ({r[f'{w}_region_overhead_us']:+6.1f}),"
                         f" mean {r[f'{w}_region_mean_us']:8.1f}; result {r[f'{w}_result_us']:8.1f}")
            print(line)
        if "start_us" in r:
            print(f"{r['mode']:>6} start() {r['start_us']:.2f} us, stop() {r['stop_us']:.2f} us, "
                  f"create {r['create_ms']:.1f} ms ({r['reason']})")


if __name__ == "__main__":
    main()
