"""``fusec run MODEL``: run a model on given or random inputs and summarize its outputs."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

from fusec.cli._common import add_command, add_model_arguments, fmt_name, load_model
from fusec.errors import FusecError, InputError
from fusec.ir import Graph

BACKENDS = ("reference", "cuda")
NO_GPU_NOTE = "no GPU found: running the numpy reference backend"


class CudaBackendMissing(FusecError):
    """The cuda backend is not part of this build yet (as opposed to: there is no GPU)."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "run", "run a model and summarize its outputs",
        "Run MODEL once and print each output's name, shape, dtype and a summary (mean, std,\n"
        "the first few values). Inputs come from --inputs (an .npz keyed by input name) or are\n"
        "random but valid for the model: token ids within the embedding table, attention masks\n"
        "of ones, standard normal floats (seeded by --seed).\n\n"
        "--backend defaults to cuda when CuPy finds a GPU, else to the numpy reference backend\n"
        "(with a note on stderr).",
        ["fusec run gpt2-tiny",
         "fusec run gpt2-tiny --backend reference --shapes input_ids:2x32,attention_mask:2x32 --seed 1",
         "fusec run model.onnx --inputs in.npz --save-outputs out.npz"])
    add_model_arguments(p)
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="where to run: cuda (needs a GPU) or reference (numpy, any machine); default: cuda if a GPU is found")
    p.add_argument("--inputs", metavar="IN.npz", help="read the inputs from this .npz file (keyed by input name; no pickles)")
    p.add_argument("--save-outputs", metavar="OUT.npz", help="write the outputs to this .npz file, keyed by output name")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    return p


def run(args: argparse.Namespace) -> int:
    from fusec import device

    backend = args.backend
    explicit = backend is not None
    if backend == "cuda" and not device.gpu_available():
        raise FusecError("no GPU found (CuPy sees no CUDA device); use --backend reference")
    if backend is None:
        backend = "cuda" if device.gpu_available() else "reference"

    if args.save_outputs:
        _check_output_dir(args.save_outputs)  # fail before the run, not after it
    graph = load_model(args)
    inputs = _inputs(args, graph)
    if not explicit and backend == "reference":
        # after loading, so that a bad model or input stays a single line on stderr
        print(NO_GPU_NOTE, file=sys.stderr)
    if backend == "cuda":
        try:
            outputs = _run_cuda(args, graph, inputs)
        except CudaBackendMissing as e:
            if explicit:
                raise FusecError(f"{e}; use --backend reference") from None
            # The default must keep working on a GPU machine while the cuda backend is missing.
            print(f"{e}: running the numpy reference backend", file=sys.stderr)
            backend = "reference"
    if backend == "reference":
        from fusec import reference

        outputs = reference.run(graph, inputs)

    source = f"inputs from {fmt_name(args.inputs)}" if args.inputs else f"random inputs, seed {args.seed}"
    print(f"model {fmt_name(args.model)}  backend {backend}  ({source})")
    for v in graph.inputs:
        print(f"  input  {fmt_name(v.name)}  {v.type_str}")
    for v in graph.outputs:
        print(f"output {fmt_name(v.name)}  {v.type_str}  {summarize(outputs[v.name])}")
    if args.save_outputs:
        from fusec.inputs import save_outputs_npz

        save_outputs_npz(args.save_outputs, outputs)
        print(f"saved outputs to {fmt_name(args.save_outputs)}")
    return 0


def _check_output_dir(path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise InputError(f"cannot write outputs file {path!r}: directory {directory!r} does not exist")
    if os.path.isdir(path):
        raise InputError(f"cannot write outputs file {path!r}: it is a directory")


def _inputs(args: argparse.Namespace, graph: Graph) -> dict[str, np.ndarray]:
    from fusec.inputs import load_inputs_npz, random_inputs

    if args.inputs:
        return load_inputs_npz(args.inputs, graph)
    return random_inputs(graph, seed=args.seed)


def _run_cuda(args: argparse.Namespace, graph: Graph, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Compile ``graph`` for the GPU and run it on ``inputs``; returns {output name: host array}.

    The one place `fusec run` meets the CUDA runtime; it is filled in when ``fusec.runtime``
    lands. Until then it raises CudaBackendMissing, which the default backend choice turns into
    a fall-back to the reference backend and an explicit ``--backend cuda`` into an error.
    """
    try:
        import fusec.runtime  # noqa: F401  (imported lazily: CuPy and NVRTC load only for this backend)
    except ModuleNotFoundError as e:
        if e.name not in ("fusec.runtime", "cupy"):
            raise
        raise CudaBackendMissing(f"the cuda backend is not available ({e.name} is missing)") from None
    raise CudaBackendMissing("the cuda backend is not wired into `fusec run` yet")


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
