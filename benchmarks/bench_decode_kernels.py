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
from fusec.codegen.build_decode import kv_layout, SMS, kv_attention_spec, sample_spec
from fusec.codegen.build_gemm import gemv_form
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

def bench_kv(results: list, quick: bool, batches: tuple[int, ...] = (1, 8, 32), T: int = 4096) -> None:
    import cupy as cp

    Hq, Hkv, D = 16, 8, 128
    scale = 1 / math.sqrt(D)
    # (name, target blocks (0: one split), threads, keys a key group loads at a time (0: the rule's)); a split one
    # merges in-kernel (its last block)
    # (name, target blocks (0: one split), threads, keys a key group loads at a time (0: the rule's), the rule's
    # options: a cluster merge (sm_90), older rows loaded before the PDL wait)
    variants = [("default", -1, 128, 0, {}), ("default-u8", -1, 128, 8, {}), ("x2", 2 * SMS, 128, 0, {}),
                ("x4", 4 * SMS, 128, 0, {}), ("x8", 8 * SMS, 128, 0, {}), ("x16", 16 * SMS, 128, 0, {}),
                ("x16-u8", 16 * SMS, 128, 8, {}), ("x8-256t", 8 * SMS, 256, 0, {}), ("nosplit", 0, 128, 0, {}),
                ("nosplit-256t", 0, 256, 0, {})]
    if int(cp.cuda.Device().compute_capability) >= 90:
        variants += [("cluster", -1, 128, 0, {"cluster": True}), ("prefetch", -1, 128, 0, {"prefetch": True}),
                     ("cluster+prefetch", -1, 128, 0, {"cluster": True, "prefetch": True}),
                     ("x4-cluster+prefetch", 4 * SMS, 128, 0, {"cluster": True, "prefetch": True})]
    if quick:
        variants = variants[3:4]
    for B in batches:
        set_bytes = 2 * B * Hkv * T * D * 2
        nsets = max(1, min(16, -(-L2_ROTATE // set_bytes)))
        sets = [(_bf16((B, Hq, 1, D)), _bf16((B, Hkv, T, D)), _bf16((B, Hkv, T, D))) for _ in range(nsets)]
        out = cp.empty((B, Hq, 1, D), cp.uint16)
        for ctx in (c for c in (128, 4096) if c <= T):
            pos = cp.full(B, ctx - 1, dtype=cp.int64)
            kv_bytes = 2 * B * Hkv * ctx * D * 2
            for vname, target, threads, unroll, opts in variants:
                if target < 0:  # what the lowering picks
                    spec = kv_attention_spec(B, Hq, Hkv, 1, T, D, BF16, scale, unroll=unroll, **opts)
                elif target:
                    spec = kv_attention_spec(B, Hq, Hkv, 1, T, D, BF16, scale, target_blocks=target, threads=threads,
                                             max_splits=S.KV_MAX_SPLITS, unroll=unroll, **opts)
                else:
                    spec = S.KVAttentionSpec(B, Hq, Hkv, 1, T, D, BF16, scale, 1, threads=threads)
                ck = K.build(spec)
                part = cp.empty(max(1, spec.part_floats), cp.float32)
                sync = cp.zeros(max(1, spec.sync_ints(kv_layout(spec, spec.threads)["tiles"])), cp.int32)

                def one(i: int) -> Callable:
                    q, k, v = sets[i]

                    def f(s) -> None:  # noqa: ANN001
                        named = {"q": q, "k": k, "v": v, "pos": pos, "part": part, "sync": sync, "out": out}
                        K.launch(ck, [named[p] for p in ck.params], stream=s)
                    return f

                us = graph_time([one(i) for i in range(nsets)])
                results.append({"bench": "kv_attention", "B": B, "ctx": ctx, "T": T, "variant": vname,
                                "splits": spec.splits, "threads": threads, "us": us, "bytes": kv_bytes,
                                "GBps": kv_bytes / us * 1e-3, "regs": ck.binary.registers})
        # the prefill-shaped attention kernel on a cache of exactly ctx keys (the only option before)
        if B in (1, 8) and not quick:
            for ctx in (c for c in (4096,) if c <= T):
                spec = S.AttentionSpec(B, Hq, Hkv, 1, ctx, D, BF16, scale, causal=True)
                ck = K.build(spec)
                fns = [lambda s, i=i: K.launch(ck, [sets[i][0], sets[i][1], sets[i][2], out], stream=s) for i in range(nsets)]
                us = graph_time(fns)
                kvb = 2 * B * Hkv * ctx * D * 2
                results.append({"bench": "kv_attention", "B": B, "ctx": ctx, "T": ctx, "variant": "AttentionSpec",
                                "splits": 1, "threads": 128, "us": us, "bytes": kvb, "GBps": kvb / us * 1e-3})
        sets = None  # free the copies before the next batch (a del would leave the closures a deleted name)


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

GEMV_SHAPES = [("qwen3 qkv", 1024, 4096), ("qwen3 o_proj", 2048, 1024), ("qwen3 gate_up", 1024, 6144),
               ("qwen3 down", 3072, 1024), ("qwen3 lm_head", 1024, 151936),
               ("llama1b qkv", 2048, 3072), ("llama1b o_proj", 2048, 2048), ("llama1b gate_up", 2048, 16384),
               ("llama1b down", 8192, 2048), ("llama1b lm_head", 2048, 128256)]


def _pdl_chain(ck, args_per_launch: list[list]) -> list[Callable]:  # noqa: ANN001
    """Launch closures with programmatic dependent launch (each may overlap the one before)."""
    from fusec.runtime.pdl import PdlLaunch

    fn = K.load(ck)
    return [PdlLaunch(fn.ptr, ck.grid, ck.block, ck.shared_mem, tuple(np.uint64(a.data.ptr) for a in args))
            for args in args_per_launch]


def bench_gemv(results: list, quick: bool, rings: list[tuple[int, int]] = (), ms: tuple[int, ...] = ()) -> None:
    """Each decode product shape alone, in a CUDA graph cycling over weight copies (> L2): fusec's
    skinny product launched plainly and with PDL (weight loads overlap the previous launch), and
    cuBLAS reading the same bytes as [N, K] (trans_b) and [K, N]. ``rings``: the shared-memory ring
    forms (stages, tiles per block) timed too, with PDL."""
    import cupy as cp

    from fusec.runtime import cublas

    handle = cublas.Handle()
    shapes = GEMV_SHAPES[:2] if quick else GEMV_SHAPES
    for name, Kd, N in shapes:
        wbytes = N * Kd * 2
        nsets = max(2, min(32, -(-L2_ROTATE // wbytes)))
        ws = [_bf16((N, Kd), 0.05) for _ in range(nsets)]  # [N, K]: GemvSpec's layout, cuBLAS trans_b
        wts = [w.reshape(Kd, N) for w in ws]                # the same bytes read as a [K, N] weight
        for M in ms or ((1, 8) if quick else (1, 4, 8, 16)):
            x = _bf16((M, Kd))
            c = cp.empty((M, N), cp.uint16)
            row = {"bench": "gemv", "name": name, "M": M, "K": Kd, "N": N, "bytes": wbytes}
            ck = K.build(S.GemvSpec(M, N, Kd, BF16))  # one block per tile of 8 rows, as the lowering emits it
            us = graph_time([lambda s, w=w: K.launch(ck, [x, w, c], stream=s) for w in ws])
            row.update(fusec_us=us, fusec_GBps=wbytes / us * 1e-3, fusec_regs=ck.binary.registers)
            us = graph_time(_pdl_chain(ck, [[x, w, c] for w in ws]))
            row.update(fusec_pdl_us=us, fusec_pdl_GBps=wbytes / us * 1e-3)
            for st, tpb in rings:
                rk = K.build(S.GemvSpec(M, N, Kd, BF16, stages=st, tiles_per_block=tpb))
                us = graph_time(_pdl_chain(rk, [[x, w, c] for w in ws]))
                row[f"ring{st}x{tpb}_us"] = us
            form = gemv_form(N, Kd, BF16, False, M)  # what the plans take (no norm, no gated unit), with PDL
            rk = K.build(S.GemvSpec(M, N, Kd, BF16, **form))
            us = graph_time(_pdl_chain(rk, [[x, w, c] for w in ws]))
            row.update(rule_form=form, rule_pdl_us=us, rule_pdl_GBps=wbytes / us * 1e-3)
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
            print(json.dumps(row), flush=True)
        del ws, wts


def _table(results: list, copy: float, device: str) -> str:
    L = [f"device: {device}; device-to-device copy: {copy / 1e9:.0f} GB/s (read + write)", ""]
    kv = [r for r in results if r["bench"] == "kv_attention"]
    if kv:
        rows = "/".join(str(t) for t in sorted({r["T"] for r in kv}))
        L += [f"### kv_attention (Qwen3-0.6B: Hq 16, Hkv 8, D 128, bf16, cache T {rows}; split, merged in-kernel)", "",
              "| B | ctx | variant | splits | us | K+V bytes | GB/s | % of copy | registers |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in kv:
            L.append(f"| {r['B']} | {r['ctx']} | {r['variant']} | {r['splits']} | {r['us']:.2f} | {r['bytes'] / 1e6:.1f} MB "
                     f"| {r['GBps']:.0f} | {100 * r['GBps'] * 1e9 / copy:.0f}% | {r.get('regs', '')} |")
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
    ring_keys = sorted({k for r in gv for k in r if k.startswith("ring")})
    if ring_keys:
        L += ["### decode products: the shared-memory ring (stages x tiles per block), PDL, us (% of copy)", "",
              "| product | M | weights | registers, PDL | " + " | ".join(k[4:-3] for k in ring_keys) + " | cuBLAS [N,K] |",
              "|---|---|---|---|" + "---|" * (len(ring_keys) + 1)]
        for r in gv:
            cells = [f"{r[k]:.2f} ({100 * r['bytes'] / r[k] * 1e6 / copy:.0f}%)" for k in ring_keys]
            L.append(f"| {r['name']} | {r['M']} | {r['bytes'] / 1e6:.1f} MB | {r['fusec_pdl_us']:.2f} "
                     f"({100 * r['fusec_pdl_GBps'] * 1e9 / copy:.0f}%) | " + " | ".join(cells)
                     + f" | {r['cublas_nk_us']:.2f} |")
        L.append("")
    if gv:
        L += ["### decode products, bf16 (us per launch and weight GB/s; a graph cycling over weight copies)", "",
              "| product | M | K->N | weights | fusec | fusec + PDL | % of copy (PDL) | the rule's form + PDL (% of copy) "
              "| cuBLAS [N,K] | cuBLAS [K,N] |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for r in gv:
            L.append(f"| {r['name']} | {r['M']} | {r['K']}->{r['N']} | {r['bytes'] / 1e6:.1f} MB "
                     f"| {r['fusec_us']:.2f} ({r['fusec_GBps']:.0f}) | {r['fusec_pdl_us']:.2f} ({r['fusec_pdl_GBps']:.0f}) "
                     f"| {100 * r['fusec_pdl_GBps'] * 1e9 / copy:.0f}% "
                     f"| {r['rule_pdl_us']:.2f} ({100 * r['rule_pdl_GBps'] * 1e9 / copy:.0f}%) "
                     f"| {r['cublas_nk_us']:.2f} ({r['cublas_nk_GBps']:.0f}) "
                     f"| {r['cublas_kn_us']:.2f} ({r['cublas_kn_GBps']:.0f}) |")
        L.append("")
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="kv,sample,cache,gemv")
    ap.add_argument("--kv-batches", default="1,8,32", help="kv: the batch sizes")
    ap.add_argument("--kv-cache", type=int, default=4096, help="kv: the cache's rows (its capacity T: the split rule's)")
    ap.add_argument("--rings", default="", help="gemv: shared-memory ring forms to time too, e.g. 3x2,4x4 (stages x tiles per block)")
    ap.add_argument("--ms", default="", help="gemv: the M values (default 1,4,8,16; --quick 1,8)")
    args = ap.parse_args()
    rings = [tuple(int(v) for v in f.split("x")) for f in args.rings.split(",") if f]
    ms = tuple(int(v) for v in args.ms.split(",") if v)
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
    for key, fn in (("kv", lambda: bench_kv(results, args.quick, tuple(map(int, args.kv_batches.split(","))), args.kv_cache)), ("cache", lambda: bench_cache_write(results)),
                    ("sample", lambda: bench_sample(results, args.quick)), ("gemv", lambda: bench_gemv(results, args.quick, rings, ms))):
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
