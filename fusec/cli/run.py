"""``fusec run MODEL``: run a model on given or random inputs and summarize its outputs."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

from fusec.cli._common import SHAPES_HELP, add_command, fmt_name, load_model
from fusec.cli.compile import add_compile_arguments
from fusec.errors import FusecError, InputError
from fusec.ir import Graph

BACKENDS = ("reference", "cuda")
NO_GPU_NOTE = "no GPU found: running the numpy reference backend"
CROSS_NOTE = "no GPU found: compiled the plan for {arch} ({launches} launches, {kernels} kernels, {secs:.1f}s) to check it builds"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "run", "run a model and summarize its outputs",
        "Run MODEL once and print each output's name, shape, dtype and a summary (mean, std,\n"
        "the first few values). Inputs come from --inputs (an .npz keyed by input name) or are\n"
        "random but valid for the model: token ids within the embedding table, attention masks\n"
        "of ones, standard normal floats (seeded by --seed).\n\n"
        "--backend defaults to cuda when CuPy finds a GPU, else to the numpy reference backend\n"
        "(with a note on stderr). The reference backend runs the optimized, memory-planned graph\n"
        "(every value in one byte arena at its planned offset) unless --no-optimize is given.\n"
        "A .fplan file runs on the cuda backend; --check rebuilds its source model for the\n"
        "reference. A plan holds GPU binaries that run as they are: fusec checks the file and\n"
        "every manifest field before loading code, but run plans only from trusted sources.",
        ["fusec run gpt2-tiny",
         "fusec run gpt2-tiny --backend reference --shapes input_ids:2x32,attention_mask:2x32 --seed 1",
         "fusec run model.onnx --inputs in.npz --save-outputs out.npz",
         "fusec run gpt2.fplan --check --stats"])
    p.add_argument("model", metavar="PLAN_OR_MODEL",
                   help="a compiled .fplan file, a built-in model name (see `fusec models`) or an .onnx path; "
                        "a plan is executable GPU code: run plans only from trusted sources")
    p.add_argument("--shapes", metavar="SHAPES", help=SHAPES_HELP)
    add_compile_arguments(p)
    p.add_argument("--no-optimize", action="store_true",
                   help="reference backend: run the raw imported graph instead of the optimized, memory-planned one")
    p.add_argument("--check", action="store_true",
                   help="also run the numpy reference backend and print the max relative error per output")
    p.add_argument("--stats", action="store_true",
                   help="print the run's counters: launches, syncs, allocations, H2D/D2H bytes (cuda backend)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="where to run: cuda (needs a GPU) or reference (numpy, any machine); default: cuda if a GPU is found")
    p.add_argument("--inputs", metavar="IN.npz", help="read the inputs from this .npz file (keyed by input name; no pickles)")
    p.add_argument("--save-outputs", metavar="OUT.npz", help="write the outputs to this .npz file, keyed by output name")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    return p


def run(args: argparse.Namespace) -> int:
    from fusec import device

    if args.seed < 0:
        raise InputError(f"--seed must be a non-negative integer, got {args.seed}")
    if args.save_outputs is not None:
        _check_output_dir(args)  # fail before the run, not after it
    plan = load_plan_or_none(args.model)
    backend = args.backend
    explicit = backend is not None
    if plan is not None and backend == "reference":
        raise FusecError("a .fplan file runs on the cuda backend; give the model itself for --backend reference")
    if backend == "cuda" or plan is not None:
        if not device.gpu_available():
            raise FusecError("no GPU found (CuPy sees no CUDA device); use --backend reference")
        backend = "cuda"
    if backend is None:
        backend = "cuda" if device.gpu_available() else "reference"

    graph = None if plan is not None else load_model(args)
    inputs = _inputs(args, graph, plan)
    if not explicit and backend == "reference":
        # after loading, so that a bad model or input stays a single line on stderr
        print(NO_GPU_NOTE, file=sys.stderr)
        _cross_compile(args, graph)
    stats = None
    if backend == "cuda":
        outputs, stats, plan = _run_cuda(args, graph, inputs, plan)
    else:
        outputs = _run_reference(args, graph, inputs)

    source = f"inputs from {fmt_name(args.inputs)}" if args.inputs else f"random inputs, seed {args.seed}"
    print(f"model {fmt_name(args.model)}  backend {backend}  ({source})")
    for name, arr in inputs.items():
        print(f"  input  {fmt_name(name)}  {_type_str(arr)}")
    for name, arr in outputs.items():
        print(f"output {fmt_name(name)}  {_type_str(arr)}  {summarize(arr)}")
    if args.check:
        ref_graph = graph if graph is not None else _source_graph(plan)
        from fusec import reference

        want = reference.run(ref_graph, inputs)
        for name, arr in outputs.items():
            err = _rel_err(arr, want[name])
            print(f"check  {fmt_name(name)}  max relative error {err:.3e} (vs the numpy reference, fp32)")
    if args.stats and stats is not None:
        print("stats  " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()))
    if args.save_outputs is not None:
        from fusec.inputs import save_outputs_npz

        save_outputs_npz(args.save_outputs, outputs)
        print(f"saved outputs to {fmt_name(args.save_outputs)}")
    return 0


def _cross_compile(args: argparse.Namespace, graph: Graph) -> None:
    """Without a GPU the default run still does the compiler's work: build the plan for the
    target arch (NVRTC needs no device), so a newcomer sees that the CUDA side builds here."""
    import time

    import fusec

    t0 = time.perf_counter()
    try:
        plan = fusec.compile(graph, dtype=args.dtype, arch=args.arch, disabled_fusions=args.disable_fusion,
                             enabled_fusions=args.enable_fusion)
    except ImportError as e:  # installed without the cuda12/cuda13 extra: no CuPy or NVRTC
        print(f"no GPU found, and the CUDA compiler is not installed ({e}); install fusec[cuda13] "
              f"to compile plans", file=sys.stderr)
        return
    info = plan.info()
    print(CROSS_NOTE.format(arch=info["arch"], launches=info["launches"], kernels=len(plan.manifest["kernels"]),
                            secs=time.perf_counter() - t0), file=sys.stderr)


def _type_str(arr: np.ndarray) -> str:
    from fusec.dtypes import DType

    return f"{DType.from_np(arr.dtype).value}[{','.join(str(d) for d in arr.shape)}]"


def load_plan_or_none(model: str):
    """A validated Plan if ``model`` names a plan file (by its magic bytes), else None."""
    from fusec.planfile import MAGIC

    if not os.path.isfile(model):
        return None
    with open(model, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            return None
    import fusec

    return fusec.load(model)


def _source_graph(plan) -> Graph:
    from fusec.loader import load_graph

    src = plan.manifest.get("source", {})
    if not src.get("model"):
        raise FusecError("--check: this plan does not record its source model (compiled from an in-memory ONNX model)")
    try:
        return load_graph(src["model"], {k: tuple(v) for k, v in src.get("shapes", {}).items()} or None)
    except FusecError as e:
        raise FusecError(f"--check: cannot rebuild the plan's source model {src['model']!r}: {e}") from None


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| over all elements (floats compared in float64)."""
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30)) if w.size else 0.0


def _run_reference(args: argparse.Namespace, graph: Graph, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from fusec import reference

    if args.no_optimize:
        return reference.run(graph, inputs)
    from fusec.passes.memory_plan import plan_memory
    from fusec.passes.pipeline import optimize

    optimized, _ = optimize(graph)
    return reference.run_planned(optimized, inputs, plan_memory(optimized))


def _check_output_dir(args: argparse.Namespace) -> None:
    """--save-outputs: a writable place that is neither the model nor the inputs file."""
    from fusec.fsutil import check_output_path

    keep = [p for p in (args.model, args.inputs) if p and os.path.isfile(p)]
    check_output_path(args.save_outputs, "outputs file", not_same_as=keep)


def _inputs(args: argparse.Namespace, graph: Graph | None, plan: Any) -> dict[str, np.ndarray]:
    from fusec.inputs import load_inputs_npz, random_inputs, random_inputs_for

    if graph is None:
        sig = plan.manifest["inputs"]
        if args.inputs:
            from fusec.dtypes import DType
            from fusec.ir import Value

            stub = Graph([Value(d["name"], d["shape"], DType(d["dtype"])) for d in sig], [], [])
            return load_inputs_npz(args.inputs, stub, bounds={d["name"]: d.get("bound") for d in sig})
        return random_inputs_for(sig, seed=args.seed)
    if args.inputs:
        return load_inputs_npz(args.inputs, graph)
    return random_inputs(graph, seed=args.seed)


def _run_cuda(args: argparse.Namespace, graph: Graph | None, inputs: dict[str, np.ndarray], plan: Any):
    """Compile ``graph`` (unless a plan was given) and run it once on the GPU; returns
    ({output name: host array}, the run's stats, the plan)."""
    import cupy

    from fusec.dtypes import DType

    if plan is None:
        from fusec.cli.compile import compile_from_args

        plan = compile_from_args(args)
    result = plan.run(inputs)
    stats = plan.stats()
    outputs = {}
    for d in plan.manifest["outputs"]:
        host = cupy.asnumpy(result[d["name"]])
        outputs[d["name"]] = host.view(DType.BF16.np) if d["dtype"] == "bf16" else host
    return outputs, stats, plan


def summarize(arr: np.ndarray, n: int = 4) -> str:
    """``mean=… std=… values=[…]`` on one line; non-finite values are counted, not averaged."""
    a = np.asarray(arr)
    f = a.astype(np.float64)  # bool, int, fp16 and bf16 alike
    finite = np.isfinite(f)
    parts = []
    if finite.any():
        parts.append(f"mean={float(f[finite].mean()):.6g}")
        parts.append(f"std={float(f[finite].std()):.6g}")
    bad = int(f.size - finite.sum())
    if bad:
        parts.append(f"nonfinite={bad}")
    flat = (a if a.dtype.kind in "biu" else f).reshape(-1)[:n]
    shown = ", ".join(_fmt_scalar(x) for x in flat.tolist())
    parts.append(f"values=[{shown}{', ...' if a.size > n else ''}]")
    return "  ".join(parts)


def _fmt_scalar(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.6g}"
    return str(x)
