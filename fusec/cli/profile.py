"""``fusec profile PLAN_OR_MODEL -o trace.json``: a Chrome/Perfetto trace of one run (GPU).

Also home of the arguments the report commands share (profile, export-graph, memory): what to
report on (a plan, or a model with the compile options that shape its fused graph).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from fusec.cli._common import SHAPES_HELP, add_command, add_fusion_arguments, check_fusion_names, fmt_name, note
from fusec.errors import FusecError, InputError

TARGET_HELP = ("a compiled .fplan file, a built-in model name (see `fusec models`) or an .onnx path "
               "(a model is compiled first, with --dtype/--arch/--shapes and the fusion flags)")


def add_subject_arguments(p: argparse.ArgumentParser) -> None:
    """PLAN_OR_MODEL and the options that decide its fused graph (shared by the report commands)."""
    p.add_argument("model", metavar="PLAN_OR_MODEL", help=TARGET_HELP)
    p.add_argument("--shapes", metavar="SHAPES", help=SHAPES_HELP + "; a plan has its own")
    p.add_argument("--dtype", choices=("fp32", "tf32", "fp16", "bf16"), default=None,
                   help="a model: storage/math of float tensors (default fp16); a plan has its own")
    p.add_argument("--arch", metavar="sm_XX", default=None,
                   help="a model: target GPU architecture (default: current GPU, else sm_90); a plan has its own")
    add_fusion_arguments(p)
    p.add_argument("--model", dest="source", metavar="MODEL", default=None,
                   help="a plan: the model (or decoder) it was compiled from, when the plan does not record "
                        "it or the recorded file is not next to the plan")
    p.add_argument("--entry", metavar="NAME", default=None,
                   help="a plan with several entry points (prefill, decode): which one (default: the first)")


def terminal_progress() -> Any:
    """compile's progress line (``fusec.cli.compile.Progress``) where someone watches: on a terminal
    unless -q, and always with -v (a line per step). None otherwise: nothing goes to stderr."""
    from fusec.cli import _common
    from fusec.cli.compile import Progress

    if _common.VERBOSITY >= _common.VERBOSE or (sys.stderr.isatty() and _common.VERBOSITY > _common.QUIET):
        return Progress()
    return None


@contextlib.contextmanager
def progress_stage(stage: str, item: str | None, enabled: bool = True) -> Iterator[Any]:
    """A long stage (model build, plan write, reference run) on the progress line; yields the
    progress callable (``progress(stage, item)``, or None when nobody watches) for its steps.
    ``item``: what the line shows at once (None: nothing until the first step)."""
    progress = terminal_progress() if enabled else None
    if progress is not None and item is not None:
        progress(stage, item)
    try:
        yield progress
    finally:
        if progress is not None:
            progress.done()


def subject_from_args(args: argparse.Namespace) -> Any:
    """Resolve PLAN_OR_MODEL (see ``fusec.report.subject.load_subject``), with progress on stderr."""
    from fusec.report.subject import is_plan_file, load_subject
    from fusec.shapes import parse_shapes

    check_fusion_names(args)
    if is_plan_file(args.model) and (args.shapes is not None or args.dtype is not None or args.arch is not None):
        raise InputError("--shapes, --dtype and --arch apply to a model; a plan was compiled with its own")
    shapes = parse_shapes(args.shapes) if args.shapes is not None else None
    progress = terminal_progress()  # building a large model takes a while
    try:
        return load_subject(args.model, shapes=shapes, dtype=args.dtype or "fp16", arch=args.arch,
                            disabled_fusions=args.disable_fusion, enabled_fusions=args.enable_fusion,
                            model=args.source, entry=args.entry, progress=progress)
    finally:
        if progress is not None:
            progress.done()


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "profile", "write a Chrome/Perfetto trace of one run (GPU)",
        "Run PLAN_OR_MODEL once on the GPU (after a warm-up run) and write a trace in the Trace Event\n"
        "Format JSON, which ui.perfetto.dev and chrome://tracing open: one slice per launch on a\n"
        "GPU track, named after the ops its kernel fuses (matmul+add+gelu), with the kernel, the\n"
        "fusion rule and the launch's label in its arguments; the host's enqueue time per launch on\n"
        "a second track. GPU times come from CUDA events around each launch (the trace's otherData\n"
        "says so). Inputs are random but valid (--seed). For NVTX ranges in Nsight Systems instead,\n"
        "run with FUSEC_NVTX=1.",
        ["fusec profile gpt2-small -o trace.json",
         "fusec profile gpt2.fplan -o trace.json --warmup 3",
         "fusec profile gen.fplan --entry decode -o decode.json"])
    add_subject_arguments(p)
    p.add_argument("-o", "--output", metavar="TRACE.json", required=True, help="the trace file to write")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="runs before the traced one (default 1, at least 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    return p


def run(args: argparse.Namespace) -> int:
    from fusec import device
    from fusec.fsutil import check_output_path

    if args.warmup < 1:
        raise InputError(f"--warmup must be at least 1 (the warm-up run stages the inputs), got {args.warmup}")
    if args.seed < 0:
        raise InputError(f"--seed must be a non-negative integer, got {args.seed}")
    check_output_path(args.output, "trace file", not_same_as=[args.model] if os.path.isfile(args.model) else [])
    if not device.gpu_available():
        raise FusecError("fusec profile runs the plan on a GPU, and CuPy sees no CUDA device; `fusec memory` and "
                         "`fusec export-graph` work without one")
    sub = subject_from_args(args)
    with progress_stage("kernel", None) as step:
        plan = sub.compiled(step)
    from fusec.inputs import random_inputs_for
    from fusec.plan import entry_points
    from fusec.report.trace import profile_plan, write_trace

    signature = entry_points(plan.manifest)[sub.entry]["inputs"]
    inputs = random_inputs_for(signature, seed=args.seed)
    launches = sub.describe()
    naming = "fused ops of the rebuilt graph" if sub.graph is not None else f"launch labels ({sub.missing})"
    doc = profile_plan(plan, launches, inputs, entry=sub.entry, warmup=args.warmup,
                       meta={"source": args.model, "slice_names": naming, "seed": args.seed})
    write_trace(args.output, doc)
    slices = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e["pid"] == 1]
    other = doc["otherData"]
    print(f"wrote {fmt_name(args.output)}: {len(slices)} kernel slices, GPU busy {other['gpu_busy_us']:.1f} us "
          f"of {other['gpu_span_us']:.1f} us ({other['gpu_timing']}); open it in ui.perfetto.dev")
    for e in sorted(slices, key=lambda e: -e["dur"])[:5]:
        print(f"  {e['dur']:9.1f} us  #{e['args']['launch']:<4} {fmt_name(e['name'])}")
    if sub.graph is None:
        note(f"slices are named after the launch labels: {sub.missing}")
    return 0
