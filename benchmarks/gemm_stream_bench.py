"""fusec's GEMM in its stream form (few rows of A, a weight read once; K split over thread-block clusters) alone,
against cuBLAS (fusec's own binding, which CUDA graphs can capture) at a prefill's product shapes: a CUDA graph of N
launches over rotating copies of the weight (more bytes than L2 holds, so each launch reads its weight from DRAM, as
in a plan), us a launch (bench_decode_kernels.graph_time). With --ncu, launches each variant once for Nsight Compute instead.
With --trace, compiles the kernels with per-block timestamps (FUSEC_TRACE) and launches each once on a weight not in L2:
the blocks' phases in us after the kernel's first block started (the FC_TRACE_PHASE marks: first slice landed, K loop
done, the tile in shared memory (a split's: visible to the cluster), its rows stored), p50 and max over the blocks.

    python benchmarks/gemm_stream_bench.py [--shapes qwen3|llama] [--splits 1,2,4,8] [--forms stream,wgmma]
                                          [--max-stages 8,4,3] [--bn 64,128]
                                          [--ncu | --trace]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
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
PHASES = ("first slice", "K loop", "tile shared", "stored")  # gemm_stream.jinja's / gemm_wgmma.jinja's FC_TRACE_PHASE


def trace_once(ck, args: list) -> str:  # noqa: ANN001
    """One launch of a traced kernel: its blocks' phases (us after the first block's start), p50 / max."""
    import cupy as cp
    from block_trace import clear_traces, read_traces  # the benchmarks' fc_trace access

    from fusec.codegen import kernels as K

    fn = K.load(ck)
    mod = next(m for m, f in K._MODULES.values() if f is fn)
    g = mod.get_global_var("fc_trace")
    ptrs = {"k": int(g.ptr if hasattr(g, "ptr") else g[0] if isinstance(g, tuple) else g)}
    clear_traces(ptrs)
    K.launch(ck, args)
    cp.cuda.runtime.deviceSynchronize()
    t = read_traces(ptrs)["k"][:ck.grid[0] * ck.grid[1] * ck.grid[2]].astype(np.int64)
    t0 = t[:, 0].min()
    cols = [("start", t[:, 0])] + [(PHASES[i], t[:, 5 + i]) for i in range(4)] + [("end", t[:, 3])]
    parts = [f"{name} {np.percentile((c[c > 0] - t0) * 1e-3, 50):.2f}/{((c[c > 0] - t0) * 1e-3).max():.2f}"
             for name, c in cols if (c > 0).any()]
    return ", ".join(parts)


def main() -> int:
    import cupy as cp

    from fusec.codegen import build_gemm
    from fusec.codegen import kernels as K
    from fusec.codegen import specs as S
    from fusec.codegen.build_gemm import stream_splits, wgmma_tiling
    from fusec.codegen.compile import compile_cuda
    from fusec.dtypes import DType
    from fusec.runtime.cublas import GemmCall, Handle

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--splits", default="", help="K splits to try (default: the rule's, and 1)")
    ap.add_argument("--forms", default="stream", help="stream (B [K, N], mma.sync), wgmma (B [N, K], sm_90a), wgmma-nofence")
    ap.add_argument("--max-stages", default="", help="the wgmma form's ring caps to try, e.g. 8,4,3 (build_gemm."
                    "WGMMA_MAX_STAGES; default: as built)")
    ap.add_argument("--bn", default="", help="the wgmma form's columns a block to try, e.g. 32,64,128 (GemmSpec.bn; "
                    "default: build_gemm.wgmma_tiling's)")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--trace", action="store_true")
    args = ap.parse_args()
    if args.trace:
        os.environ["FUSEC_TRACE"] = "1"  # read when a kernel compiles
    rng = np.random.default_rng(0)
    handle = Handle()
    if args.trace:
        print(f"| {args.shapes} M x N x K | form, splits | grid | block phases, us after the first start: p50/max |")
        print("|---|---|---|---|")
    else:
        print(f"| {args.shapes} M x N x K | cuBLAS us | form, splits | grid | smem | fusec us | x cuBLAS | weight GB/s |")
        print("|---|---|---|---|---|---|---|---|")
    for m, n, k in SHAPES[args.shapes]:
        a = cp.asarray(rng.standard_normal((m, k)).astype(np.float16))
        b0 = rng.standard_normal((k, n)).astype(np.float16) * np.float16(0.05)
        bs = [cp.asarray(b0) for _ in range(max(1, -(-L2_BYTES // b0.nbytes)))]
        bts = [cp.ascontiguousarray(b.T) for b in bs] if "wgmma" in args.forms else []  # the [N, K] copies
        c = cp.empty((m, n), cp.float16)
        ref = cp.matmul(a, bs[0]).astype(cp.float32)
        calls = [GemmCall(m, n, k, 1, a.data.ptr, b.data.ptr, c.data.ptr, k, n, n, 0, 0, 0, False, False, "f16", "f32")
                 for b in bs]
        t_cublas = 0.0 if args.ncu or args.trace else graph_time([lambda st, cl=cl: cl(handle, st.ptr) for cl in calls], N)
        rule = stream_splits(m, n, k, True)
        wg_bn, wg_rule = wgmma_tiling(m, n, k)
        tries = sorted({int(x) for x in args.splits.split(",")} if args.splits else {rule, wg_rule, 1})
        caps = [int(c) for c in args.max_stages.split(",")] if args.max_stages else [build_gemm.WGMMA_MAX_STAGES]
        bns = [int(x) for x in args.bn.split(",")] if args.bn else [0]
        runs = [(f, sp, cap, bn) for f in args.forms.split(",") for sp in tries
                for cap in (caps if f.startswith("wgmma") else [0]) for bn in (bns if f.startswith("wgmma") else [0])]
        for form, sp, cap, bn in runs:
            if k % (64 * sp):
                continue
            wg = form.startswith("wgmma")
            bn = (bn or wg_bn) if wg else 0  # the wgmma form: --bn's columns a block, else the rule's
            spec = S.GemmSpec(m, n, k, DType.F16, splits=sp, trans_b=wg, wgmma=wg, bn=bn)
            if wg:  # the ring's cap for this build (a benchmark's experiment, not a product setting)
                build_gemm.WGMMA_MAX_STAGES = cap
            ck = K.build(spec)
            is_rule = (sp, bn) == (wg_rule, wg_bn) if wg else sp == rule
            label = form + (f" <= {cap} stages" if wg and args.max_stages else "") + (f", BN {bn}" if wg else "")
            if form == "wgmma-nofence":  # what the async-proxy fence costs (timing only: without it nothing orders the
                src = ck.source.replace('asm volatile("fence.proxy.async.shared::cta;" ::: "memory");', "")  # copies)
                assert src != ck.source
                binary = compile_cuda(src, ck.name, "sm_90")
                ck = dataclasses.replace(ck, source=src, binary=binary)
            ws = bts if wg else bs
            out = cp.zeros((m, n), cp.float16)
            if args.ncu:
                K.launch(ck, [a, ws[0], out])
                cp.cuda.runtime.deviceSynchronize()
                continue
            if args.trace:
                for b in ws[1:]:  # the other copies through L2: the traced launch reads ws[0] from DRAM
                    K.launch(ck, [a, b, out])
                print(f"| {m}x{n}x{k} | {label}, splits {sp} | {ck.grid} | {trace_once(ck, [a, ws[0], out])} |",
                      flush=True)
                continue
            t = graph_time([lambda st, a=a, b=b, ck=ck, out=out: K.launch(ck, [a, b, out], st) for b in ws], N)
            err = float(cp.abs(out.astype(cp.float32) - ref).max() / (cp.abs(ref).max() + 1e-9))
            gbs = n * k * 2 / (t * 1e-6) / 1e9
            print(f"| {m}x{n}x{k} | {t_cublas:.2f} | {label}, {sp}{' (rule)' if is_rule else ''} | {ck.grid} | "
                  f"{ck.shared_mem} | {t:.2f} | {t / t_cublas:.2f} | {gbs:.0f} (err {err:.1e}) |", flush=True)
        del bs
    handle.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
