"""``fusec bench PLAN_OR_MODEL``: latency of a compiled plan, eager and CUDA-graph (GPU only)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fusec.cli._common import add_command, fmt_name
from fusec.cli.compile import add_compile_arguments
from fusec.errors import FusecError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "bench", "time a plan on the GPU: median/p10/p90 latency, eager and CUDA graph",
        "Time single requests of a compiled plan with CUDA events: warm-up runs first, then each\n"
        "timed run is one request (inputs already on the device, rotated among a few sets), in\n"
        "both modes: eager launches and CUDA-graph replay. PLAN_OR_MODEL is a .fplan file, or a\n"
        "model that is compiled first with the compile options below. Needs a GPU.",
        ["fusec bench gpt2.fplan", "fusec bench gpt2-small --dtype fp16 --iters 200 --json"])
    p.add_argument("model", metavar="PLAN_OR_MODEL", help="a .fplan file, a built-in model name or an .onnx path")
    p.add_argument("--shapes", metavar="SHAPES", help="input shapes when compiling a model (see fusec compile --help)")
    add_compile_arguments(p)
    p.add_argument("--warmup", type=int, default=10, help="untimed runs first (default 10)")
    p.add_argument("--iters", type=int, default=100, help="timed runs per mode (default 100)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    from fusec import device
    from fusec.bench import measure
    from fusec.cli.run import load_plan_or_none

    if not device.gpu_available():
        raise FusecError("no GPU found (CuPy sees no CUDA device): fusec bench times plans on a GPU")
    if args.iters < 1 or args.warmup < 0:
        raise FusecError("--iters must be >= 1 and --warmup >= 0")
    plan = load_plan_or_none(args.model)
    if plan is None:
        from fusec.cli.compile import compile_from_args

        plan = compile_from_args(args)
    results = [measure(plan, cuda_graph=g, warmup=args.warmup, iters=args.iters) for g in (False, True)]
    info = plan.info()
    out = {"model": args.model, "device": device.describe(), "arch": info["arch"], "dtype": info["dtype"],
           "launches": info["launches"], "results": results}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{fmt_name(args.model)} on {out['device']} ({info['dtype']}, {info['launches']} launches per run)")
    for r in results:
        print(f"  {r['mode']:<10} median {r['median_ms']:.4f} ms  p10 {r['p10_ms']:.4f}  p90 {r['p90_ms']:.4f}  "
              f"({r['runs']} runs, {r['allocations']} allocations in the last)")
    return 0
