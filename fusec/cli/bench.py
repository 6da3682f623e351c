"""``fusec bench PLAN_OR_MODEL``: latency of a compiled plan: eager, CUDA graph, bound (GPU only)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fusec.cli._common import add_command, fmt_name
from fusec.cli.compile import add_compile_arguments
from fusec.errors import FusecError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "bench", "time a plan on the GPU: median/p10/p90 latency, host enqueue time, per-kernel profile",
        "Time single requests of a compiled plan with CUDA events: warm-up runs first, then each\n"
        "timed run is one request (inputs already on the device, rotated among a few sets). Modes:\n"
        "eager launches, CUDA-graph replay through run(), and a bound run (plan.bind(): one graph\n"
        "launch, no per-call Python); each reports the GPU time and host_enqueue_ms, the host time of\n"
        "the call. --cuda-graph times the graph modes only. --per-kernel adds each launch's time,\n"
        "share, TFLOP/s or GB/s and roofline fraction against ceilings measured on this GPU: with\n"
        "--cuda-graph, each launch's kernel time inside bound graph replays (CUPTI kernel records;\n"
        "what the launch costs a replay), else CUDA events around each launch of an eager run (a\n"
        "short kernel's time then includes the host's launch gap).\n"
        "fusec's driver counters (CUPTI, with the cupti extra) slow every CUDA call while attached\n"
        "(and every graph node by ~1 us in FUSEC_CUPTI_MODE=always), so bench turns them off for its\n"
        "timings (FUSEC_CUPTI=0) unless FUSEC_CUPTI is set or --per-kernel needs CUPTI; the output says\n"
        "which.\n"
        "PLAN_OR_MODEL is a .fplan file, or a model compiled first with the options below. Needs a GPU.",
        ["fusec bench gpt2.fplan", "fusec bench gpt2-small --dtype fp16 --iters 200 --json",
         "fusec bench bert-base --dtype fp16 --shapes input_ids:32x128,attention_mask:32x128 --per-kernel",
         "fusec bench qwen3-0.6b --dtype bf16 --cuda-graph --per-kernel --top 40"])
    p.add_argument("model", metavar="PLAN_OR_MODEL", help="a .fplan file, a built-in model name or an .onnx path")
    p.add_argument("--shapes", metavar="SHAPES", help="input shapes when compiling a model (see fusec compile --help)")
    add_compile_arguments(p)  # includes --cuda-graph: here it selects the graph modes only
    p.add_argument("--warmup", type=int, default=10, help="untimed runs first (default 10)")
    p.add_argument("--iters", type=int, default=100, help="timed runs per mode (default 100)")
    p.add_argument("--per-kernel", action="store_true",
                   help="also time each launch (graph replays with --cuda-graph, else eager CUDA events) with its "
                        "share, TFLOP/s or GB/s and roofline fraction")
    p.add_argument("--peak-gbps", type=float, default=None, help="copy bandwidth for the roofline (default: measured)")
    p.add_argument("--peak-tflops", type=float, default=None, help="GEMM rate for the roofline (default: measured)")
    p.add_argument("--top", type=int, default=25, help="kernels listed by --per-kernel in text output (default 25)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of text")
    return p


def run(args: argparse.Namespace) -> int:
    from fusec.runtime.counters import off_while_timing

    with off_while_timing(keep=args.per_kernel):  # --per-kernel needs CUPTI's kernel records
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from fusec import device
    from fusec.bench import measure
    from fusec.cli.run import load_plan_or_none

    if args.iters < 1 or args.warmup < 0 or args.top < 0:
        raise FusecError("--iters must be >= 1, --warmup and --top >= 0")
    if (args.peak_gbps is None) != (args.peak_tflops is None) or any(
            x is not None and x <= 0 for x in (args.peak_gbps, args.peak_tflops)):
        raise FusecError("--peak-gbps and --peak-tflops go together, both > 0")
    from fusec.toolchain import require_gpu

    require_gpu("fusec bench (it times plans on a GPU)")  # says why: no CuPy, no driver or no device
    plan = load_plan_or_none(args.model)
    if plan is None:
        from fusec.cli.compile import compile_from_args

        plan = compile_from_args(args)
    single = "entries" not in plan.manifest
    modes = [(True, False)] if args.cuda_graph else [(False, False), (True, False)]
    if single:  # a bound run takes one entry's inputs; generation plans are timed by fusec generate
        modes.append((True, True))
    results = [measure(plan, cuda_graph=g, warmup=args.warmup, iters=args.iters, bound=b) for g, b in modes]
    info = plan.info()
    launches = info.get("launches", sum(len(e["kernels"]) for e in info.get("entries", {}).values()))
    out: dict[str, Any] = {"model": args.model, "device": device.describe(), "arch": info["arch"],
                           "dtype": info["dtype"], "launches": launches, "results": results,
                           "driver_counters": results[-1]["driver_counters"]}
    if args.per_kernel:
        from fusec.bench_kernels import format_table, per_kernel

        peaks = None if args.peak_gbps is None else {"gbps": args.peak_gbps, "tflops": args.peak_tflops,
                                                     "measured": False, "how": "given"}
        out["per_kernel"] = per_kernel(plan, peaks=peaks, graph=args.cuda_graph)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{fmt_name(args.model)} on {out['device']} ({info['dtype']}, {launches} launches per run)")
    print(f"  driver counters: {out['driver_counters']}")
    for r in results:
        print(f"  {r['mode']:<10} median {r['median_ms']:.4f} ms  p10 {r['p10_ms']:.4f}  p90 {r['p90_ms']:.4f}  "
              f"host enqueue {r['host_enqueue_ms']:.4f} ms  ({r['runs']} runs)")
    if args.per_kernel:
        print(format_table(out["per_kernel"], args.top))
    return 0
