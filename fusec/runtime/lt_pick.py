"""Per-shape choice of the cuBLASLt algorithm, made at load (issue 13).

cuBLASLt's heuristic ranks its algorithms by an estimate; its first was slower than cuBLAS's
own pick on BERT's QKV (4096x2304x768 fp16 + bias: 55.3 us against 47.6 us + the separate
epilogue). So when the executor prepares a cuBLASLt call (``prepare``, before any run and before
CUDA-graph capture) it asks the heuristic for up to ``cublaslt.MAX_ALGOS`` candidates, times each
on the GPU and keeps the fastest.

* Once per process per call signature (device, shape, layouts, strides, dtypes, compute,
  epilogue, alpha/beta, operand alignments): a cache shared by every plan and entry point, so the
  same process always runs the same algorithm for the same signature.
* Timing reads the plan's own A, B, bias and residual, but writes D to a scratch buffer of D's
  size and alignment, so a pick writes neither the weights, nor the state, nor the arena (an
  earlier run's outputs stay valid, a residual read in place from D stays what it was).
* The GPU is first kept busy ~``WARM_MS`` (clocks up); then each candidate: one warm-up call and
  ``REPEATS`` calls between two CUDA events, in ``PASSES`` rounds; the smallest mean of its best
  round wins, ties to the heuristic's earlier rank. A candidate whose call fails is skipped.
* Off by default; ``FUSEC_LT_PICK=1`` turns it on. Measured on an H100 (benchmarks/RESULTS.md,
  2026-11-23 evening): the candidates timed alone differ by 1-5 %, and the picks made whole plans
  slower, not faster (GPT-2 small fp16 b8 s128 0.923 -> 0.959 ms, BERT-base fp16 b32 s128
  1.923 -> 1.961 ms, bound graph replay): a product timed alone, on inputs hot in L2, is not the
  product inside the plan. A pick would have to be an A/B of the whole plan (``fusec.ab``).
* ``picks()`` lists what was chosen (``Executor.profile`` labels the launch ``algo i/n``).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

REPEATS = 3
PASSES = 2
WARM_MS = 20.0  # the GPU kept busy before the first timing (an idle H100 read 345 MHz)
_CACHE: dict[tuple, dict[str, Any]] = {}
_LOCK = threading.Lock()


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """True when ``FUSEC_LT_PICK`` is 1/on/true/yes (read at each prepare, not at import)."""
    from fusec import knobs

    return bool(knobs.value("FUSEC_LT_PICK", (env if env is not None else os.environ).get("FUSEC_LT_PICK")))


def fastest(times: Sequence[float]) -> int:
    """Index of the smallest finite time; ties keep the earlier (the heuristic's rank); 0 when
    none is finite (every candidate failed: the heuristic's first, whose failure the run reports)."""
    best = 0
    for i, t in enumerate(times):
        if math.isfinite(t) and (not math.isfinite(times[best]) or t < times[best]):
            best = i
    return best


def choose(key: tuple, n: int, timer: Callable[[int], float], on: bool = True,
           cache: dict[tuple, dict[str, Any]] | None = None, passes: int = PASSES) -> dict[str, Any]:
    """The pick for signature ``key`` among ``n`` candidates: cached, else timed with
    ``timer(i) -> ms`` (inf for a candidate that failed), ``passes`` rounds over all candidates,
    each candidate's best round kept (a clock still ramping up in the first round favours no
    candidate). Off: index 0, nothing timed."""
    if not on or n <= 1:
        return {"index": 0, "count": n, "times_ms": None, "timed": False}
    cache = _CACHE if cache is None else cache
    with _LOCK:
        hit = cache.get(key)
        if hit is None:
            times = [math.inf] * n
            for _ in range(passes):
                times = [min(t, float(timer(i))) for i, t in enumerate(times)]
            hit = {"index": fastest(times), "count": n, "times_ms": times, "timed": True}
            cache[key] = hit
    return hit


def signature(lt: Any, device: int) -> tuple:
    """What the algorithm choice may depend on: the call's fields and its pointers' alignments."""
    from fusec.runtime.cublaslt import _alignment

    c = lt.call
    ptrs = (c.a, c.b, c.c, c.bias or 0, c.c_in or 0)
    return (device, c.m, c.n, c.k, c.batch, c.lda, c.ldb, c.ldc, c.stride_a, c.stride_b, c.stride_c,
            bool(c.trans_a), bool(c.trans_b), c.dtype, c.compute, float(c.alpha), float(c.beta), c.epilogue,
            c.bias is not None, c.c_in is not None, tuple(_alignment(p) if p else 0 for p in ptrs),
            tuple(lt.algo_bytes(i) for i in range(len(lt.candidates))))


def d_extent_bytes(call: Any) -> int:
    from fusec.dtypes import DType

    item = {"f32": 4, "f16": 2, "bf16": 2}.get(call.dtype) or DType(call.dtype).itemsize
    return ((call.batch - 1) * call.stride_c + (call.m - 1) * call.ldc + call.n) * item


def gpu_timer(lt: Any, repeats: int = REPEATS) -> tuple[Callable[[int], float], Callable[[], None]]:
    """(timer, release): times candidate i on a scratch D of the real D's size and alignment
    (mod 256) on a private stream; ``release`` frees the scratch."""
    import cupy

    cupy.cuda.Device().synchronize()  # the weights' upload and anything before it are done
    real_d = lt.call.c
    scratch = cupy.empty(d_extent_bytes(lt.call) + 256, dtype=cupy.uint8)
    base = scratch.data.ptr
    d_ptr = base + (real_d - base) % 256
    stream = cupy.cuda.Stream(non_blocking=True)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    if lt.enqueue(stream.ptr, 0, d_ptr) == 0:  # warm the clocks: ~WARM_MS of the first candidate
        start.record(stream)
        lt.enqueue(stream.ptr, 0, d_ptr)
        end.record(stream)
        end.synchronize()
        one = max(cupy.cuda.get_elapsed_time(start, end), 1e-3)
        for _ in range(min(1000, int(WARM_MS / one))):
            lt.enqueue(stream.ptr, 0, d_ptr)

    def timer(i: int) -> float:
        if lt.enqueue(stream.ptr, i, d_ptr):  # warm-up; a failing candidate is skipped
            stream.synchronize()
            return math.inf
        start.record(stream)
        for _ in range(repeats):
            lt.enqueue(stream.ptr, i, d_ptr)
        end.record(stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / repeats

    def release() -> None:
        stream.synchronize()
        nonlocal scratch
        scratch = None

    return timer, release


def _device_id() -> int:
    import cupy

    return int(cupy.cuda.Device().id)


def prepare(call: Any, handle: Any) -> Any:
    """Make ``call``'s cuBLASLt product now (``call._lt``, which ``GemmCall`` then runs) and pick
    its algorithm; returns the ``LtMatmul``. Call outside any stream capture."""
    from fusec.runtime.cublas import WORKSPACE_BYTES
    from fusec.runtime.cublaslt import LtMatmul

    if call._lt is None:
        call._lt = LtMatmul(call, handle.lt(), handle.workspace.data.ptr, WORKSPACE_BYTES)
    lt = call._lt
    on = enabled()
    if on and len(lt.candidates) > 1:
        key = signature(lt, _device_id())
        if key in _CACHE:
            pick = _CACHE[key]
        else:
            timer, release = gpu_timer(lt)
            try:
                pick = choose(key, len(lt.candidates), timer)
            finally:
                release()
    else:
        pick = choose((), len(lt.candidates), lambda i: 0.0, on=False)
    lt.use(pick["index"])
    lt.pick = pick
    return lt


def picks() -> list[dict[str, Any]]:
    """What this process chose: per timed signature (m, n, k, batch, dtype, epilogue), the index,
    the candidates' times and the heuristic first's time."""
    out = []
    for key, p in list(_CACHE.items()):
        _, m, n, k, batch, *_rest = key
        out.append({"m": m, "n": n, "k": k, "batch": batch, "dtype": key[13], "compute": key[14],
                    "epilogue": key[17], "index": p["index"], "count": p["count"], "times_ms": p["times_ms"]})
    return out
