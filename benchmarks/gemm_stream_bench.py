"""fusec's GEMM in its stream form (few rows of A, a weight read once; K split over thread-block clusters) alone,
against cuBLAS (CuPy's matmul: N calls in a row, which CuPy cannot capture) at a prefill's product shapes: a CUDA
graph of N launches, the median of 5 replays, us a launch. With --ncu, launches each variant once for Nsight Compute instead.

    python benchmarks/gemm_stream_bench.py [--shapes qwen3|llama] [--splits 1,2,4,8] [--ncu]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

N = 20  # launches a graph
SHAPES = {  # (M, N, K): QKV, o, gate/up, down at a prefill
    "qwen3": [(128, 4096, 1024), (128, 1024, 2048), (128, 6144, 1024), (128, 1024, 3072)],
    "llama": [(32, 3072, 2048), (32, 2048, 2048), (32, 16384, 2048), (32, 2048, 8192)],
}


def _time(stream, launch, graph: bool = True) -> float:  # noqa: ANN001
    """us a launch: N launches in a CUDA graph (``graph``; CuPy's cuBLAS calls cannot be captured: then N launches
    in a row), the median of 5 rounds."""
    import cupy as cp

    launch()  # loads the module / picks the algorithm outside the capture
    stream.synchronize()
    run = None
    if graph:
        stream.begin_capture()
        for _ in range(N):
            launch()
        g = stream.end_capture()
        run = g.launch
    runs = []
    for _ in range(5):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        if run is not None:
            run(stream)
        else:
            for _ in range(N):
                launch()
        e1.record(stream)
        e1.synchronize()
        runs.append(cp.cuda.get_elapsed_time(e0, e1) * 1000 / N)
    return sorted(runs)[2]


def main() -> int:
    import cupy as cp

    from fusec.codegen import kernels as K
    from fusec.codegen import specs as S
    from fusec.codegen.build_gemm import stream_splits
    from fusec.dtypes import DType

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--splits", default="", help="K splits to try (default: the rule's, and 1)")
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    stream = cp.cuda.Stream(non_blocking=True)
    print(f"| {args.shapes} M x N x K | cuBLAS us | splits | grid | smem | fusec us | x cuBLAS | weight GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for m, n, k in SHAPES[args.shapes]:
        a = cp.asarray(rng.standard_normal((m, k)).astype(np.float16))
        b = cp.asarray(rng.standard_normal((k, n)).astype(np.float16) * 0.05)
        c = cp.empty((m, n), cp.float16)
        ref = None
        with stream:
            t_cublas = 0.0 if args.ncu else _time(stream, lambda: cp.matmul(a, b, out=c), graph=False)
            ref = cp.matmul(a, b).astype(cp.float32)
        rule = stream_splits(m, n, k, True)
        tries = sorted({int(s) for s in args.splits.split(",")} if args.splits else {rule, 1})
        for sp in tries:
            if k % (64 * sp):
                continue
            spec = S.GemmSpec(m, n, k, DType.F16, splits=sp)
            ck = K.build(spec)
            out = cp.zeros((m, n), cp.float16)
            argv = [a, b, out]
            if args.ncu:
                K.launch(ck, argv)
                cp.cuda.runtime.deviceSynchronize()
                continue
            t = _time(stream, lambda: K.launch(ck, argv, stream))
            err = float(cp.abs(out.astype(cp.float32) - ref).max() / (cp.abs(ref).max() + 1e-9))
            gbs = n * k * 2 / (t * 1e-6) / 1e9
            print(f"| {m}x{n}x{k} | {t_cublas:.2f} | {sp}{' (rule)' if sp == rule else ''} | {ck.grid} | "
                  f"{ck.shared_mem} | {t:.2f} | {t / t_cublas:.2f} | {gbs:.0f} (err {err:.1e}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
