"""``fusec ab MODEL``: measure every fusion candidate and kernel choice, print the ledger.

Also the helpers ``fusec compile --ab`` / ``--decisions LEDGER.json`` use (``ledger_for_compile``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from fusec.cli._common import add_command, add_json_flag, add_model_arguments, note
from fusec.errors import InputError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "ab", "A/B-measure every fusion and kernel choice on the GPU; print the ledger",
        "For every fusion candidate the passes record (whole MLP, norm into GEMM, GEMM epilogues and\n"
        "prologues, reductions, elementwise chains) and every kernel choice with alternatives (cuBLAS +\n"
        "epilogue kernel vs fusec's GEMM with the epilogue fused; GEMV for M <= 8), cut the region out of\n"
        "the model, build both variants, compare their outputs (dtype tolerance; a wrong variant is\n"
        "rejected whatever its speed), time both in the plan's execution mode and keep the fused form only\n"
        "when it is faster by more than the p10-p90 spread and 3%. Then time the rule-based, all-unfused and\n"
        "assembled plans. Needs a GPU. Results are cached under $FUSEC_CACHE_DIR/ab.",
        ["fusec ab gpt2-small --shapes input_ids:8x128 --dtype fp16 --cuda-graph",
         "fusec ab qwen3-0.6b --shapes input_ids:1x128 --dtype bf16 --cuda-graph --json-out ledger.json",
         "fusec compile gpt2-small -o g.fplan --decisions ledger.json"])
    add_model_arguments(p)
    p.add_argument("--dtype", choices=("fp32", "tf32", "fp16", "bf16"), default="fp16", help="storage/math dtype (default fp16)")
    p.add_argument("--cuda-graph", action="store_true", help="time as the plan runs with CUDA-graph replay")
    add_ab_arguments(p)
    add_json_flag(p, "the ledger as one JSON object")
    p.add_argument("--json-out", metavar="FILE", default=None,
                   help="also write the ledger as JSON to FILE (what `fusec compile --decisions FILE` reads)")
    return p


def add_ab_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ab-budget", metavar="SECONDS", type=float, default=None,
                   help="stop measuring after SECONDS (largest expected effect first); the rest are 'not measured (budget)'")
    p.add_argument("--ab-candidates", metavar="LIST", default=None,
                   help="comma-separated candidate keys, rules (mlp, gemm_epilogue, choice, ...) or member labels")
    p.add_argument("--no-ab-cache", action="store_true", help="re-measure instead of using cached A/B results")


class AbProgress:
    """``[i/n] candidate`` on stderr: rewritten in place on a terminal, one line each otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def __call__(self, i: int, n: int, name: str) -> None:
        from fusec.cli import _common

        if _common.VERBOSITY <= _common.QUIET:
            return
        width = 30
        bar = "#" * (width * i // max(n, 1))
        msg = f"[{time.perf_counter() - self.t0:6.1f}s] ab [{bar:<{width}}] {i}/{n} {name[:60]}"
        if self.tty:
            sys.stderr.write("\r" + msg.ljust(120))
            if name == "done":
                sys.stderr.write("\n")
        else:
            sys.stderr.write(msg + "\n")
        sys.stderr.flush()


def run_from_args(args: argparse.Namespace):
    import fusec.ab
    from fusec.shapes import parse_shapes

    shapes = parse_shapes(args.shapes) if args.shapes is not None else None
    only = [s.strip() for s in args.ab_candidates.split(",") if s.strip()] if args.ab_candidates else None
    if args.ab_budget is not None and args.ab_budget < 0:
        raise InputError(f"--ab-budget must be >= 0 seconds, got {args.ab_budget}")
    from fusec.runtime.counters import off_while_timing

    with off_while_timing():  # attached counters would charge each graph node ~1 us: more to the unfused side
        return fusec.ab.run(args.model, shapes=shapes, dtype=args.dtype, cuda_graph=args.cuda_graph, candidates=only,
                            budget_s=args.ab_budget, progress=AbProgress(), use_cache=not args.no_ab_cache)


def ledger_for_compile(args: argparse.Namespace):
    """The ledger ``fusec compile`` applies: measured now (``--ab``), loaded (``--decisions``), or None."""
    from fusec.ab.ledger import Ledger, LedgerError

    if getattr(args, "ab", False) and getattr(args, "decisions", None):
        raise InputError("--ab and --decisions exclude each other: measure now, or reuse a ledger")
    if getattr(args, "decisions", None):
        ledger = Ledger.load(args.decisions)
        if ledger.dtype != args.dtype:
            raise LedgerError(f"{args.decisions}: field 'dtype' is {ledger.dtype!r}, but this compile uses {args.dtype!r}; "
                              f"its kernel-choice keys would not match")
        mode = getattr(args, "fp32_gemm", "3xtf32")
        if args.dtype == "fp32" and ledger.fp32_gemm != mode:
            raise LedgerError(f"{args.decisions}: field 'fp32_gemm' is {ledger.fp32_gemm!r}, but this compile uses "
                              f"--fp32-gemm {mode}; its kernel-choice keys would not match")
        if ledger.model != args.model and os.path.basename(ledger.model) != os.path.basename(args.model):
            print(f"fusec: warning: ledger {args.decisions} was measured on {ledger.model!r}, compiling {args.model!r}",
                  file=sys.stderr)
        return ledger
    if getattr(args, "ab", False):
        return run_from_args(args)
    return None


def run(args: argparse.Namespace) -> int:
    from fusec.fsutil import atomic_write, check_output_path

    if args.json_out is not None:  # before measuring: not a directory, device node, or the model
        check_output_path(args.json_out, "ledger file", not_same_as=[args.model] if os.path.isfile(args.model) else [])
    from fusec import toolchain
    from fusec.ab.runner import GpuRunner

    toolchain.require_gpu("fusec ab")
    GpuRunner()  # fails in one line, before any work, where there is no GPU
    ledger = run_from_args(args)
    print(ledger.to_json() if args.json else ledger.to_table())
    if args.json_out is not None:
        with atomic_write(args.json_out, what="ledger file") as f:  # Ctrl-C leaves no half-written ledger
            f.write(ledger.to_json().encode("utf-8"))
        note(f"ledger written to {args.json_out}")
    return 0
