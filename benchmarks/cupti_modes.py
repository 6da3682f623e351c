"""What fusec's driver counters cost a plan's later runs, by counters mode (GPU only).

    python benchmarks/cupti_modes.py OUT_DIR [--model gpt2-small] [--shape 8x128] [--dtype fp16] [--runs 200]

Compiles the plan once and saves it (in the temp directory). Then, in one fresh process a mode (the counters are
one per process: ``FUSEC_CUPTI=0``, ``FUSEC_CUPTI_MODE=always``, ``FUSEC_CUPTI_MODE=lazy``), it loads the plan, makes
one measured run (which attaches the counters and reads their result), binds the inputs (``plan.bind`` quiesces the
counters) and times with CUDA events: bound launches, unmeasured ``plan.run`` calls, measured ones, and bound launches
again. The measured runs' counters are reported too, so that the modes can be compared on what they count as well as
on what they cost. (The counters' host overheads alone, per mode and step: benchmarks/cupti_check.py.)
Writes OUT_DIR/cupti_modes.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {"off": {"FUSEC_CUPTI": "0"}, "always": {"FUSEC_CUPTI_MODE": "always"}, "lazy": {"FUSEC_CUPTI_MODE": "lazy"}}
COUNTS = ("syncs", "allocations", "h2d_bytes", "d2h_bytes", "kernel_launches", "graph_launches")


def gpu_host_times(fn, stream, n: int, warm: int = 10) -> dict:  # noqa: ANN001
    """Medians over ``n`` calls of ``fn()`` (after ``warm`` untimed ones): its GPU time between two CUDA events on
    ``stream`` (``gpu_ms``; it includes the host's time to issue the work where that is longer) and the host time of
    the call (``host_us``). Synchronizes after each call."""
    import cupy as cp

    for _ in range(warm):
        fn()
    stream.synchronize()
    gpu, host = [], []
    for _ in range(n):
        a, e = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        e.record(stream)
        e.synchronize()
        gpu.append(cp.cuda.get_elapsed_time(a, e))
    return {"gpu_ms": statistics.median(gpu), "host_us": statistics.median(host)}


def child(plan_path: str, runs: int) -> dict:
    import cupy as cp

    import fusec
    from fusec.inputs import random_inputs_for
    from fusec.runtime.counters import DriverCounters

    plan = fusec.load(plan_path)
    inputs = {k: cp.asarray(v) for k, v in random_inputs_for(plan.manifest["inputs"], 0).items()}
    stream = cp.cuda.Stream(non_blocking=True)
    plan.run(inputs, stream=stream, measure=True)  # attaches the counters (unless FUSEC_CUPTI=0)

    def counted() -> dict:  # what the last run's driver counters said
        s = plan.stats()
        return {k: s.get(k) for k in (*COUNTS, "counters")}

    def measured() -> None:
        plan.run(inputs, stream=stream, measure=True)

    out = {"first_counts": counted()}
    bound = plan.bind(inputs)
    out["bound"] = gpu_host_times(lambda: bound.run(stream), stream, runs)
    out["run"] = gpu_host_times(lambda: plan.run(inputs, stream=stream, measure=False), stream, runs)
    out["measured_run"] = gpu_host_times(measured, stream, max(10, runs // 10))
    out["counts"] = []
    for _ in range(3):
        measured()
        out["counts"].append(counted())
    out["bound_after"] = gpu_host_times(lambda: bound.run(stream), stream, runs)
    inst = DriverCounters.peek()
    out["describe"] = inst.describe() if inst is not None else "not created"
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--shape", default="8x128")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print("RESULT " + json.dumps(child(a.child, a.runs)), flush=True)
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    b, s = (int(x) for x in a.shape.split("x"))
    plan_path = Path(tempfile.gettempdir()) / f"cupti_modes_{a.model}_{a.dtype}_{a.shape}.fplan"  # not in OUT_DIR
    env0 = dict(os.environ, FUSEC_CUPTI="0")
    t = time.time()
    if not plan_path.exists():
        shape = f"({b}, {s})"
        shapes = f"{{'input_ids': {shape}, 'attention_mask': {shape}}}"
        code = f"import fusec, sys; fusec.compile(sys.argv[1], shapes={shapes}, dtype=sys.argv[2]).save(sys.argv[3])"
        subprocess.run([sys.executable, "-c", code, a.model, a.dtype, str(plan_path)], env=env0, check=True)
    print(f"plan {plan_path.name}: {time.time() - t:.1f} s", flush=True)
    res: dict = {"model": a.model, "dtype": a.dtype, "shape": a.shape, "runs": a.runs, "modes": {}}
    for name, env in MODES.items():
        e = {k: v for k, v in os.environ.items() if k not in ("FUSEC_CUPTI", "FUSEC_CUPTI_MODE")} | env
        p = subprocess.run([sys.executable, __file__, str(out), "--runs", str(a.runs), "--child", str(plan_path)],
                           env=e, capture_output=True, text=True)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            res["modes"][name] = {"error": (p.stderr or p.stdout)[-2000:]}
            print(f"{name}: failed\n{p.stderr[-2000:]}", flush=True)
            continue
        res["modes"][name] = json.loads(line[len("RESULT "):])
    print("| mode | counters | bound, ms | run(), ms | measured run, ms (host us) | bound after, ms | "
          "measured counts (3 runs) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in res["modes"].items():
        if "error" in r:
            print(f"| {name} | failed | | | | | |")
            continue
        cs = "; ".join(",".join(f"{k}={c.get(k)}" for k in COUNTS) for c in r["counts"])
        m = r["measured_run"]
        print(f"| {name} | {r['describe']} | {r['bound']['gpu_ms']:.4f} | {r['run']['gpu_ms']:.4f} | "
              f"{m['gpu_ms']:.4f} ({m['host_us']:.0f}) | {r['bound_after']['gpu_ms']:.4f} | {cs} |")
    (out / "cupti_modes.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
