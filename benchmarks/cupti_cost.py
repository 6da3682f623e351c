"""What CUPTI activity tracing costs a bound CUDA-graph launch (GPU only).

    python benchmarks/cupti_cost.py MODEL DTYPE BxS [OUT.json]

fusec's driver counters (fusec.runtime.counters) enable CUPTI's DRIVER, RUNTIME, MEMCPY and MEMSET
activity kinds for the whole process. This script (fusec's counters off: FUSEC_CUPTI=0) binds the
plan once and times ``bound.run()`` (CUDA events around it, and the host time of the call) with no
activity kind enabled, then with each kind alone, then with all four, in one process.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["FUSEC_CUPTI"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cupti_modes import gpu_host_times  # noqa: E402


def main(argv: list[str]) -> int:
    import cupy as cp
    from cupti import cupti as c

    import fusec
    from fusec.inputs import random_inputs_for

    model, dtype, bs = argv[0], argv[1], argv[2]
    b, s = (int(x) for x in bs.split("x"))
    plan = fusec.compile(model, shapes={"input_ids": (b, s), "attention_mask": (b, s)}, dtype=dtype)
    inputs = {k: cp.asarray(v) for k, v in random_inputs_for(plan.manifest["inputs"], 0).items()}
    bound = plan.bind(inputs)
    stream = cp.cuda.Stream(non_blocking=True)

    def measure(n: int = 200) -> dict[str, float]:
        t = gpu_host_times(lambda: bound.run(stream), stream, n)
        return {"median_ms": t["gpu_ms"], "host_ms": t["host_us"] / 1e3}

    c.activity_register_callbacks(lambda: (8 << 20, 0), lambda acts: None)
    kinds = {"driver": c.ActivityKind.DRIVER, "runtime": c.ActivityKind.RUNTIME, "memcpy": c.ActivityKind.MEMCPY,
             "memset": c.ActivityKind.MEMSET}
    res: dict = {"model": model, "dtype": dtype, "shape": bs, "launches": len(plan.manifest["launches"])}
    res["none"] = measure()
    for name, k in kinds.items():
        c.activity_enable(k)
        res[name] = measure()
        c.activity_disable(k)
        c.activity_flush_all(1)
    for k in kinds.values():
        c.activity_enable(k)
    res["all four"] = measure()
    for k in kinds.values():
        c.activity_disable(k)
    c.activity_flush_all(1)
    res["none again"] = measure()
    for k, v in res.items():
        if isinstance(v, dict):
            print(f"{model} {k:>10}: bound median {v['median_ms']:.4f} ms, host {1e3 * v['host_ms']:.1f} us", flush=True)
    if len(argv) > 3:
        with open(argv[3], "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
