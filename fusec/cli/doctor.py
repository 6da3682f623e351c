"""``fusec doctor``: is everything the GPU path loads here? What is missing, and the command that fixes it."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fusec.cli._common import add_command


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "doctor", "check the CUDA toolchain: driver, GPU, arch, CuPy, NVRTC, cuBLAS, kernel cache",
        "Probe everything fusec's CUDA side loads: the CUDA driver, the GPU and its arch, CuPy, NVRTC\n"
        "(and the archs it compiles for), cuBLAS/cuBLASLt, and the kernel cache directory. For each\n"
        "missing piece it prints the exact command that installs or fixes it.\n\n"
        "Exit status: 0 when plans can be compiled and run here, 1 when the GPU path cannot work\n"
        "(compiling alone needs only CuPy and NVRTC; the last line says which of the two works).",
        ["fusec doctor", "fusec doctor --json"])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def run(args: argparse.Namespace) -> int:
    from fusec import toolchain

    found = toolchain.checks()
    summary = toolchain.summary(found)
    if args.json:
        print(json.dumps({**summary, "versions": toolchain.versions(), "checks": [c.to_json() for c in found]}, indent=2))
        return 0 if summary["can_run"] else 1
    width = max(len(c.name) for c in found)
    for c in found:
        print(f"{c.name:<{width}}  {'ok     ' if c.ok else 'MISSING'}  {c.detail}")
        if not c.ok and c.fix:
            print(f"{'':<{width}}  {'':7}  fix: {c.fix}")
    compile_ = "yes" if summary["can_compile"] else "no"
    run_ = "yes" if summary["can_run"] else "no"
    print(f"compile plans: {compile_}   run plans on a GPU: {run_}   (CUDA {summary['cuda']} packages)")
    return 0 if summary["can_run"] else 1
