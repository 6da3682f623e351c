"""``fusec run MODEL``: run a model on given or random inputs and summarize its outputs."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from fusec.cli import _validate
from fusec.cli._common import SHAPES_HELP, VERBOSE, add_command, add_json_flag, check_fusion_names, fmt_name, note
from fusec.cli.compile import add_compile_arguments
from fusec.errors import FusecError, InputError
from fusec.ir import Graph

BACKENDS = ("reference", "cuda")
NO_GPU_NOTE = "{why}: running the numpy reference backend"
CROSS_NOTE = "compiled the plan for {arch} too ({launches} launches, {kernels} kernels, {secs:.1f}s), to check it builds"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "run", "run a model and summarize its outputs",
        "Run MODEL once and print each output's name, shape, dtype and a summary (mean, std,\n"
        "the first few values). Inputs come from --inputs (an .npz keyed by input name) or are\n"
        "random but valid for the model: token ids within the embedding table, attention masks\n"
        "of ones, standard normal floats (seeded by --seed).\n\n"
        "--backend defaults to cuda when CuPy finds a GPU, else to the numpy reference backend\n"
        "(with a note on stderr). The reference backend runs the optimized, memory-planned graph\n"
        "(every value in one byte arena at its planned offset) in fp32, or with floats stored as\n"
        "--dtype fp16/bf16 to preview that precision, unless --no-optimize is given.\n\n"
        "Validation (like polygraphy/trtexec): --check compares every output with the numpy\n"
        "reference (fp32), --check ort with onnxruntime, --compare OUT.npz with saved outputs; an\n"
        "element matches when |got - want| <= atol + rtol*|want| (defaults by dtype). A table shows\n"
        "per output the max abs/rel error and the mismatch count; any mismatch exits with status 3.\n\n"
        "A .fplan file runs on the cuda backend; --check rebuilds its source model for the\n"
        "reference. A plan holds GPU binaries that run as they are: fusec checks the file and\n"
        "every manifest field before loading code, but run plans only from trusted sources.",
        ["fusec run gpt2-tiny",
         "fusec run gpt2-tiny --backend reference --shapes input_ids:2x32,attention_mask:2x32 --seed 1",
         "fusec run model.onnx --inputs in.npz --save-outputs out.npz --check ort",
         "fusec run gpt2-tiny --save-inputs in.npz --save-outputs want.npz",
         "fusec run gpt2.fplan --inputs in.npz --compare want.npz --atol 1e-2 --rtol 1e-2",
         "fusec run gpt2.fplan --check --stats",
         "fusec run gpt2-tiny --dtype fp32 --check --bisect --bisect-rows 5"])
    p.add_argument("model", metavar="PLAN_OR_MODEL",
                   help="a compiled .fplan file, a built-in model name (see `fusec models`) or an .onnx path; "
                        "a plan is executable GPU code: run plans only from trusted sources")
    p.add_argument("--shapes", metavar="SHAPES", help=SHAPES_HELP + "; default with --inputs: the arrays' shapes")
    add_compile_arguments(p, dtype_help="default fp16 on the cuda backend, fp32 on the reference backend")
    p.add_argument("--no-optimize", action="store_true",
                   help="reference backend: run the raw imported graph instead of the optimized, memory-planned one")
    p.add_argument("--check", nargs="?", const="reference", choices=("reference", "ort"), default=None,
                   help="compare every output with the numpy reference (default) or onnxruntime (--check ort); "
                        "prints a per-output error table, exit status 3 on a mismatch")
    p.add_argument("--compare", metavar="OUT.npz", default=None,
                   help="compare the outputs with the ones saved in this .npz file (exit status 3 on a mismatch)")
    p.add_argument("--atol", type=float, default=None,
                   help="absolute tolerance of --check/--compare (default by dtype: fp32 1e-4, tf32 5e-3, fp16 1e-2, bf16 5e-2)")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance of --check/--compare (default: as --atol)")
    p.add_argument("--stats", action="store_true",
                   help="print the run's counters: launches, syncs, allocations, H2D/D2H bytes (cuda backend only)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="where to run: cuda (needs a GPU) or reference (numpy, any machine); default: cuda if a GPU is found")
    p.add_argument("--inputs", metavar="IN.npz", help="read the inputs from this .npz file (keyed by input name; no pickles)")
    p.add_argument("--save-inputs", metavar="IN.npz", help="write the inputs used (given or random) to this .npz file")
    p.add_argument("--save-outputs", metavar="OUT.npz", help="write the outputs to this .npz file, keyed by output name")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--bisect", action="store_true",
                   help="with --check: run the plan launch by launch on the GPU and compare every launch's output "
                        "with the reference's value of the same IR value; prints the table and the first launch "
                        "that diverges (exit status 3), see fusec.debug")
    p.add_argument("--bisect-rows", metavar="N", type=int, default=None,
                   help="--bisect: show only N launches either side of the first divergence (default: all)")
    add_json_flag(p, "the --bisect report as JSON")
    p.add_argument("--source-model", metavar="MODEL", default=None,
                   help="a plan's source model for --check (default: the built-in it records, or the recorded "
                        "file name next to the plan; its sha256 must match)")
    return p


def run(args: argparse.Namespace) -> int:
    from fusec import device, toolchain

    if args.seed < 0:
        raise InputError(f"--seed must be a non-negative integer, got {args.seed}")
    check_fusion_names(args)
    from fusec.cli.compile import quantize_from_args

    quantize_from_args(args)  # --quantize* checked before anything runs
    bisect = _validate.bisecting(args)
    _check_output_paths(args)  # fail before the run, not after it
    if args.compare:  # every header checked now, before the run; the arrays are read after it
        _validate.load_npz(args.compare, "--compare file", names=())
    plan = load_plan_or_none(args.model)
    backend = args.backend
    explicit = backend is not None
    if bisect:
        _validate.check_bisect(args, plan)  # flags, the plan's source record, the GPU: one line each
        backend = "cuda"
    if plan is not None:
        _plan_needs_cuda(args, plan, backend)
        backend = "cuda"
    elif backend == "cuda":
        why = toolchain.gpu_missing_reason()
        if why is not None:
            raise FusecError(f"--backend cuda needs a GPU: {why}; use --backend reference (numpy, any machine)")
    if backend is None:
        backend = "cuda" if device.gpu_available() else "reference"
    if backend == "reference":
        _refuse_gpu_only_flags(args, explicit)

    from fusec.cli.profile import progress_stage

    t = [("start", time.perf_counter())]
    with progress_stage("build", args.model, enabled=plan is None):
        graph = None if plan is not None else _load_model(args)
    inputs = _inputs(args, graph, plan)
    t.append(("load", time.perf_counter()))
    if args.save_inputs is not None:
        from fusec.inputs import save_outputs_npz

        save_outputs_npz(args.save_inputs, inputs)
    if not explicit and backend == "reference":
        # after loading, so that a bad model or input stays a single line on stderr
        note(NO_GPU_NOTE.format(why=toolchain.gpu_missing_reason(with_fix=False) or "no GPU found"))
        _cross_compile(args, graph)
        t.append(("side compile", time.perf_counter()))
    if bisect:
        return _validate.run_bisect(args, plan, inputs)
    stats = None
    if backend == "cuda":
        outputs, stats, plan = _run_cuda(args, graph, inputs, plan)
        dtype = (plan.manifest.get("dtype") if plan is not None else None) or args.dtype or "fp16"
    else:
        dtype = args.dtype or "fp32"
        outputs = _run_reference(args, graph, inputs)
    t.append(("compile and run" if backend == "cuda" and graph is not None else "run", time.perf_counter()))

    source = f"inputs from {fmt_name(args.inputs)}" if args.inputs else f"random inputs, seed {args.seed}"
    print(f"model {fmt_name(args.model)}  backend {backend}  dtype {dtype}  ({source})")
    for name, arr in inputs.items():
        print(f"  input  {fmt_name(name)}  {_type_str(arr)}")
    for name, arr in outputs.items():
        print(f"output {fmt_name(name)}  {_type_str(arr)}  {summarize(arr)}")
    failures = _validate.validate_outputs(args, graph, plan, inputs, outputs, backend, dtype)
    if args.check or args.compare:
        t.append(("check", time.perf_counter()))
    note("timings: " + ", ".join(f"{name} {t1 - t0:.2f}s" for (_, t0), (name, t1) in zip(t, t[1:])), VERBOSE)
    if args.stats and stats is not None:
        print("stats  " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items()))
    if args.save_inputs is not None:
        note(f"saved inputs to {fmt_name(args.save_inputs)}")
    if args.save_outputs is not None:
        from fusec.inputs import save_outputs_npz

        save_outputs_npz(args.save_outputs, outputs)
        print(f"saved outputs to {fmt_name(args.save_outputs)}")
    if failures:
        raise failures[0]
    return 0


def _plan_needs_cuda(args: argparse.Namespace, plan: Any, backend: str | None) -> None:
    """A plan runs only on the cuda backend: say what to run instead, never send the user in a circle."""
    from fusec import toolchain

    record = plan.manifest.get("source") or {}
    src, shapes = record.get("model"), record.get("shapes") or {}
    if src and record.get("kind") == "file":
        src = os.path.join(os.path.dirname(args.model), str(src))
    if src:
        shape_arg = (" --shapes " + ",".join(f"{k}:{'x'.join(map(str, v))}" for k, v in shapes.items())) if shapes else ""
        instead = f"run its model on the CPU with `fusec run {src} --backend reference{shape_arg}`"
    else:
        instead = "run the model it was compiled from with `fusec run MODEL --backend reference`"
    if backend == "reference":
        raise FusecError(f"{args.model} is a compiled plan (GPU code) and runs only on the cuda backend; {instead}")
    why = toolchain.gpu_missing_reason()
    if why is not None:
        raise FusecError(f"{args.model} is a compiled plan and runs only on a GPU: {why}; {instead}")


def _refuse_gpu_only_flags(args: argparse.Namespace, explicit: bool) -> None:
    """Flags that mean something only on the GPU are refused, never silently ignored."""
    where = "--backend reference" if explicit else "the reference backend (no GPU found)"
    if args.stats:
        raise InputError(f"--stats counts what the GPU did (launches, syncs, copies); {where} has no such counters: "
                         "drop --stats, or run on a GPU")
    if explicit:
        for flag, given in (("--cuda-graph", args.cuda_graph), ("--arch", args.arch is not None)):
            if given:
                raise InputError(f"{flag} applies to compiling for the GPU; {where} compiles nothing: drop {flag}")
    if args.no_optimize and (args.disable_fusion or args.enable_fusion or args.dtype not in (None, "fp32")
                             or args.quantize is not None):
        raise InputError("--no-optimize runs the raw imported graph: --dtype, --quantize and fusion flags do not "
                         "apply to it")


def _cross_compile(args: argparse.Namespace, graph: Graph) -> None:
    """Without a GPU the default run still does the compiler's work: build the plan for the
    target arch (NVRTC needs no device), so a newcomer sees that the CUDA side builds here. A
    failure is one line on stderr; the reference result follows all the same."""
    import time

    import fusec
    from fusec import toolchain
    from fusec.codegen.compile import check_arch, default_arch

    t0 = time.perf_counter()
    dtype = args.dtype or "fp16"
    try:
        toolchain.require_compiler()
        arch = check_arch(args.arch or default_arch(), dtype)
        from fusec.cli.compile import quantize_from_args

        plan = fusec.compile(graph, dtype=dtype, arch=arch, disabled_fusions=args.disable_fusion,
                             enabled_fusions=args.enable_fusion, **quantize_from_args(args))
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 -- the reference result still comes; say in one line why the side compile did not
        from fusec.cli import one_line

        why = toolchain.explain_missing(e) or (str(e).strip().splitlines() or [type(e).__name__])[0]
        note(one_line(f"the side compile for the GPU failed, the reference result follows: {why}"))
        return
    info = plan.info()
    note(CROSS_NOTE.format(arch=info["arch"], launches=info["launches"], kernels=len(plan.manifest["kernels"]),
                           secs=time.perf_counter() - t0))


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


def _run_reference(args: argparse.Namespace, graph: Graph, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The optimized, memory-planned graph (floats stored as --dtype, fusion flags applied) on numpy."""
    from fusec import reference
    from fusec.cli.profile import progress_stage

    if args.no_optimize:
        with progress_stage("reference", None) as step:
            return reference.run(graph, inputs, progress=step)
    from fusec.cli.compile import check_dump_dir
    from fusec.compiler import DTYPES
    from fusec.passes.base import PassOptions
    from fusec.passes.memory_plan import plan_memory
    from fusec.passes.pipeline import optimize

    check_dump_dir(args)
    from fusec.cli.compile import quantize_from_args

    storage, _ = DTYPES[args.dtype or "fp32"]
    opts = PassOptions(storage_dtype=storage, disabled_fusions=frozenset(args.disable_fusion),
                       enabled_fusions=frozenset(args.enable_fusion), **quantize_from_args(args))
    optimized, _ = optimize(graph, opts, dump_dir=args.dump_dir)
    with progress_stage("reference", None) as step:
        return reference.run_planned(optimized, inputs, plan_memory(optimized), progress=step)


def _check_output_paths(args: argparse.Namespace) -> None:
    """--save-outputs/--save-inputs: writable places that are not the model, an input file or each other."""
    from fusec.fsutil import check_output_path

    keep = [p for p in (args.model, args.inputs, args.compare) if p and os.path.isfile(p)]
    for flag, path, what in (("--save-outputs", args.save_outputs, "outputs file"),
                             ("--save-inputs", args.save_inputs, "inputs file")):
        if path is not None:
            check_output_path(path, what, not_same_as=keep)
    if args.save_outputs is not None and args.save_inputs is not None and \
            os.path.abspath(args.save_outputs) == os.path.abspath(args.save_inputs):
        raise InputError("--save-inputs and --save-outputs name the same file")


def _load_model(args: argparse.Namespace) -> Graph:
    """The model with --shapes applied; without --shapes, the shapes of the --inputs arrays."""
    from fusec.loader import load_graph
    from fusec.shapes import parse_shapes

    if args.shapes is not None:
        return load_graph(args.model, parse_shapes(args.shapes))
    shapes = _validate.npz_shapes(args.inputs) if args.inputs else None
    if shapes:
        from fusec.loader import builtin_names

        if args.model in builtin_names():  # a built-in's input names and ranks are known without building it
            import fusec.models

            defaults = dict(fusec.models.get_config(args.model).default_shapes or {})
            if set(defaults) != set(shapes) or any(len(defaults[k]) != len(v) for k, v in shapes.items()):
                shapes = None  # the inputs loader names what does not fit
    if not shapes:
        return load_graph(args.model)
    try:
        return load_graph(args.model, shapes)
    except InputError as e:
        try:
            return load_graph(args.model)  # the inputs loader then says what in the file does not fit
        except InputError:
            raise InputError(f"--inputs {args.inputs!r} (its shapes fix the model's): {e}") from None


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
    result = plan.run(inputs, measure=True)  # the command prints what the driver did
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
