"""fusec's GEMM in its stream form (few rows of A, a weight read once; K split over thread-block clusters) alone,
against cuBLAS (fusec's own binding, which CUDA graphs can capture) at a prefill's product shapes: a CUDA graph of N
launches over rotating copies of the weight (more bytes than L2 holds, so each launch reads its weight from DRAM, as
in a plan), us a launch (bench_decode_kernels.graph_time). With --ncu, launches each variant once for Nsight Compute instead.

    python benchmarks/gemm_stream_bench.py [--shapes qwen3|llama] [--splits 1,2,4,8] [--ncu]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_kernels import graph_time  # noqa: E402  (the benchmarks' CUDA-graph timing)

N = 20  # launches a graph
SHAPES = {  # (M, N, K): QKV, o, gate/up, down at a prefill
    "qwen3": [(128, 4096, 1024), (128, 1024, 2048), (128, 6144, 1024), (128, 1024, 3072)],
    "llama": [(32, 3072, 2048), (32, 2048, 2048), (32, 16384, 2048), (32, 2048, 8192)],
}


L2_BYTES = 96 << 20  # the weight copies rotated through exceed this (an H100's or H200's L2 holds 50 MB)


def main() -> int:
    import cupy as cp

    from fusec.codegen import kernels as K
    from fusec.codegen import specs as S
    from fusec.codegen.build_gemm import stream_splits
    from fusec.dtypes import DType
    from fusec.runtime.cublas import GemmCall, Handle

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--splits", default="", help="K splits to try (default: the rule's, and 1)")
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    handle = Handle()
    print(f"| {args.shapes} M x N x K | cuBLAS us | splits | grid | smem | fusec us | x cuBLAS | weight GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for m, n, k in SHAPES[args.shapes]:
        a = cp.asarray(rng.standard_normal((m, k)).astype(np.float16))
        b0 = rng.standard_normal((k, n)).astype(np.float16) * np.float16(0.05)
        bs = [cp.asarray(b0) for _ in range(max(1, -(-L2_BYTES // b0.nbytes)))]
        c = cp.empty((m, n), cp.float16)
        ref = cp.matmul(a, bs[0]).astype(cp.float32)
        calls = [GemmCall(m, n, k, 1, a.data.ptr, b.data.ptr, c.data.ptr, k, n, n, 0, 0, 0, False, False, "f16", "f32")
                 for b in bs]
        t_cublas = 0.0 if args.ncu else graph_time([lambda st, cl=cl: cl(handle, st.ptr) for cl in calls], N)
        rule = stream_splits(m, n, k, True)
        tries = sorted({int(x) for x in args.splits.split(",")} if args.splits else {rule, 1})
        for sp in tries:
            if k % (64 * sp):
                continue
            spec = S.GemmSpec(m, n, k, DType.F16, splits=sp)
            ck = K.build(spec)
            out = cp.zeros((m, n), cp.float16)
            if args.ncu:
                K.launch(ck, [a, bs[0], out])
                cp.cuda.runtime.deviceSynchronize()
                continue
            t = graph_time([lambda st, b=b, ck=ck, out=out: K.launch(ck, [a, b, out], st) for b in bs], N)
            err = float(cp.abs(out.astype(cp.float32) - ref).max() / (cp.abs(ref).max() + 1e-9))
            gbs = n * k * 2 / (t * 1e-6) / 1e9
            print(f"| {m}x{n}x{k} | {t_cublas:.2f} | {sp}{' (rule)' if sp == rule else ''} | {ck.grid} | "
                  f"{ck.shared_mem} | {t:.2f} | {t / t_cublas:.2f} | {gbs:.0f} (err {err:.1e}) |", flush=True)
        del bs
    handle.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
