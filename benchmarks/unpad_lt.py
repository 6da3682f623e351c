"""Issue 13, prefill: the unpad copy of padded logits, an unaligned-ldd cuBLASLt lm_head, the
per-shape cuBLASLt algorithm pick, and whole plans before/after (GPU only).

    python benchmarks/unpad_lt.py OUT.json [copy] [ldd] [pick] [plans]

copy:  the copy kernel's generic path ("old") vs its fast path ("new", FlatRows) for the unpad
       1024x50264 -> 1024x50257 in fp16 and fp32 (bytes = the padded source read + the output
       written), CUDA events around one launch, median of 50, GB/s and the fraction of a measured
       1 GiB device-to-device copy (read + written).
ldd:   GPT-2's lm_head 1024x50257x768 fp16: cuBLAS on the padded N = 50264 (what plans do, then
       the unpad copy), cuBLAS with N = ldc = 50257 (unaligned rows), and cuBLASLt writing D with
       ldd = 50257 directly (every heuristic candidate timed), median of 50 each.
pick:  BERT-base's GEMMs through cuBLASLt with their epilogues (4096x2304x768 bias, 4096x768x768
       bias + residual, 4096x3072x768 gelu_bias, 4096x768x3072 bias + residual), each heuristic
       candidate's time (median of 50), against cuBLAS without the epilogue, B stored [N, K] and [K, N].
plans: GPT-2 small fp16 b8 s128 and BERT-base fp16 b32 s128, bound CUDA-graph replay (median of
       200 samples of 10 replays): "before" (generic copy, FUSEC_LT_PICK=0), "copy" (fast copy, no
       pick), "after" (fast copy and the pick), with the picks made and the after per-kernel top.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

REPS = 50


def _timer(stream: Any) -> Any:
    from fusec.bench_kernels import event_median_ms

    return lambda fn, reps=REPS: event_median_ms(fn, stream, reps)


def _copy_kernels(spec: Any) -> dict[str, Any]:
    """{"old": the generic path, "new": the fast path} of one copy spec, compiled."""
    from fusec.codegen import copyspecs as C
    from fusec.codegen import kernels as K

    out = {}
    for side, fast in (("old", False), ("new", True)):
        C.FLAT_FAST_PATH = fast
        try:
            out[side] = K.build(spec)
        finally:
            C.FLAT_FAST_PATH = True
    assert "uint4" in out["new"].source and "uint4" not in out["old"].source
    return out


def bench_copy(peaks: dict[str, Any]) -> list[dict[str, Any]]:
    import cupy

    from fusec.codegen import copyspecs as C
    from fusec.codegen import kernels as K
    from fusec.dtypes import DType

    stream = cupy.cuda.Stream(non_blocking=True)
    median_ms = _timer(stream)
    rows, npad, n = 1024, 50264, 50257
    res = []
    for dt in (DType.F16, DType.F32):
        spec = C.slice_((rows, npad), (1,), (0,), (n,), (1,), dt)
        host = np.random.default_rng(0).standard_normal((rows, npad)).astype(dt.np)
        src = cupy.asarray(host)
        moved = (rows * npad + rows * n) * dt.itemsize
        for side, ck in _copy_kernels(spec).items():
            dst = cupy.full((rows, n), np.nan, dtype=dt.np)
            ms = median_ms(lambda: K.launch(ck, [src, dst], stream=stream))
            ok = bool(np.array_equal(dst.get(), host[:, :n]))
            gbps = moved / (ms * 1e-3) / 1e9
            res.append({"dtype": dt.value, "side": side, "ms": ms, "gbps": gbps, "fraction": gbps / peaks["gbps"],
                        "bytes": moved, "grid": ck.grid[0], "correct": ok,
                        "predicted_ms_at_ceiling": moved / (peaks["gbps"] * 1e9) * 1e3})
            print(f"copy {dt.value} {side}: {ms * 1e3:.1f} us, {gbps:.0f} GB/s = {100 * gbps / peaks['gbps']:.0f}% "
                  f"of {peaks['gbps']:.0f} (ceiling time {res[-1]['predicted_ms_at_ceiling'] * 1e3:.1f} us), "
                  f"correct={ok}", flush=True)
    return res


def _lt_times(call: Any, handle: Any, stream: Any, median_ms: Any) -> dict[str, Any]:
    """Every heuristic candidate of a cuBLASLt call, timed writing its real D."""
    from fusec.runtime.cublas import WORKSPACE_BYTES
    from fusec.runtime.cublaslt import LtMatmul

    lt = LtMatmul(call, handle.lt(), handle.workspace.data.ptr, WORKSPACE_BYTES)
    times = []
    for i in range(len(lt.candidates)):
        if lt.enqueue(stream.ptr, i, call.c):
            times.append(None)
            continue
        times.append(median_ms(lambda i=i: lt.enqueue(stream.ptr, i, call.c)))
    ok = [t for t in times if t is not None]
    best = min(range(len(times)), key=lambda i: (times[i] is None, times[i] or 0.0))
    lt.close()
    return {"candidates_ms": times, "first_ms": times[0], "best_ms": min(ok) if ok else None, "best_index": best}


def _gemm(m: int, n: int, k: int, trans_b: bool, bufs: dict[str, Any], ldc: int | None = None, **kw: Any) -> Any:
    from fusec.runtime.cublas import GemmCall

    return GemmCall(m, n, k, 1, bufs["a"].data.ptr, bufs["b"].data.ptr, bufs["c"].data.ptr, k, k if trans_b else n,
                    ldc or n, 0, 0, 0, False, trans_b, "f16", "f32", **kw)


def _fp16(cupy: Any, n: int, seed: int) -> Any:
    return (cupy.random.default_rng(seed).standard_normal(n, dtype=cupy.float32) * 0.1).astype(cupy.float16)


def bench_ldd(peaks: dict[str, Any]) -> dict[str, Any]:
    import cupy

    from fusec.runtime.cublas import Handle

    stream = cupy.cuda.Stream(non_blocking=True)
    median_ms = _timer(stream)
    handle = Handle()
    m, n, npad, k = 1024, 50257, 50264, 768
    bufs = {"a": _fp16(cupy, m * k, 1), "b": _fp16(cupy, npad * k, 2), "c": cupy.empty(m * npad, cupy.float16)}
    flops = 2.0 * m * n * k
    out: dict[str, Any] = {}
    padded = _gemm(m, npad, k, True, bufs)
    out["cublas_padded_ms"] = median_ms(lambda: padded(handle, stream.ptr))
    odd = _gemm(m, n, k, True, bufs)
    out["cublas_unaligned_ms"] = median_ms(lambda: odd(handle, stream.ptr))
    ref = cupy.asnumpy(bufs["c"][: m * n]).astype(np.float32)
    lt_call = _gemm(m, n, k, True, bufs, epilogue="default")  # D (= C, beta 0) with ldd = 50257
    out["lt_ldd_unaligned"] = _lt_times(lt_call, handle, stream, median_ms)
    lt_call(handle, stream.ptr)  # the heuristic's first once more: the same numbers as cuBLAS's
    got = cupy.asnumpy(bufs["c"][: m * n]).astype(np.float32)
    out["lt_ldd_max_abs_diff_vs_cublas"] = float(np.max(np.abs(got - ref)))
    out["lt_padded"] = _lt_times(_gemm(m, npad, k, True, bufs, epilogue="default"), handle, stream, median_ms)
    for key in ("cublas_padded_ms", "cublas_unaligned_ms"):
        out[key.replace("_ms", "_tflops")] = flops / (out[key] * 1e-3) / 1e12
    best = out["lt_ldd_unaligned"]["best_ms"]
    out["lt_ldd_best_tflops"] = flops / (best * 1e-3) / 1e12 if best else None
    out["roofline_tflops"] = peaks["tflops"]
    handle.close()
    print(f"lm_head 1024x50257x768 fp16: cuBLAS padded {out['cublas_padded_ms'] * 1e3:.1f} us, cuBLAS unaligned "
          f"{out['cublas_unaligned_ms'] * 1e3:.1f} us, cuBLASLt ldd=50257 first "
          f"{out['lt_ldd_unaligned']['first_ms'] * 1e3:.1f} / best {best * 1e3:.1f} us "
          f"(candidates {[round(t * 1e3, 1) if t else None for t in out['lt_ldd_unaligned']['candidates_ms']]}), "
          f"cuBLASLt padded best {out['lt_padded']['best_ms'] * 1e3:.1f} us", flush=True)
    return out


BERT_SHAPES = [("qkv", 4096, 2304, 768, "bias", False), ("attn_out", 4096, 768, 768, "bias", True),
               ("fc", 4096, 3072, 768, "gelu_bias", False), ("proj", 4096, 768, 3072, "bias", True)]


def bench_pick() -> list[dict[str, Any]]:
    import cupy

    from fusec.runtime.cublas import Handle

    stream = cupy.cuda.Stream(non_blocking=True)
    median_ms = _timer(stream)
    handle = Handle()
    res = []
    for name, m, n, k, epi, residual in BERT_SHAPES:
        for trans_b in (True, False):
            bufs = {"a": _fp16(cupy, m * k, 3), "b": _fp16(cupy, n * k, 4), "c": cupy.empty(m * n, cupy.float16)}
            bias, r = _fp16(cupy, n, 5), _fp16(cupy, m * n, 6)
            plain = _gemm(m, n, k, trans_b, bufs)
            cublas_ms = median_ms(lambda: plain(handle, stream.ptr))
            kw: dict[str, Any] = {"epilogue": epi, "bias": bias.data.ptr}
            if residual:
                kw.update(c_in=r.data.ptr, beta=1.0)
            t = _lt_times(_gemm(m, n, k, trans_b, bufs, **kw), handle, stream, median_ms)
            rec = {"gemm": name, "m": m, "n": n, "k": k, "epilogue": epi + ("+residual" if residual else ""),
                   "b_stored": "[N, K]" if trans_b else "[K, N]", "cublas_no_epilogue_ms": cublas_ms, **t}
            res.append(rec)
            print(f"{name} {m}x{n}x{k} {rec['epilogue']} B{rec['b_stored']}: "
                  f"cuBLAS (no epilogue) {cublas_ms * 1e3:.1f} us; "
                  f"cuBLASLt first {t['first_ms'] * 1e3:.1f} us, best #{t['best_index']} {t['best_ms'] * 1e3:.1f} us; "
                  f"candidates {[round(x * 1e3, 1) if x else None for x in t['candidates_ms']]}", flush=True)
    handle.close()
    return res


WORKLOADS = {"gpt2-small": ("gpt2-small", 8, 128), "bert-base": ("bert-base", 32, 128)}


def bench_plans(peaks: dict[str, Any]) -> list[dict[str, Any]]:
    import fusec
    from fusec.bench import measure
    from fusec.bench_kernels import format_table, per_kernel
    from fusec.codegen import copyspecs as C
    from fusec.runtime import lt_pick

    out = []
    for name, (model, b, s) in WORKLOADS.items():
        shapes = {"input_ids": (b, s), "attention_mask": (b, s)}
        rec: dict[str, Any] = {"workload": f"{name} fp16 b{b} s{s}"}
        for side, fast, pick in (("before", False, "0"), ("copy", True, "0"), ("after", True, "1")):
            C.FLAT_FAST_PATH, os.environ["FUSEC_LT_PICK"] = fast, pick
            try:
                plan = fusec.compile(model, shapes=shapes, dtype="fp16", cuda_graph=True)
            finally:
                C.FLAT_FAST_PATH = True
            r = {"launches": plan.info()["launches"],
                 "steady": measure(plan, cuda_graph=True, iters=200, batch=10, bound=True),
                 "steady_again": measure(plan, cuda_graph=True, iters=200, batch=10, bound=True)}
            if side == "after":
                pk = per_kernel(plan, repeats=20, peaks=peaks)
                r["per_kernel_top"] = format_table(pk, 15)
                print(r["per_kernel_top"], flush=True)
            rec[side] = r
            print(f"{name} {side}: bound graph {r['steady']['median_ms']:.4f} / "
                  f"{r['steady_again']['median_ms']:.4f} ms "
                  f"({r['launches']} launches)", flush=True)
            del plan
        rec["picks"] = lt_pick.picks()
        out.append(rec)
    os.environ.pop("FUSEC_LT_PICK", None)
    return out


def main() -> None:
    from fusec.bench_kernels import measure_peaks

    path = sys.argv[1]
    parts = sys.argv[2:] or ["copy", "ldd", "pick", "plans"]
    result: dict[str, Any] = {"peaks": measure_peaks("f16")}
    print(f"ceilings: {result['peaks']['how']}", flush=True)
    steps = {"copy": lambda: bench_copy(result["peaks"]), "ldd": lambda: bench_ldd(result["peaks"]),
             "pick": bench_pick, "plans": lambda: bench_plans(result["peaks"])}
    for part in parts:
        try:
            result[part] = steps[part]()
        except Exception as e:  # keep going: one failed part leaves the others' numbers
            import traceback

            traceback.print_exc()
            result[part] = {"error": f"{type(e).__name__}: {e}"}
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
