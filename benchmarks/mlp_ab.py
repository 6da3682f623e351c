"""The fused MLP (``fusec.lower.mlp``: Linear -> GELU -> Linear [+ bias, residual] in one kernel)
against the unfused form on GPT-2 small fp16, on the GPU (about a minute on an H100).

    python benchmarks/mlp_ab.py [--out DIR] [--shapes 8x128,1x128] [--iters 200]

1. The MLP region (one layer's MLP cut out of the model as the A/B cuts it) at each batch x seq:
   "fused" (the mlp candidate applied: one MlpSpec launch), "unfused" (the rule-based form: two
   cuBLASLt GEMMs with their epilogues inside), "unfused_cublas" (two cuBLAS GEMMs + an epilogue
   kernel each). Each: steady-state time per run of the region as a CUDA graph (median of
   ``--iters`` samples, 10 back-to-back replays per sample, as the A/B times it), the relative error
   against the unfused outputs, and each launch's time inside CUDA-graph replays (CUPTI kernel
   records, ``fusec bench --cuda-graph --per-kernel``; per-launch CUDA events where CUPTI cannot).
2. The whole plan (first shape only) with and without ``mlp`` enabled: steady CUDA-graph time
   (measured A B A B), launches, the outputs' relative difference, and the per-kernel time of the
   MLPs (the fused kernels; or the two MLP GEMMs per layer, 1024x3072x768 and 1024x768x3072).
3. ``fusec.ab.run(..., candidates=["mlp"])``: the A/B experiment itself, and its decision.

Writes DIR/mlp_ab.json and DIR/mlp_ab.md (DIR defaults to the current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

MODEL = "gpt2-small"
DTYPE = "fp16"


def _shapes(text: str) -> dict[str, tuple[int, int]]:
    b, s = (int(x) for x in text.split("x"))
    return {"input_ids": (b, s), "attention_mask": (b, s)}


def _choice_keys(region: Any, overrides: dict[str, bool]) -> list[str]:
    """The kernel-choice keys of the region's unfused products (to force them to plain cuBLAS)."""
    from fusec.compiler import stage
    from fusec.lower.choices import choice_points

    st = stage(region, DTYPE, "sm_90", fusion_overrides=overrides, dry_run=True)
    return sorted({cp.key for _, cp in choice_points(st.graph)})


def _mlp_rows(pk: dict[str, Any], m: int) -> list[dict[str, Any]]:
    """The per-kernel rows of the MLPs: fused kernels, or the MLP-shaped GEMMs and their epilogues."""
    fc, proj = f"{m}x3072x768", f"{m}x768x3072"
    return [r for r in pk["launches"] if r["label"].endswith(" mlp") or fc in r["kind"] or proj in r["kind"]]


def _launch_table(pk: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"label": r["label"], "kind": r["kind"], "us": round(r["ms"] * 1e3, 2),
             "tflops": round(r["tflops"], 1) if r["tflops"] else None} for r in pk["launches"]]


def region_bench(shape: str, iters: int, peaks: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    import numpy as np

    from fusec.ab.decide import rel_error
    from fusec.ab.regions import candidates
    from fusec.ab.runner import GpuRunner
    from fusec.bench import measure
    from fusec.bench_kernels import per_kernel
    from fusec.loader import load_graph

    _, cands = candidates(load_graph(MODEL, _shapes(shape)), "f16", only=["mlp"])
    (c,) = [c for c in cands if c.rule == "mlp"]
    region = c.region.graph
    off = {c.key: False}
    variants = {"fused": ({c.key: True}, {}), "unfused": (off, {}),
                "unfused_cublas": (off, {k: "cublas" for k in _choice_keys(region, off)})}
    runner = GpuRunner()
    plans = {name: runner.build(region, dtype=DTYPE, cuda_graph=True, overrides=o, choices=ch)
             for name, (o, ch) in variants.items()}
    inputs = runner.inputs(plans["unfused"], int(np.random.default_rng().integers(1 << 30)))
    want = runner.outputs(plans["unfused"], inputs)
    out: dict[str, Any] = {"shape": shape, "region": c.region.shape, "candidate": c.key, "count": c.count}
    for name, plan in plans.items():
        t = measure(plan, cuda_graph=True, iters=iters, batch=10)
        pk = per_kernel(plan, repeats=20, peaks=peaks, graph=True)
        peaks = peaks or pk["peaks"]
        out[name] = {"median_us": t["median_ms"] * 1e3, "p10_us": t["p10_ms"] * 1e3, "p90_us": t["p90_ms"] * 1e3,
                     "launches": len(plan.manifest["launches"]), "rel_error": rel_error(runner.outputs(plan, inputs), want),
                     "per_launch": _launch_table(pk), "per_launch_source": pk["source"],
                     "kernel_sum_us": pk["sum_ms"] * 1e3}
        fused_spec = [L for L in plan.manifest["launches"] if L["label"].endswith(" mlp")]
        if fused_spec:
            out[name]["grid"], out[name]["block"], out[name]["smem"] = (fused_spec[0][k] for k in ("grid", "block", "smem"))
        print(f"region {shape} {name}: {out[name]['median_us']:.1f} us (p10 {out[name]['p10_us']:.1f}, p90 "
              f"{out[name]['p90_us']:.1f}), {out[name]['launches']} launches, kernels {out[name]['kernel_sum_us']:.1f} us, "
              f"rel err {out[name]['rel_error']:.2e}", flush=True)
    return out, peaks or {}


def whole_plan_bench(shape: str, iters: int, peaks: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    import fusec
    from fusec.ab.decide import rel_error
    from fusec.ab.runner import GpuRunner
    from fusec.bench import measure
    from fusec.bench_kernels import per_kernel

    shapes = _shapes(shape)
    m = shapes["input_ids"][0] * shapes["input_ids"][1]
    runner = GpuRunner()
    plans = {"without_mlp": fusec.compile(MODEL, shapes=shapes, dtype=DTYPE, cuda_graph=True),
             "with_mlp": fusec.compile(MODEL, shapes=shapes, dtype=DTYPE, cuda_graph=True, enabled_fusions=["mlp"])}
    inputs = runner.inputs(plans["without_mlp"], int(np.random.default_rng().integers(1 << 30)))
    want = runner.outputs(plans["without_mlp"], inputs)
    out: dict[str, Any] = {"shape": shape}
    for rnd in range(2):  # A B A B: drift shows as a difference between rounds
        for name, plan in plans.items():
            t = measure(plan, cuda_graph=True, iters=iters, batch=10)
            out.setdefault(name, {}).setdefault("median_ms", []).append(t["median_ms"])
    for name, plan in plans.items():
        pk = per_kernel(plan, repeats=10, peaks=peaks, graph=True)
        rows = _mlp_rows(pk, m)
        out[name].update({"launches": len(plan.manifest["launches"]), "kernel_sum_ms": pk["sum_ms"],
                          "mlp_kernels_ms": sum(r["ms"] for r in rows), "mlp_launches": len(rows),
                          "per_launch_source": pk["source"],
                          "rel_error": rel_error(runner.outputs(plan, inputs), want)})
        print(f"whole plan {shape} {name}: {out[name]['median_ms']} ms, {out[name]['launches']} launches, "
              f"MLP kernels {out[name]['mlp_kernels_ms']:.4f} ms over {len(rows)} launches, "
              f"rel err {out[name]['rel_error']:.2e}", flush=True)
    return out


def ab_bench(shape: str, iters: int) -> dict[str, Any]:
    import fusec.ab

    t0 = time.perf_counter()
    led = fusec.ab.run(MODEL, shapes=_shapes(shape), dtype=DTYPE, candidates=["mlp"], whole_plan=False,
                       use_cache=False, iters=iters)
    entries = [e for e in led.entries if e.rule == "mlp"]
    out = {"shape": shape, "seconds": time.perf_counter() - t0,
           "entries": [{k: getattr(e, k) for k in ("candidate", "count", "decision", "reason", "max_error",
                                                   "fused", "unfused", "rule_default")} for e in entries],
           "overrides": led.overrides(), "env": led.env}
    for e in entries:
        print(f"A/B {shape}: {e.candidate} x{e.count}: {e.decision} ({e.reason})", flush=True)
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = ["# The fused MLP against the unfused form: GPT-2 small, fp16", "",
             f"GPU: {res['env'].get('gpu')} ({res['env'].get('arch')}), driver {res['env'].get('driver')}, "
             f"NVRTC {res['env'].get('nvrtc')}, fusec {res['env'].get('fusec')}. Produced by `benchmarks/mlp_ab.py`.", ""]
    for r in res["regions"]:
        lines += [f"## One MLP region, batch x seq {r['shape']} ({r['region']})", "",
                  "Steady-state time per run of the region as a CUDA graph (median of 10 back-to-back replays "
                  "per sample); per-launch times inside CUDA-graph replays.", "",
                  "| variant | launches | median us (p10-p90) | kernels us | rel. error vs unfused | per launch (us) |",
                  "|---|---|---|---|---|---|"]
        for name in ("fused", "unfused", "unfused_cublas"):
            v = r[name]
            per = "; ".join(f"{p['kind'].split(' algo ')[0]} {p['us']}" for p in v["per_launch"])
            lines.append(f"| {name} | {v['launches']} | {v['median_us']:.1f} ({v['p10_us']:.1f}-{v['p90_us']:.1f}) | "
                         f"{v['kernel_sum_us']:.1f} | {v['rel_error']:.2e} | {per} |")
        f, u = r["fused"], r["unfused"]
        lines += ["", f"Fused / unfused: {f['median_us'] / u['median_us']:.2f}x. Fused kernel grid {f.get('grid')}, "
                  f"block {f.get('block')}, {f.get('smem')} bytes of shared memory. Per-launch times: "
                  f"{f['per_launch_source']}.", ""]
    w = res.get("whole_plan")
    if w:
        lines += [f"## Whole plan, batch x seq {w['shape']}", "",
                  "| plan | launches | steady ms (round 1, round 2) | MLP kernels ms (launches) | rel. error vs without |",
                  "|---|---|---|---|---|"]
        for name in ("without_mlp", "with_mlp"):
            v = w[name]
            lines.append(f"| {name} | {v['launches']} | {', '.join(f'{x:.4f}' for x in v['median_ms'])} | "
                         f"{v['mlp_kernels_ms']:.4f} ({v['mlp_launches']}) | {v['rel_error']:.2e} |")
        lines.append("")
    a = res.get("ab")
    if a:
        lines += [f"## The A/B experiment (`fusec.ab.run`, candidates=[\"mlp\"]), {a['shape']}", ""]
        for e in a["entries"]:
            lines.append(f"- `{e['candidate']}` (x{e['count']}, rule default {e['rule_default']}): **{e['decision']}**: "
                         f"{e['reason']} (max error {e['max_error']})")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="directory for mlp_ab.json and mlp_ab.md")
    ap.add_argument("--shapes", default="8x128,1x128", help="batch x seq of the region measurements (the first "
                                                             "also for the whole plan and the A/B)")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    from fusec.ab.runner import GpuRunner

    shapes = args.shapes.split(",")
    t0 = time.perf_counter()
    res: dict[str, Any] = {"model": MODEL, "dtype": DTYPE, "env": GpuRunner().environment(), "regions": []}
    peaks: dict[str, Any] | None = None
    for s in shapes:
        r, peaks = region_bench(s, args.iters, peaks)
        res["regions"].append(r)
    res["peaks"] = peaks
    res["whole_plan"] = whole_plan_bench(shapes[0], args.iters, peaks or {})
    res["ab"] = ab_bench(shapes[0], args.iters)
    res["seconds"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mlp_ab.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    with open(os.path.join(args.out, "mlp_ab.md"), "w") as f:
        f.write(markdown(res))
    print(f"wrote {args.out}/mlp_ab.json and mlp_ab.md ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
