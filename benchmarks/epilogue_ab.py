"""GEMM epilogues inside cuBLASLt, before/after on whole plans, with the per-kernel profile and the
host cost of run() vs a bound run (GPU only).

    python benchmarks/epilogue_ab.py OUT.json [gpt2-small|bert-base ...]

"before": every choice key the rule-based default lowers with cuBLASLt forced back to "cublas"
(cuBLAS + the separate epilogue kernel); "after": the rule-based default. For each: CUDA-graph
replay time of the whole plan (median of 200 samples, 10 back-to-back replays per sample, as the
A/B experiments time), single-request times (eager, graph through run(), bound), their host enqueue
time, and the per-kernel profile (fusec.bench_kernels) with the GEMM and epilogue rows summed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

WORKLOADS = {"gpt2-small": ("gpt2-small", 8, 128, "fp16"), "bert-base": ("bert-base", 32, 128, "fp16")}


def lt_keys(model: str, shapes: dict, dtype: str) -> list[str]:
    from fusec.compiler import stage
    from fusec.loader import load_graph
    from fusec.lower.choices import choice_points, choose

    st = stage(load_graph(model, shapes), dtype, "sm_90", dry_run=True)
    return sorted({cp.key for _, cp in choice_points(st.graph) if choose({}, cp) == "cublaslt"})


def summarize(pk: dict[str, Any]) -> dict[str, Any]:
    groups: dict[str, float] = {}
    for r in pk["launches"]:
        k = r["kind"].split(" ")[0] if r["kind"].startswith("cublas") else \
            ("epilogue" if "epilogue" in r["label"] else r["kind"].split("_")[1])
        groups[k] = groups.get(k, 0.0) + r["ms"]
    return {"sum_ms": pk["sum_ms"], "floor_ms": pk["floor_ms"], "roofline": pk["roofline"],
            "by_kind_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1]))}


def run(name: str, peaks: dict | None) -> dict[str, Any]:
    import fusec
    from fusec.bench import measure
    from fusec.bench_kernels import format_table, per_kernel

    model, b, s, dtype = WORKLOADS[name]
    shapes = {"input_ids": (b, s), "attention_mask": (b, s)}
    keys = lt_keys(model, shapes, dtype)
    out: dict[str, Any] = {"workload": name, "lt_keys": keys}
    for side, choices in (("before", {k: "cublas" for k in keys}), ("after", {})):
        plan = fusec.compile(model, shapes=shapes, dtype=dtype, choices=choices, cuda_graph=True)
        r: dict[str, Any] = {"launches": plan.info()["launches"],
                             "lt_gemms": sum(1 for L in plan.manifest["launches"] if "epilogue" in L)}
        r["steady"] = measure(plan, cuda_graph=True, iters=200, batch=10, bound=True)
        r["steady_again"] = measure(plan, cuda_graph=True, iters=200, batch=10, bound=True)  # the spread of one side
        for mode, kw in (("eager", {"cuda_graph": False}), ("graph_run", {"cuda_graph": True}),
                         ("bound", {"cuda_graph": True, "bound": True})):
            r[mode] = measure(plan, iters=100, **kw)
        pk = per_kernel(plan, repeats=20, peaks=peaks)
        peaks = peaks or pk["peaks"]
        r["per_kernel"] = summarize(pk)
        r["per_kernel_top"] = format_table(pk, 12)
        out[side] = r
        print(f"{name} {side}: {r['launches']} launches ({r['lt_gemms']} cuBLASLt), steady "
              f"{r['steady']['median_ms']:.4f} / {r['steady_again']['median_ms']:.4f} ms; single request "
              f"eager {r['eager']['median_ms']:.4f} (host {r['eager']['host_enqueue_ms'] * 1e3:.1f} us), graph run() "
              f"{r['graph_run']['median_ms']:.4f} (host {r['graph_run']['host_enqueue_ms'] * 1e3:.1f} us), bound "
              f"{r['bound']['median_ms']:.4f} (host {r['bound']['host_enqueue_ms'] * 1e3:.1f} us)", flush=True)
        print(f"  per-kernel by kind (ms): {json.dumps({k: round(v, 4) for k, v in r['per_kernel']['by_kind_ms'].items()})}")
        print(r["per_kernel_top"], flush=True)
    out["peaks"] = peaks
    return out


def main() -> None:
    path = sys.argv[1]
    names = sys.argv[2:] or list(WORKLOADS)
    results, peaks = [], None
    for n in names:
        try:
            r = run(n, peaks)
            peaks = r["peaks"]
        except Exception as e:  # keep going
            import traceback

            traceback.print_exc()
            r = {"workload": n, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
