"""Kernel times inside CUDA-graph replays of a plan, from CUPTI kernel records (GPU only).

    python benchmarks/graph_profile.py MODEL DTYPE B S [OUT.json] [--disable-fusion RULE ...]

``fusec bench --per-kernel`` brackets each launch with CUDA events in an eager run, so a short
kernel's time includes the host's launch gap; its sum exceeds the graph's replay time by 2-3.5x.
This script replays the bound graph (``plan.bind``) with CUPTI's CONCURRENT_KERNEL activity on
and reports, per replay: the wall time between the first kernel's start and the last kernel's end,
the sum of kernel durations, the idle time between kernels (gaps), and each kernel's own time,
grouped by kernel name and listed in launch order for one replay. fusec's driver counters are
turned off (FUSEC_CUPTI=0): CUPTI admits one client per process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

os.environ["FUSEC_CUPTI"] = "0"


def main(argv: list[str]) -> int:
    disable = [argv[i + 1] for i, a in enumerate(argv) if a == "--disable-fusion"]
    pos = [a for i, a in enumerate(argv) if a != "--disable-fusion" and (i == 0 or argv[i - 1] != "--disable-fusion")]
    model, dtype, b, s = pos[0], pos[1], int(pos[2]), int(pos[3])
    out_path = pos[4] if len(pos) > 4 else None
    import cupy as cp
    from cupti import cupti as c

    import fusec
    from fusec.inputs import random_inputs_for

    t0 = time.perf_counter()
    opts = {"disabled_fusions": disable} if disable else {}
    plan = fusec.compile(model, shapes={"input_ids": (b, s), "attention_mask": (b, s)}, dtype=dtype, **opts)
    compile_s = time.perf_counter() - t0
    inputs = {k: cp.asarray(v) for k, v in random_inputs_for(plan.manifest["inputs"], 0).items()}
    bound = plan.bind(inputs)
    for _ in range(20):
        bound.run()
    cp.cuda.Device().synchronize()

    recs: list[tuple[int, int, str]] = []

    def requested() -> tuple[int, int]:
        return 8 << 20, 0

    def completed(acts) -> None:  # noqa: ANN001
        for a in acts:
            if int(a.kind) == int(c.ActivityKind.CONCURRENT_KERNEL):
                recs.append((int(a.start), int(a.end), str(a.name)))

    c.activity_register_callbacks(requested, completed)
    c.activity_enable(c.ActivityKind.CONCURRENT_KERNEL)
    reps = 20
    for _ in range(reps):
        bound.run()
        cp.cuda.Device().synchronize()  # one replay at a time: replays do not overlap in the record
    c.activity_flush_all(1)
    c.activity_disable(c.ActivityKind.CONCURRENT_KERNEL)
    recs.sort()
    n = len(recs) // reps
    per: list[dict] = []
    by_name: dict[str, list[float]] = defaultdict(list)
    for r in range(reps):
        chunk = recs[r * n:(r + 1) * n]
        busy = sum(e - st for st, e, _ in chunk)
        wall = chunk[-1][1] - chunk[0][0]
        per.append({"wall_us": wall / 1e3, "busy_us": busy / 1e3, "gaps_us": (wall - busy) / 1e3})
        if r >= 2:
            for st, e, name in chunk:
                by_name[name].append((e - st) / 1e3)
    med = sorted(per[2:], key=lambda d: d["wall_us"])[len(per[2:]) // 2]
    one = recs[(reps - 1) * n:reps * n]
    seq = [{"name": nm[:120], "us": (e - st) / 1e3, "gap_before_us": (st - one[i - 1][1]) / 1e3 if i else 0.0}
           for i, (st, e, nm) in enumerate(one)]
    groups = sorted(((sum(v) / (reps - 2), len(v) // (reps - 2), k) for k, v in by_name.items()), reverse=True)
    res = {"model": model, "dtype": dtype, "batch": b, "seq": s, "disable_fusion": disable,
           "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "compile_s": compile_s,
           "plan_launches": len(plan.manifest["launches"]),
           "kernels_per_replay": n, "median_replay": med,
           "groups": [{"name": k[:160], "us_per_replay": t, "count": m} for t, m, k in groups],
           "sequence": seq}
    print(f"{model} {dtype} {b}x{s} disable={disable}: {n} kernels per replay; wall {med['wall_us']:.1f} us, "
          f"busy {med['busy_us']:.1f} us, gaps {med['gaps_us']:.1f} us")
    for g in res["groups"][:25]:
        print(f"  {g['us_per_replay']:9.1f} us  x{g['count']:<4d} {g['name'][:110]}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
