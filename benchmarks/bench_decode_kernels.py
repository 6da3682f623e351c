"""Time the decode-step kernels and the decode GEMVs at Qwen3-0.6B shapes (a script, not a test).

    python benchmarks/bench_decode_kernels.py OUT_DIR [--quick]

Every timing is the median over repeats of a captured CUDA graph of many iterations (what a
decode step replays), divided by the iteration count; inputs rotate over enough copies that
the working set exceeds L2 (no timing of cached weights or caches). Writes OUT_DIR/decode.json
and OUT_DIR/decode.md and prints the tables.
  kv_attention: bytes = K and V rows actually visible (B * Hkv * ctx * D * 2 * itemsize);
  gemv / cuBLAS: bytes = weight bytes (N * K * 2);
  copy: a 1 GiB device-to-device copy, bytes read + written.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.codegen.build_decode import SMS, kv_attention_spec, sample_spec
from fusec.dtypes import DType

BF16, F32 = DType.BF16, DType.F32
L2_ROTATE = 256 << 20


def _bf16(shape: tuple[int, ...], scale: float = 1.0):  # noqa: ANN202
    import cupy as cp

    x = (cp.random.standard_normal(shape, dtype=cp.float32) * scale)
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)


def graph_time(fns: list[Callable], min_iters: int = 20, reps: int = 15) -> float:
    """Median microseconds per iteration of a CUDA graph cycling through ``fns`` (each launches
    one iteration on the stream it is given)."""
    import cupy as cp

    s = cp.cuda.Stream(non_blocking=True)
    for f in fns:
        f(s)
    s.synchronize()
    n = max(min_iters, len(fns))
    s.begin_capture()
    try:
        for i in range(n):
            fns[i % len(fns)](s)
    finally:
        g = s.end_capture()
    g.upload(s)
    g.launch(s)
    s.synchronize()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(reps):
        e0.record(s)
        g.launch(s)
        e1.record(s)
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / n)
    return statistics.median(ts)


def copy_bw() -> float:
    import cupy as cp

    n = 1 << 30
    a, b = cp.ones(n // 4, cp.float32), cp.empty(n // 4, cp.float32)
    for _ in range(3):
        b[...] = a
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(10):
        e0.record()
        b[...] = a
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3)
    del a, b
    return 2 * n / statistics.median(ts)


# ---- kv attention -----------------------------------------------------------------------------

def bench_kv(results: list, quick: bool) -> None:
    import cupy as cp

    Hq, Hkv, D, T = 16, 8, 128, 4096
    scale = 1 / math.sqrt(D)
    # (name, target blocks (0: one split), threads, wide combine)
    variants = [("default", -1, 128, False), ("x2", 2 * SMS, 128, False), ("x4", 4 * SMS, 128, False), ("x8", 8 * SMS, 128, False),
                ("x16", 16 * SMS, 128, False), ("x8-256t", 8 * SMS, 256, False), ("x4-wide", 4 * SMS, 128, True),
                ("x8-wide", 8 * SMS, 128, True), ("nosplit", 0, 128, False)]
    if quick:
        variants = variants[2:3]
    for B in (1, 8, 32):
        set_bytes = 2 * B * Hkv * T * D * 2
        nsets = max(1, min(16, -(-L2_ROTATE // set_bytes)))
        sets = [(_bf16((B, Hq, 1, D)), _bf16((B, Hkv, T, D)), _bf16((B, Hkv, T, D))) for _ in range(nsets)]
        out = cp.empty((B, Hq, 1, D), cp.uint16)
        for ctx in (128, 4096):
            pos = cp.full(B, ctx - 1, dtype=cp.int64)
            kv_bytes = 2 * B * Hkv * ctx * D * 2
            for vname, target, threads, wide in variants:
                if target < 0:
                    spec = kv_attention_spec(B, Hq, Hkv, 1, T, D, BF16, scale)  # what the lowering picks
                elif target:
                    spec = kv_attention_spec(B, Hq, Hkv, 1, T, D, BF16, scale, target_blocks=target, threads=threads,
                                             max_splits=S.KV_MAX_SPLITS)
                else:
                    spec = S.KVAttentionSpec(B, Hq, Hkv, 1, T, D, BF16, scale, 1)
                ck = K.build(spec)
                cc = K.build(spec.combine(wide=wide)) if spec.splits > 1 else None
                part = cp.empty(max(1, spec.part_floats), cp.float32)

                def one(i: int) -> Callable:
                    q, k, v = sets[i]

                    def f(s) -> None:  # noqa: ANN001
                        if cc is None:
                            K.launch(ck, [q, k, v, pos, out], stream=s)
                        else:
                            K.launch(ck, [q, k, v, pos, part], stream=s)
                            K.launch(cc, [pos, part, out], stream=s)
                    return f

                us = graph_time([one(i) for i in range(nsets)])
                results.append({"bench": "kv_attention", "B": B, "ctx": ctx, "T": T, "variant": vname,
                                "splits": spec.splits, "threads": threads, "us": us, "bytes": kv_bytes,
                                "GBps": kv_bytes / us * 1e-3, "regs": ck.binary.registers})
        # the prefill-shaped attention kernel on a cache of exactly ctx keys (the only option before)
        if B in (1, 8) and not quick:
            for ctx in (4096,):
                spec = S.AttentionSpec(B, Hq, Hkv, 1, ctx, D, BF16, scale, causal=True)
                ck = K.build(spec)
                fns = [lambda s, i=i: K.launch(ck, [sets[i][0], sets[i][1], sets[i][2], out], stream=s) for i in range(nsets)]
                us = graph_time(fns)
                kvb = 2 * B * Hkv * ctx * D * 2
                results.append({"bench": "kv_attention", "B": B, "ctx": ctx, "T": ctx, "variant": "AttentionSpec",
                                "splits": 1, "threads": 128, "us": us, "bytes": kvb, "GBps": kvb / us * 1e-3})
        del sets


# ---- cache write, sample ----------------------------------------------------------------------

def bench_cache_write(results: list) -> None:
    import cupy as cp

    for B in (1, 32):
        cache = _bf16((B, 8, 4096, 128))
        new = _bf16((B, 8, 1, 128))
        pos = cp.full(B, 1000, cp.int64)
        ck = K.build(S.cache_write_spec((B, 8, 4096, 128), (B, 8, 1, 128), 2, BF16))
        us = graph_time([lambda s: K.launch(ck, [new, pos, cache], stream=s)], min_iters=50)
        results.append({"bench": "cache_write", "B": B, "shape": [B, 8, 4096, 128], "us": us})


def bench_sample(results: list, quick: bool) -> None:
    """Op.SAMPLE with per-row settings: every row of a batch in one mode, and a mixed batch (half
    the rows greedy, half top-k + top-p): the greedy rows of a mixed batch cost an argmax."""
    import cupy as cp

    V = 151936
    # random N(0, 3) logits: t0.7-p0.9 keeps ~600 tokens, t1.0-p0.95 ~12k
    modes = [("greedy", 0.0, 0, 1.0), ("t1.0", 1.0, 0, 1.0), ("t0.6-k20-p0.95", 0.6, 20, 0.95),
             ("t0.7-k50-p0.9", 0.7, 50, 0.9), ("t0.7-p0.9", 0.7, 0, 0.9), ("t1.0-p0.95", 1.0, 0, 0.95),
             ("mixed: greedy + t0.7-k50-p0.9", None, 0, 1.0)]
    for dt in (BF16, F32):
        for B in (1, 32):
            logits = _bf16((B, V), 3.0) if dt == BF16 else cp.random.standard_normal((B, V), dtype=cp.float32) * 3
            seed, ctr = cp.full(B, 42, cp.int64), cp.arange(B, dtype=cp.int64)
            out = cp.empty(B, cp.int64)
            for name, t, k, p in modes:
                if t is None:  # mixed: even rows greedy, odd rows cut
                    temps = cp.array([0.0 if b % 2 == 0 else 0.7 for b in range(B)], cp.float32)
                    ks = cp.array([0 if b % 2 == 0 else 50 for b in range(B)], cp.int64)
                    ps = cp.array([1.0 if b % 2 == 0 else 0.9 for b in range(B)], cp.float32)
                else:
                    temps, ks, ps = cp.full(B, t, cp.float32), cp.full(B, k, cp.int64), cp.full(B, p, cp.float32)
                settings = [logits, seed, ctr, temps, ks, ps]
                specs = [S.SampleSpec(B, V, dt)]
                split = sample_spec(B, V, dt)
                if split.chunks > 1:
                    specs.append(split)
                for spec in specs:
                    ck = K.build(spec)
                    if spec.chunks == 1:
                        fn = lambda s, ck=ck, a=[*settings, out]: K.launch(ck, a, stream=s)  # noqa: E731
                    else:
                        cp_, part = K.build(spec.part()), cp.empty(spec.part_bytes // 4, cp.float32)

                        def fn(s, ck=ck, cp_=cp_, a=[*settings, part], b=[*settings, part, out]) -> None:  # noqa: ANN001
                            K.launch(cp_, a, stream=s)
                            K.launch(ck, b, stream=s)
                    us = graph_time([fn], min_iters=20)
                    results.append({"bench": "sample", "dtype": dt.value, "B": B, "V": V, "mode": name,
                                    "chunks": spec.chunks, "us": us, "GBps": B * V * dt.itemsize / us * 1e-3})


# ---- decode GEMVs: fusec GemvSpec vs cuBLAS -----------------------------------------------------

GEMV_SHAPES = [("qkv", 1024, 4096), ("o_proj", 2048, 1024), ("gate_up", 1024, 6144), ("down", 3072, 1024),
               ("lm_head", 1024, 151936)]


# A prototype (not a fusec kernel; measured only to test why GemvSpec is slow at M > 1): each warp
# owns CPW adjacent columns, so every x chunk loaded (and converted) serves CPW weight rows.
_PROTO = r"""
#define M_ %(M)d
#define N_ %(N)d
#define K_ %(K)d
#define CPW %(CPW)d
#define VEC 8
typedef fc_bf16 T;
extern "C" __global__ void __launch_bounds__(128) %(name)s(const T* __restrict__ x, const T* __restrict__ W, T* __restrict__ C) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = (blockIdx.x * 4 + warp) * CPW;
  if (n0 >= N_) return;
  float acc[CPW][M_];
#pragma unroll
  for (int c = 0; c < CPW; ++c)
#pragma unroll
    for (int m = 0; m < M_; ++m) acc[c][m] = 0.f;
#pragma unroll 2
  for (int k0 = lane * VEC; k0 < K_; k0 += 32 * VEC) {
    float wf[CPW][VEC];
#pragma unroll
    for (int c = 0; c < CPW; ++c) {
      const int n = min(n0 + c, N_ - 1);
      const fc_vec<T, VEC> w = *reinterpret_cast<const fc_vec<T, VEC>*>(W + (long long)n * K_ + k0);
#pragma unroll
      for (int e = 0; e < VEC; ++e) wf[c][e] = fc_val(w.v[e]);
    }
#pragma unroll
    for (int m = 0; m < M_; ++m) {
      const fc_vec<T, VEC> xv = *reinterpret_cast<const fc_vec<T, VEC>*>(x + (long long)m * K_ + k0);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float xf = fc_val(xv.v[e]);
#pragma unroll
        for (int c = 0; c < CPW; ++c) acc[c][m] = fmaf(wf[c][e], xf, acc[c][m]);
      }
    }
  }
#pragma unroll
  for (int c = 0; c < CPW; ++c) {
    float mine = 0.f;
#pragma unroll
    for (int m = 0; m < M_; ++m) {
      const float s = fc_warp_sum(acc[c][m]);
      if (lane == m) mine = s;
    }
    if (lane < M_ && n0 + c < N_) fc_set(C[(long long)lane * N_ + n0 + c], mine);
  }
}
"""


def proto_gemv(M: int, N: int, K_: int, cpw: int):  # noqa: ANN201
    from fusec.codegen.compile import compile_cuda
    from fusec.codegen.render import _include_cuh

    name = f"proto_gemv_{M}_{N}_{K_}_{cpw}"
    src = _include_cuh("common.cuh") + _PROTO % {"M": M, "N": N, "K": K_, "CPW": cpw, "name": name}
    b = compile_cuda(src, name)
    grid = (-(-N // (4 * cpw)), 1, 1)
    return K.CompiledKernel(name, "proto", src, b, grid, (128, 1, 1), 0, ("x", "W", "C"))


def bench_gemv(results: list, quick: bool) -> None:
    import cupy as cp

    from fusec.runtime import cublas

    handle = cublas.Handle()
    for name, Kd, N in GEMV_SHAPES:
        wbytes = N * Kd * 2
        nsets = max(1, min(32, -(-L2_ROTATE // wbytes)))
        ws = [_bf16((N, Kd), 0.05) for _ in range(nsets)]  # [N, K]: GemvSpec's layout, cuBLAS trans_b
        wts = [w.reshape(Kd, N) for w in ws]                # the same bytes read as a [K, N] weight
        for M in (1, 8):
            x = _bf16((M, Kd))
            c = cp.empty((M, N), cp.uint16)
            row = {"bench": "gemv", "name": name, "M": M, "K": Kd, "N": N, "bytes": wbytes}
            ck = K.build(S.GemvSpec(M, N, Kd, BF16))
            us = graph_time([lambda s, w=w: K.launch(ck, [x, w, c], stream=s) for w in ws])
            row.update(fusec_us=us, fusec_GBps=wbytes / us * 1e-3, fusec_regs=ck.binary.registers)
            for cpw in (2, 4):
                pk = proto_gemv(M, N, Kd, cpw)
                us = graph_time([lambda s, w=w: K.launch(pk, [x, w, c], stream=s) for w in ws])
                row.update({f"proto{cpw}_us": us, f"proto{cpw}_GBps": wbytes / us * 1e-3})
                K.launch(ck, [x, ws[0], c])
                ref = c.copy()
                K.launch(pk, [x, ws[0], c])
                same = float(cp.abs((c.astype(cp.uint32) << 16).view(cp.float32) - (ref.astype(cp.uint32) << 16).view(cp.float32)).max())
                row[f"proto{cpw}_maxdiff_vs_gemv"] = same
            for tb, key in ((False, "cublas_kn"), (True, "cublas_nk")):
                calls = []
                for w in (ws if tb else wts):
                    g = cublas.GemmCall(m=M, n=N, k=Kd, batch=1, a=x.data.ptr, b=w.data.ptr, c=c.data.ptr, lda=Kd,
                                        ldb=Kd if tb else N, ldc=N, stride_a=0, stride_b=0, stride_c=M * N,
                                        trans_a=False, trans_b=tb, dtype="bf16", compute="f32")
                    calls.append(lambda s, g=g: g(handle, s.ptr))
                us = graph_time(calls)
                row.update({f"{key}_us": us, f"{key}_GBps": wbytes / us * 1e-3})
            results.append(row)
        del ws, wts


def _table(results: list, copy: float, device: str) -> str:
    L = [f"device: {device}; device-to-device copy: {copy / 1e9:.0f} GB/s (read + write)", ""]
    kv = [r for r in results if r["bench"] == "kv_attention"]
    if kv:
        L += ["### kv_attention (Qwen3-0.6B: Hq 16, Hkv 8, D 128, bf16, cache T 4096; split + combine)", "",
              "| B | ctx | variant | splits | us | K+V bytes | GB/s | % of copy |", "|---|---|---|---|---|---|---|---|"]
        for r in kv:
            L.append(f"| {r['B']} | {r['ctx']} | {r['variant']} | {r['splits']} | {r['us']:.2f} | {r['bytes'] / 1e6:.1f} MB "
                     f"| {r['GBps']:.0f} | {100 * r['GBps'] * 1e9 / copy:.0f}% |")
        L.append("")
    sm = [r for r in results if r["bench"] == "sample"]
    if sm:
        L += ["### sample (V 151936, per-row settings; chunks > 1: a per-chunk launch, then the row kernel merges)", "",
              "| logits | B | mode | blocks/row | us | GB/s of logits |", "|---|---|---|---|---|---|"]
        for r in sm:
            L.append(f"| {r['dtype']} | {r['B']} | {r['mode']} | {r.get('chunks', 1)} | {r['us']:.2f} | {r['GBps']:.0f} |")
        L.append("")
    cw = [r for r in results if r["bench"] == "cache_write"]
    if cw:
        L += ["### cache_write (bf16 [B, 8, 4096, 128], one new position)", "", "| B | us |", "|---|---|"]
        L += [f"| {r['B']} | {r['us']:.2f} |" for r in cw] + [""]
    gv = [r for r in results if r["bench"] == "gemv"]
    if gv:
        L += ["### decode GEMVs, bf16 (weight bandwidth)", "",
              "| matmul | M | K->N | weights | fusec GemvSpec us (GB/s) | cuBLAS W[K,N] us (GB/s) | cuBLAS W[N,K] trans_b us (GB/s) "
              "| proto 2 cols/warp us (GB/s) | proto 4 cols/warp us (GB/s) |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in gv:
            L.append(f"| {r['name']} | {r['M']} | {r['K']}->{r['N']} | {r['bytes'] / 1e6:.1f} MB | {r['fusec_us']:.2f} "
                     f"({r['fusec_GBps']:.0f}) | {r['cublas_kn_us']:.2f} ({r['cublas_kn_GBps']:.0f}) | "
                     f"{r['cublas_nk_us']:.2f} ({r['cublas_nk_GBps']:.0f}) | {r.get('proto2_us', 0):.2f} "
                     f"({r.get('proto2_GBps', 0):.0f}) | {r.get('proto4_us', 0):.2f} ({r.get('proto4_GBps', 0):.0f}) |")
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="kv,sample,cache,gemv")
    args = ap.parse_args()
    import cupy as cp

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        device = subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,driver_version",
                                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    results: list = []
    t0 = time.time()
    copy = copy_bw()
    only = set(args.only.split(","))
    for key, fn in (("kv", lambda: bench_kv(results, args.quick)), ("cache", lambda: bench_cache_write(results)),
                    ("sample", lambda: bench_sample(results, args.quick)), ("gemv", lambda: bench_gemv(results, args.quick))):
        if key in only:
            t = time.time()
            try:
                fn()
            except Exception as e:  # keep what was measured
                print(f"bench {key} failed: {type(e).__name__}: {e}", file=sys.stderr)
            print(f"[{key}: {time.time() - t:.1f} s]", file=sys.stderr)
            (out / "decode.json").write_text(json.dumps({"device": device, "copy_Bps": copy, "results": results}, indent=1))
    md = _table(results, copy, device)
    (out / "decode.md").write_text(md + "\n")
    print(md)
    print(f"[total {time.time() - t0:.1f} s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
