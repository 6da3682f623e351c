"""Time fusec's kernels at representative transformer shapes (a script, not a test).

    python benchmarks/bench_kernels.py OUT.json [--reps 50]

CUDA-event timing of the kernel launch alone, after warm-up, median of ``--reps`` repeats, with L2
flushed (a 256 MB write) before each timed launch. Peers in the same process where available:
cuBLAS via cupy.matmul (fp16/fp32) and torch (matmul, SDPA, layer_norm) when installed. Reports
GB/s and TFLOP/s against the H200 ceilings of shared/PERF.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from fusec import ops as O
from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.codegen.elementwise import Apply, In
from fusec.dtypes import DType

CEIL = {"bw_Bps": 4.10e12, "fp16_flops": 747e12, "bf16_flops": 776e12, "fp32_flops": 50e12}
F16, BF16, F32 = DType.F16, DType.BF16, DType.F32


def _dev(shape: tuple[int, ...], dt: DType):  # noqa: ANN202
    import cupy as cp

    x = (cp.random.standard_normal(shape, dtype=cp.float32) * 0.5 + 0.01).astype(cp.float32)
    if dt == F32:
        return x
    if dt == F16:
        return x.astype(cp.float16)
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)  # bf16 bits (truncation is fine for timing)


def time_fn(fn: Callable[[], None], reps: int, flush) -> float:  # noqa: ANN001
    import cupy as cp

    for _ in range(5):
        fn()
    times = []
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(reps):
        flush.fill(1)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def _torch():  # noqa: ANN202
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    import cupy as cp

    flush = cp.empty(256 * 2**20, dtype=cp.uint8)
    torch = _torch()
    results = []

    def record(name: str, spec: object, arrays: list, nbytes: float, flops: float, dt: DType,
               peer: Callable[[], None] | None = None, peer_name: str = "") -> None:
        t0 = time.perf_counter()
        ck = K.build(spec)
        compile_s = time.perf_counter() - t0
        ms = time_fn(lambda: K.launch(ck, arrays), args.reps, flush)
        row = {"name": name, "kernel": ck.name, "ms": ms, "compile_s": compile_s, "bytes": nbytes, "flops": flops,
               "GB/s": nbytes / ms / 1e6, "TFLOP/s": flops / ms / 1e9, "registers": ck.binary.registers,
               "grid": ck.grid, "block": ck.block}
        row["bw_frac"] = row["GB/s"] * 1e9 / CEIL["bw_Bps"]
        key = {F16: "fp16_flops", BF16: "bf16_flops", F32: "fp32_flops"}[dt]
        row["flop_frac"] = flops / (ms * 1e-3) / CEIL[key] if flops else 0.0
        if peer is not None:
            row["peer"] = peer_name
            row["peer_ms"] = time_fn(peer, args.reps, flush)
            row["speedup_vs_peer"] = row["peer_ms"] / ms
        results.append(row)
        print(f"{name:44s} {ms * 1e3:9.1f} us  {row['GB/s']:8.0f} GB/s  {row['TFLOP/s']:7.1f} TF/s"
              + (f"  peer {peer_name} {row['peer_ms'] * 1e3:8.1f} us" if peer else ""), flush=True)

    # ---- GEMMs (cuBLAS via cupy.matmul for fp16; torch for bf16) -----------------------------
    for name, M, N, K_, dt in [("gpt2 b8s128 qkv", 1024, 2304, 768, F16), ("gpt2 b8s128 mlp_up", 1024, 3072, 768, F16),
                               ("minilm b32s128 qkv", 4096, 1152, 384, F16), ("qwen3 prefill128 up", 128, 3072, 1024, BF16),
                               ("qwen3 prefill128 down", 128, 1024, 3072, BF16)]:
        a, b, c = _dev((M, K_), dt), _dev((K_, N), dt), _dev((M, N), dt)
        peer, pname = None, ""
        if dt == F16:
            peer, pname = (lambda a=a, b=b, c=c: cp.matmul(a, b, out=c)), "cupy.matmul"
        elif torch is not None:
            ta, tb = torch.randn(M, K_, device="cuda", dtype=torch.bfloat16), torch.randn(K_, N, device="cuda", dtype=torch.bfloat16)
            peer, pname = (lambda ta=ta, tb=tb: torch.matmul(ta, tb)), "torch.matmul"
        record(f"gemm {name} {M}x{N}x{K_}", S.GemmSpec(M, N, K_, dt), [a, b, c], 2 * (M * K_ + K_ * N + M * N),
               2.0 * M * N * K_, dt, peer, pname)

    # ---- decode GEMV (weight-bandwidth bound) -------------------------------------------------
    for name, N, K_ in [("qwen3 decode qkv", 4096, 1024), ("qwen3 decode up", 3072, 1024), ("qwen3 decode down", 1024, 3072),
                        ("qwen3 lm_head", 151936, 1024)]:
        x, w, c = _dev((1, K_), BF16), _dev((N, K_), BF16), _dev((1, N), BF16)
        record(f"gemv {name} 1x{N}x{K_}", S.GemvSpec(1, N, K_, BF16), [x, w, c], 2 * (N * K_ + K_ + N), 2.0 * N * K_, BF16)

    # ---- attention ---------------------------------------------------------------------------
    for name, B, Hq, Hkv, Sq, T, D, dt, causal in [("gpt2 b8s128", 8, 12, 12, 128, 128, 64, F16, True),
                                                    ("minilm b32s128", 32, 12, 12, 128, 128, 32, F16, False),
                                                    ("qwen3 prefill128", 1, 16, 8, 128, 128, 128, BF16, True),
                                                    ("qwen3 decode T=512", 1, 16, 8, 1, 512, 128, BF16, True),
                                                    ("long s2048", 1, 16, 16, 2048, 2048, 128, BF16, True)]:
        q, k, v, o = _dev((B, Hq, Sq, D), dt), _dev((B, Hkv, T, D), dt), _dev((B, Hkv, T, D), dt), _dev((B, Hq, Sq, D), dt)
        flops = 4.0 * B * Hq * Sq * T * D * (0.5 if causal and Sq == T else 1.0)
        nbytes = 2 * (2 * B * Hq * Sq * D + 2 * B * Hkv * T * D)
        peer, pname = None, ""
        if torch is not None:
            tdt = torch.float16 if dt == F16 else torch.bfloat16
            tq = torch.randn(B, Hq, Sq, D, device="cuda", dtype=tdt)
            tk = torch.randn(B, Hq, T, D, device="cuda", dtype=tdt)
            tv = torch.randn(B, Hq, T, D, device="cuda", dtype=tdt)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            peer = lambda tq=tq, tk=tk, tv=tv, c=(causal and Sq == T), f=sdpa: f(tq, tk, tv, is_causal=c)
            pname = "torch sdpa"
        record(f"attention {name} D{D}", S.AttentionSpec(B, Hq, Hkv, Sq, T, D, dt, 1 / math.sqrt(D), causal=causal),
               [q, k, v, o], nbytes, flops, dt, peer, pname)

    # ---- memory-bound ------------------------------------------------------------------------
    for name, rows, cols, dt in [("gpt2 add+layernorm", 1024, 768, F16), ("minilm add+layernorm", 4096, 384, F16),
                                 ("big add+layernorm (> L2)", 65536, 1024, F16)]:
        x, r, g, b, s, o = _dev((rows, cols), dt), _dev((rows, cols), dt), _dev((cols,), dt), _dev((cols,), dt), \
            _dev((rows, cols), dt), _dev((rows, cols), dt)
        peer, pname = None, ""
        if torch is not None:
            tx = torch.randn(rows, cols, device="cuda", dtype=torch.float16)
            tr = torch.randn(rows, cols, device="cuda", dtype=torch.float16)
            peer = lambda tx=tx, tr=tr, n=cols: torch.nn.functional.layer_norm(tx + tr, (n,))
            pname = "torch add+layer_norm"
        record(f"row {name} {rows}x{cols}", S.RowReduceSpec("add_layernorm", rows, cols, dt, w_dtype=dt, has_bias=True),
               [x, r, g, b, s, o], 2 * 4 * rows * cols, 0, dt, peer, pname)
    for name, rows, cols in [("qwen3 rmsnorm prefill", 128, 1024), ("big rmsnorm (> L2)", 65536, 1024)]:
        x, w, o = _dev((rows, cols), BF16), _dev((cols,), BF16), _dev((rows, cols), BF16)
        record(f"row {name} {rows}x{cols}", S.RowReduceSpec("rmsnorm", rows, cols, BF16, w_dtype=BF16, eps=1e-6),
               [x, w, o], 2 * 2 * rows * cols, 0, BF16)
    x, m, o = _dev((8 * 12 * 128, 128), F16), _dev((8, 128), F16), _dev((8 * 12 * 128, 128), F16)
    record("row softmax scale+mask 12288x128", S.RowReduceSpec("softmax", 8 * 12 * 128, 128, F16, scale=0.125, mask_dtype=F16,
           rows_shape=(8, 12, 128), mask_row_strides=(128, 0, 0)), [x, m, o], 2 * 2 * 8 * 12 * 128 * 128, 0, F16)
    M, N = 16384, 4096
    gelu = Apply(O.Op.GELU, (Apply(O.Op.ADD, (In(0), In(1))),), O.GeluAttrs("tanh"))
    x, b, o = _dev((M, N), F16), _dev((N,), F16), _dev((M, N), F16)
    peer, pname = None, ""
    if torch is not None:
        tx, tb = torch.randn(M, N, device="cuda", dtype=torch.float16), torch.randn(N, device="cuda", dtype=torch.float16)
        peer, pname = (lambda: torch.nn.functional.gelu(tx + tb, approximate="tanh")), "torch eager"
    record(f"elementwise gelu(x+bias) {M}x{N} (> L2)", S.elementwise_spec(gelu, [(M, N), (N,)], [F16, F16], (M, N)),
           [x, b, o], 2 * 2 * M * N, 0, F16, peer, pname)
    ids = cp.asarray(np.random.default_rng().integers(0, 50257, 1024).astype(np.int64))
    tab, o = _dev((50257, 768), F16), _dev((1024, 768), F16)
    record("embedding gpt2 1024 tokens", S.EmbeddingSpec(1024, 50257, 768, F16), [ids, tab, o], 2 * 2 * 1024 * 768, 0, F16)

    with open(args.out, "w") as f:
        json.dump({"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "ceilings": CEIL,
                   "reps": args.reps, "results": results}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
