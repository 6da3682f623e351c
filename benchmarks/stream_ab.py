"""Plans of built-in models at a few rows (M = batch x sequence <= 128: a prefill's, a small encoder request) with their
products on cuBLAS (FUSEC_GEMM_STREAM=0) and on fusec's GEMM (=1; on sm_90 its wgmma form), compiled in one process
and timed in turns as bound CUDA graphs (bench_models.time_cuda, median of the rounds' medians): whether the knob's
default on sm_90 holds beyond the generation prefills it was measured on. Random weights (seed 0); the outputs' relative
difference is printed beside the times.

    python benchmarks/stream_ab.py [--cases gpt2-small:1x128,bert-base:1x128,minilm:4x32] [--dtype fp16] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import time_cuda  # noqa: E402  (the benchmarks' CUDA-event timing, as compare.py's)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="gpt2-small:1x128,bert-base:1x128,minilm:4x32")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import cupy as cp

    import fusec
    from fusec.models import build

    print("| model | batch x seq | launches (cuBLAS / fusec GEMM) | cuBLAS ms | fusec GEMM ms | ratio | max rel diff |")
    print("|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        name, shape = case.split(":")
        b, s = (int(x) for x in shape.split("x"))
        graph = build(name, shapes={"input_ids": (b, s), "attention_mask": (b, s)})
        rng = np.random.default_rng(0)
        inputs = {"input_ids": cp.asarray(rng.integers(0, 1000, (b, s))), "attention_mask": cp.ones((b, s), np.int64)}
        plans, bound, outs = {}, {}, {}
        for knob in ("0", "1"):
            os.environ["FUSEC_GEMM_STREAM"] = knob
            plans[knob] = fusec.compile(graph, dtype=args.dtype, cuda_graph=True)
            out = plans[knob].run(inputs)
            outs[knob] = {k: cp.asnumpy(v).astype(np.float32) for k, v in out.items()}
            bound[knob] = plans[knob].bind(inputs)
        stream = cp.cuda.get_current_stream()
        times: dict[str, list[float]] = {"0": [], "1": []}
        for r in range(args.rounds):
            for knob in (("0", "1") if r % 2 == 0 else ("1", "0")):  # compare.py's timing of a bound plan, in turns
                run = bound[knob].run
                times[knob].append(time_cuda(lambda run=run, st=stream: run(st), warmup=5, iters=20)["median_ms"])
        t0, t1 = statistics.median(times["0"]), statistics.median(times["1"])
        diff = max(float(np.max(np.abs(outs["0"][k] - outs["1"][k])) / (np.max(np.abs(outs["0"][k])) + 1e-30))
                   for k in outs["0"])
        n0, n1 = plans["0"].info()["launches"], plans["1"].info()["launches"]
        print(f"| {name} | {b}x{s} | {n0} / {n1} | {t0:.3f} | {t1:.3f} | {t1 / t0:.3f} | {diff:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
