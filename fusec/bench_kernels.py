"""``fusec bench --per-kernel``: each launch's GPU time, share, achieved bandwidth or FLOP/s, and
its roofline fraction against ceilings measured on this GPU (GPU only, except the pure helpers).

Time: CUDA events around each launch of an eager run (``Plan.profile``: median of ``repeats``);
each short kernel's time then includes the host's launch gap, so the sum of the launches is an upper
bound of the eager run's GPU time (2-3.5x a graph replay on an H100). With ``graph`` (``fusec bench
--cuda-graph --per-kernel``): each launch's kernels' durations inside bound CUDA-graph replays, from
CUPTI's kernel records (``fusec.runtime.kernel_trace``), the time the launch costs a replay.
Work: a GEMM's FLOPs (2 M N K per batch) and minimum bytes (A, B, C once; a cuBLASLt bias and
residual once) come from its launch record; a kernel's minimum bytes are those of the distinct
values it reads and writes, recorded by the lowering (``report.lowering.launch_bytes``).
Roofline: floor = max(FLOPs / peak FLOP/s, bytes / copy bandwidth); fraction = floor / time.
The two ceilings are measured here (``measure_peaks``: a 1 GiB device-to-device copy counting bytes
read plus written, and an 8192^3 cuBLAS GEMM in the plan's dtype on random data), or given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

_SIZE = {"f32": 4, "f16": 2, "bf16": 2}


def gemm_work(L: Mapping[str, Any]) -> tuple[float, float]:
    """(FLOPs, minimum bytes) of a "gemm" launch record."""
    m, n, k, batch = (int(L[x]) for x in ("m", "n", "k", "batch"))
    size = _SIZE[L["dtype"]]
    a = m * k * (batch if int(L["stride_a"]) else 1)
    b = k * n * (batch if int(L["stride_b"]) else 1)
    c = m * n * batch
    extra = (n if "bias" in L else 0) + (c if "c_in" in L else 0)
    return 2.0 * m * n * k * batch, float((a + b + c + extra) * size)


def entry_launches(manifest: Mapping[str, Any], entry: str | None = None) -> tuple[str, list[dict], list[int] | None]:
    """(entry name, its launch records, the lowering's bytes per launch or None)."""
    from fusec.plan import entry_points

    ents = entry_points(manifest)
    name = entry or next(iter(ents))
    rep = manifest.get("reports", {}).get(name) if "entries" in manifest else manifest.get("report")
    nbytes = ((rep or {}).get("lowering") or {}).get("launch_bytes")
    launches = ents[name]["launches"]
    if not isinstance(nbytes, list) or len(nbytes) != len(launches):
        nbytes = None  # a plan compiled before the lowering recorded them
    return name, launches, nbytes


def rows(manifest: Mapping[str, Any], times_ms: list[float], peaks: Mapping[str, float],
         entry: str | None = None) -> list[dict[str, Any]]:
    """One record per launch: label, kind, ms, share, FLOPs, bytes, TFLOP/s, GB/s, floor, fraction."""
    _, launches, nbytes = entry_launches(manifest, entry)
    total = sum(times_ms) or 1.0
    out = []
    for i, (L, ms) in enumerate(zip(launches, times_ms)):
        if L["type"] == "gemm":
            flops, moved = gemm_work(L)
            kind = f"{'cublaslt[' + L['epilogue'] + ']' if 'epilogue' in L else 'cublas'} {L['m']}x{L['n']}x{L['k']}" \
                   + (f" b{L['batch']}" if int(L["batch"]) > 1 else "")
        else:
            flops, moved = 0.0, float(nbytes[i]) if nbytes is not None else None
            kind = manifest["kernels"][L["kernel"]]["entry"]
        s = ms * 1e-3
        floor_s = max(flops / (peaks["tflops"] * 1e12), (moved or 0.0) / (peaks["gbps"] * 1e9))
        out.append({"index": i, "label": L.get("label", ""), "kind": kind, "ms": ms, "share": ms / total,
                    "flops": flops, "bytes": moved, "tflops": flops / s / 1e12 if s > 0 and flops else None,
                    "gbps": moved / s / 1e9 if s > 0 and moved else None, "floor_ms": floor_s * 1e3,
                    "roofline": floor_s / s if s > 0 and floor_s > 0 else None,
                    "bound": "flops" if flops / (peaks["tflops"] * 1e12) >= (moved or 0.0) / (peaks["gbps"] * 1e9)
                    else "bytes"})
    return out


def event_median_ms(fn: Any, stream: Any, iters: int) -> float:
    """Median over ``iters`` of ``fn()``'s GPU time between two CUDA events on ``stream``, after one
    untimed call (a diagnostic: synchronizes after each)."""
    import cupy

    fn()
    stream.synchronize()
    t = []
    for _ in range(iters):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        t.append(cupy.cuda.get_elapsed_time(a, b))
    return float(np.median(t))


def measure_peaks(dtype: str, compute: str = "f32", iters: int = 10) -> dict[str, Any]:
    """The two ceilings on this GPU: copy bandwidth (GB/s, read + written) and GEMM TFLOP/s in
    ``dtype`` (cuBLAS through fusec's own binding, 8192^3, random data). Median of ``iters``."""
    import cupy

    from fusec.runtime.cublas import GemmCall, Handle

    stream = cupy.cuda.Stream(non_blocking=True)
    n = 1 << 30
    src = cupy.random.default_rng(0).integers(0, 255, n, dtype=cupy.uint8)
    dst = cupy.empty_like(src)

    def timed(fn: Any) -> float:
        return event_median_ms(fn, stream, iters)

    copy_ms = timed(lambda: cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, n, 3, stream.ptr))
    src = dst = None  # free the buffers (the closure above reads them)
    s = 8192
    size = _SIZE[dtype]
    rng = cupy.random.default_rng(1)
    buf = [rng.standard_normal(s * s, dtype=cupy.float32) for _ in range(2)]
    if size == 2:
        if dtype == "f16":
            ops = [x.astype(cupy.float16) for x in buf]
        else:  # bf16: the upper half of each fp32 word
            ops = [(x.view(cupy.uint32) >> 16).astype(cupy.uint16) for x in buf]
    else:
        ops = buf
    c = cupy.empty(s * s * size, dtype=cupy.uint8)
    handle = Handle()
    call = GemmCall(s, s, s, 1, ops[0].data.ptr, ops[1].data.ptr, c.data.ptr, s, s, s, 0, 0, 0, False, False, dtype,
                    compute)
    gemm_ms = timed(lambda: call(handle, stream.ptr))
    handle.close()
    return {"gbps": 2 * n / (copy_ms * 1e-3) / 1e9, "tflops": 2 * s ** 3 / (gemm_ms * 1e-3) / 1e12,
            "dtype": dtype, "compute": compute, "measured": True,
            "how": f"1 GiB device-to-device copy ({copy_ms:.3f} ms, read + written); {s}^3 {dtype} GEMM "
                   f"({gemm_ms:.3f} ms), median of {iters}"}


def per_kernel(plan: Any, repeats: int = 20, peaks: Mapping[str, Any] | None = None, seed: int = 0,
               graph: bool = False) -> dict[str, Any]:
    """The per-kernel profile of ``plan``'s first entry on random inputs (see the module doc).
    ``graph``: times from CUPTI's kernel records of bound CUDA-graph replays
    (``fusec.runtime.kernel_trace``: no launch gaps counted), falling back to per-launch CUDA
    events, with the reason in ``source``, where CUPTI cannot record kernels."""
    from fusec.inputs import random_inputs_for

    name, launches, _ = entry_launches(plan.manifest)
    gemm = next((L for L in launches if L["type"] == "gemm"), None)
    dtype = gemm["dtype"] if gemm else {"fp16": "f16", "bf16": "bf16"}.get(plan.dtype, "f32")
    compute = gemm["compute"] if gemm else "f32"
    pk = dict(peaks) if peaks else measure_peaks(dtype, compute)
    inputs = random_inputs_for(plan.manifest["inputs"] if "entries" not in plan.manifest
                               else plan.manifest["entries"][name]["inputs"], seed)
    replay: dict[str, Any] | None = None
    source = "cuda events around each launch of an eager run"
    if graph:
        from fusec.errors import FusecError
        from fusec.runtime.kernel_trace import graph_launch_times

        try:
            replay = graph_launch_times(plan, inputs, replays=repeats, entry=name)
            source = f"CUPTI kernel records of {replay['replays']} CUDA-graph replays"
        except FusecError as e:
            source += f" (graph replay times unavailable: {e})"
    prof = plan.profile(inputs, repeats=1 if replay else repeats, entry=name)
    times = replay["ms"] if replay else [p["ms"] for p in prof]
    recs = rows(plan.manifest, times, pk, name)
    for r, p in zip(recs, prof):  # the cuBLASLt algorithm picked at load (fusec.runtime.lt_pick)
        r["kind"] += f" {p['algo']}" if "algo" in p else ""
    total = sum(r["ms"] for r in recs)
    floor = sum(r["floor_ms"] for r in recs)
    out = {"entry": name, "peaks": pk, "launches": recs, "kinds": by_kind(recs), "sum_ms": total, "floor_ms": floor,
           "roofline": floor / total if total else None, "source": source}
    if replay:
        out["replay"] = {k: replay[k] for k in ("wall_ms", "busy_ms", "gaps_ms", "other_ms", "overlap_ms", "replays")}
    return out


def by_kind(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The launches grouped by what they run (a kernel, or a cuBLAS(Lt) call of one shape; the
    cuBLASLt algorithm suffix aside): count, total and mean ms, share, and the first launch's label,
    largest total first: where a plan's time goes when one kernel runs once per layer."""
    groups: dict[str, dict[str, Any]] = {}
    total = sum(r["ms"] for r in recs) or 1.0
    for r in recs:
        key = r["kind"].split(" algo ")[0]
        g = groups.setdefault(key, {"kind": key, "count": 0, "ms": 0.0, "label": r["label"]})
        g["count"] += 1
        g["ms"] += r["ms"]
    for g in groups.values():
        g["mean_ms"], g["share"] = g["ms"] / g["count"], g["ms"] / total
    return sorted(groups.values(), key=lambda g: -g["ms"])


def format_table(res: Mapping[str, Any], top: int = 25) -> str:
    pk = res["peaks"]
    lines = [f"per-kernel ({len(res['launches'])} launches, sum {res['sum_ms']:.4f} ms, floor {res['floor_ms']:.4f} ms, "
             f"{100 * (res['roofline'] or 0):.1f}% of roofline); ceilings: {pk['gbps']:.0f} GB/s copy, "
             f"{pk['tflops']:.0f} TFLOP/s {pk.get('dtype', '')} ({pk.get('how', 'given')})",
             f"  times: {res.get('source', 'cuda events around each launch of an eager run')}"]
    if "replay" in res:
        rp = res["replay"]
        lines.append(f"  replay: wall {rp['wall_ms']:.4f} ms = kernels {rp['busy_ms']:.4f} ms + gaps {rp['gaps_ms']:.4f} ms"
                     f" (kernels no launch ran eagerly, e.g. input copies: {rp['other_ms']:.4f} ms; kernels overlapping"
                     f" the one before them (PDL): {rp['overlap_ms']:.4f} ms)")
    lines.append(f"  {'us':>8} {'share':>6} {'TFLOP/s':>8} {'GB/s':>7} {'roof':>5}  kind / label")
    for r in sorted(res["launches"], key=lambda r: -r["ms"])[:top]:
        tf = f"{r['tflops']:.0f}" if r["tflops"] else "-"
        bw = f"{r['gbps']:.0f}" if r["gbps"] else "-"
        roof = f"{100 * r['roofline']:.0f}%" if r["roofline"] else "-"
        lines.append(f"  {1e3 * r['ms']:8.1f} {100 * r['share']:5.1f}% {tf:>8} {bw:>7} {roof:>5}  {r['kind'][:48]}  {r['label'][:40]}")
    kinds = res.get("kinds") or []
    if kinds and len(kinds) < len(res["launches"]):  # some kernel runs more than once: the totals per kind
        lines.append(f"  by kind: {'us':>8} {'share':>6} {'count':>5} {'us each':>8}  kind / first label")
        for g in kinds[:top]:
            lines.append(f"           {1e3 * g['ms']:8.1f} {100 * g['share']:5.1f}% {g['count']:5d} {1e3 * g['mean_ms']:8.2f}"
                         f"  {g['kind'][:48]}  {g['label'][:40]}")
    return "\n".join(lines)
