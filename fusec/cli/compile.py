"""``fusec compile MODEL -o PLAN``: compile a model into a plan file (works without a GPU)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from fusec.cli import _common
from fusec.cli._common import add_command, add_fusion_arguments, add_model_arguments, check_fusion_names, fmt_name, note
from fusec.errors import InputError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "compile", "compile a model into a runnable plan file (.fplan)",
        "Import MODEL, run the optimization passes (pattern recognition, weight-transpose caching,\n"
        "fusion, memory planning), render and compile the CUDA kernels with NVRTC for --arch, and\n"
        "write one plan file: manifest, weights, kernel sources and binaries (no pickle).\n"
        "Works on a machine without a GPU (cross-compiles; --arch defaults to the current GPU's,\n"
        "else sm_90). Progress goes to stderr.",
        ["fusec compile gpt2-small -o gpt2.fplan --dtype fp16 --cuda-graph",
         "fusec compile model.onnx -o m.fplan --shapes input_ids:8x128,attention_mask:8x128 --arch sm_80",
         "fusec compile gpt2-tiny -o g.fplan --dump-dir dumps/ --disable-fusion gemm_epilogue",
         "fusec compile gpt2-small -o g.fplan --cuda-graph --ab          (measure on this GPU, then compile)",
         "fusec compile gpt2-small -o g.fplan --cuda-graph --decisions ledger.json",
         "fusec compile g.fplan --arch sm_80 -o g80.fplan          (re-target a plan to another GPU arch)"])
    add_model_arguments(p, help="a built-in model name (see `fusec models`), an .onnx or .gguf file, or a plan to "
                                "re-target; with --generate also a Hugging Face checkpoint directory or hub id "
                                "(org/name, from the local Hugging Face cache)")
    p.add_argument("--from-source", action="store_true",
                   help="MODEL is a plan: compile its recorded source model again for --arch (default: recompile "
                        "the plan's bundled kernel sources)")
    p.add_argument("--source-model", metavar="MODEL", default=None,
                   help="with --from-source: the plan's source file (default: the recorded name next to the plan)")
    add_compile_arguments(p, dtype_help="default fp16, bf16 with --generate (as `fusec generate` compiles)")
    from fusec.cli.ab import add_ab_arguments

    p.add_argument("--ab", action="store_true", help="A/B-measure every fusion and kernel choice first (needs a GPU; "
                                                     "see `fusec ab`) and compile with the decisions")
    p.add_argument("--decisions", metavar="LEDGER", default=None,
                   help="compile with the decisions of a ledger from `fusec ab --json-out FILE` (no measuring)")
    add_ab_arguments(p)
    from fusec.cli.generate import add_generation_arguments

    add_generation_arguments(p, for_compile=True)
    p.add_argument("-o", "--output", metavar="PLAN", required=True, help="the plan file to write (.fplan)")
    return p


DTYPES = ("fp32", "tf32", "fp16", "bf16")


def add_compile_arguments(p: argparse.ArgumentParser, dtype_help: str = "default fp16") -> None:
    """Options shared by every command that compiles (compile, run, bench). --dtype defaults to
    None here: ``compile_from_args`` reads None as fp16 (``run`` gives the reference backend fp32)."""
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="storage/math of float tensors (fp32 accumulation always; tf32: fp32 storage, "
                        f"tf32 matrix products; fp16/bf16 need sm_80+); {dtype_help}")
    p.add_argument("--arch", metavar="sm_XX", default=None,
                   help="target GPU architecture, checked against what this NVRTC compiles for "
                        "(default: current GPU, else sm_90; `fusec doctor` lists them)")
    p.add_argument("--cuda-graph", action="store_true", help="capture the launch list once and replay it as a CUDA graph")
    p.add_argument("--dump-dir", metavar="DIR", default=None, help="write the graph after each pass as DIR/NN-<pass>.txt")
    p.add_argument("--fp32-gemm", choices=("3xtf32", "sgemm"), default="3xtf32",
                   help="--dtype fp32 on sm_80+: products with a constant weight as one 3xTF32 tensor-core GEMM "
                        "(fp32-accurate, 3x the weight bytes of those products; the default) or cuBLAS's exact "
                        "SGEMM (sgemm); `fusec inspect` counts them as gemms_split_tf32")
    add_fusion_arguments(p)
    add_quantize_arguments(p)


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", choices=("int8", "int4"), default=None,
                   help="weight-only quantization of the products with constant weights: int8 (per-channel) or int4 "
                        "(group-wise with zero points), round-to-nearest; the LM head and embeddings stay in "
                        "--dtype (a GGUF file's own quantization is kept as it is)")
    p.add_argument("--quantize-group", type=int, choices=(32, 128), default=128, metavar="G",
                   help="--quantize int4: weights per scale, 32 or 128 (default 128)")
    p.add_argument("--quantize-head", action="store_true", help="--quantize: quantize the LM head too")


def quantize_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The quantize keywords of fusec.compile / compile_generation from --quantize* (checked)."""
    from fusec.compiler import quantize_options

    method = getattr(args, "quantize", None)
    if method is None and (getattr(args, "quantize_head", False) or getattr(args, "quantize_group", 128) != 128):
        raise InputError("--quantize-group/--quantize-head apply only with --quantize")
    if method == "int8" and getattr(args, "quantize_group", 128) != 128:
        raise InputError("--quantize-group applies to --quantize int4 (int8 is per channel)")
    return quantize_options(method, getattr(args, "quantize_group", 128), getattr(args, "quantize_head", False))


def check_compile_options(args: argparse.Namespace) -> str:
    """Everything about a compile that can be wrong before any work starts: the fusion names, the
    toolchain (CuPy, NVRTC) and --arch against this NVRTC and --dtype. Returns the target arch."""
    from fusec import toolchain
    from fusec.codegen.compile import check_arch, default_arch

    check_fusion_names(args)
    toolchain.require_compiler()
    return check_arch(args.arch or default_arch(), getattr(args, "dtype", None) or "fp16")


def check_dump_dir(args: argparse.Namespace) -> None:
    """--dump-dir must be a directory or not exist yet (it is created)."""
    d = getattr(args, "dump_dir", None)
    if d is None:
        return
    if not d:
        raise InputError("--dump-dir is empty")
    if os.path.exists(d) and not os.path.isdir(d):
        raise InputError(f"--dump-dir {d!r} exists and is not a directory")


def plural(word: str, n: int = 2) -> str:
    """``pass`` -> ``passes``, ``kernel`` -> ``kernels`` (n != 1)."""
    if n == 1:
        return word
    return word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")


# One-step stages: shown on the progress line while they run, left out of the closing summary.
_UNCOUNTED = ("build", "write")


class Progress:
    """One status line on stderr (rewritten in place on a terminal, a line per stage otherwise);
    nothing with -q, every step with its time with -v."""

    def __init__(self) -> None:
        self.level = _common.VERBOSITY
        self.tty = sys.stderr.isatty() and _common.QUIET < self.level < _common.VERBOSE  # -q: not even the clearing
        self.counts: dict[str, int] = {}
        self.t0 = time.perf_counter()
        self._stage = ""
        self._stage_t0 = self.t0
        self.times: dict[str, float] = {}

    def __call__(self, stage: str, item: str) -> None:
        now = time.perf_counter()
        if stage != self._stage and self._stage:
            self.times[self._stage] = self.times.get(self._stage, 0.0) + now - self._stage_t0
        if stage != self._stage:
            self._stage_t0 = now
        self.counts[stage] = self.counts.get(stage, 0) + 1
        if self.level <= _common.QUIET:
            pass
        elif self.level >= _common.VERBOSE:
            print(f"[{now - self.t0:6.1f}s] {stage} {self.counts[stage]}: {item[:80]}", file=sys.stderr)
        elif self.tty:
            msg = f"\r[{now - self.t0:6.1f}s] {stage} {self.counts[stage]}: {item[:60]}"
            sys.stderr.write(msg.ljust(90))
            sys.stderr.flush()
        elif stage != self._stage:
            print(f"[{now - self.t0:6.1f}s] {plural(stage)} ...", file=sys.stderr)
        self._stage = stage

    def done(self) -> str:
        now = time.perf_counter()
        if self._stage:
            self.times[self._stage] = self.times.get(self._stage, 0.0) + now - self._stage_t0
            self._stage = ""
        if self.tty:
            sys.stderr.write("\r" + " " * 90 + "\r")
        if self.level >= _common.VERBOSE:
            note("timings: " + ", ".join(f"{plural(k)} {t:.2f}s" for k, t in self.times.items()), _common.VERBOSE)
        parts = ", ".join(f"{n} {plural(k, n)}" for k, n in self.counts.items() if k not in _UNCOUNTED)
        return f"{parts} in {now - self.t0:.1f}s"


def generation_setup(args: argparse.Namespace, progress: Progress | None = None) -> tuple[Any, dict[str, Any]]:
    """The generation model ``args`` name (--generate) and its plan's sizes (``compile_generation``'s batch,
    max_seq_len, prefill_len, admit_batch, join), checked as compile --generate checks them."""
    from fusec.cli.generate import check_generation_sizes
    from fusec.genmodel import load_generation_model
    from fusec.models.generate import check_admit_batch, check_join

    if args.shapes is not None:
        raise InputError("--shapes does not apply to --generate (use --batch, --max-seq-len, --max-prompt-len)")
    check_generation_sizes(args)  # a 0 is refused, never taken as the default
    batch = args.batch if args.batch is not None else 1
    admit_batch = getattr(args, "admit_batch", 0)  # commands that compile through here without the option
    check_admit_batch(admit_batch, batch)
    join = getattr(args, "join", 0) or 0
    check_join(join, batch)
    if progress is not None:
        progress("build", args.model)
    gm = load_generation_model(args.model, args.weights_dir, packed=not getattr(args, "dequantize", False))
    context = getattr(gm.config, "max_positions", None)
    if args.max_seq_len is None:
        t_max = min(256, context) if context else 256  # the default, clamped to the model
    elif context and args.max_seq_len > context:
        raise InputError(f"--max-seq-len {args.max_seq_len} exceeds the model's context of {context} positions")
    else:
        t_max = args.max_seq_len
    return gm, {"batch": batch, "max_seq_len": t_max, "prefill_len": args.max_prompt_len, "admit_batch": admit_batch,
                "join": join}


GENERATION_FLAGS = ("batch", "max_seq_len", "max_prompt_len", "weights_dir", "admit_batch", "join", "dequantize")


def refuse_generation_flags(args: argparse.Namespace) -> None:
    """The generation plan's options (``add_generation_arguments(for_compile=True)``) given without --generate:
    an error, never ignored."""
    for flag in GENERATION_FLAGS:
        if getattr(args, flag, None):
            raise InputError(f"--{flag.replace('_', '-')} applies to generation plans (--generate)")


def compile_from_args(args: argparse.Namespace, progress: Progress | None = None):
    """The plan the compile options in ``args`` describe (checked up front, see check_compile_options)."""
    generate = getattr(args, "generate", False)
    if args.dtype is None:
        args.dtype = "bf16" if generate else "fp16"  # generation plans: as `fusec generate` compiles them
    arch = check_compile_options(args)
    quant = quantize_from_args(args)
    if generate:
        from fusec.compiler import compile_generation

        gm, sizes = generation_setup(args, progress)
        return compile_generation(gm, **sizes, dtype=args.dtype, arch=arch, progress=progress,
                                  disabled_fusions=getattr(args, "disable_fusion", None) or (),
                                  enabled_fusions=getattr(args, "enable_fusion", None) or (), **quant)
    refuse_generation_flags(args)
    check_dump_dir(args)
    import fusec
    import fusec.ab
    from fusec.cli.ab import ledger_for_compile
    from fusec.shapes import parse_shapes

    shapes = parse_shapes(args.shapes) if args.shapes is not None else None
    if getattr(args, "fp32_gemm", "3xtf32") != "3xtf32" and getattr(args, "ab", False):
        # A/B runs measure the default plan (3xTF32 products have their own choice keys); a ledger
        # given with --decisions says which mode it measured (checked in ledger_for_compile)
        raise InputError("--fp32-gemm sgemm cannot be combined with --ab: A/B experiments measure "
                         "the default fp32 products (3xtf32)")
    try:
        ledger = ledger_for_compile(args)  # --ab / --decisions (compile only); None otherwise
    except RecursionError:  # json.loads of a hostile 100k-deep ledger
        raise InputError(f"--decisions {getattr(args, 'decisions', None)!r}: the JSON is nested too deeply "
                         "to be a ledger") from None
    plan = fusec.compile(args.model, shapes=shapes, dtype=args.dtype, cuda_graph=args.cuda_graph, arch=arch,
                         disabled_fusions=args.disable_fusion, enabled_fusions=args.enable_fusion,
                         dump_dir=args.dump_dir, progress=progress, fp32_gemm=getattr(args, "fp32_gemm", "3xtf32"),
                         fusion_overrides=ledger.overrides() if ledger else None, choices=ledger.choices() if ledger else None,
                         **quant)
    if ledger is not None:
        fusec.ab.attach(plan, ledger)
    return plan


def is_plan_file(path: str) -> bool:
    """True when ``path`` is a file starting with the plan magic bytes."""
    from fusec.planfile import MAGIC

    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def retarget(args: argparse.Namespace) -> int:
    """``fusec compile PLAN --arch sm_XX -o NEW``: the same plan for another arch (fusec.retarget.recompile)."""
    from fusec.codegen.compile import check_arch
    from fusec.retarget import recompile

    if args.arch is None:
        raise InputError(f"{args.model} is a compiled plan: give --arch sm_XX to re-target it to another GPU arch")
    given = [flag for flag, on in (("--shapes", args.shapes is not None), ("--dtype", args.dtype is not None),
                                   ("--cuda-graph", args.cuda_graph), ("--dump-dir", args.dump_dir is not None),
                                   ("--disable-fusion", args.disable_fusion), ("--enable-fusion", args.enable_fusion),
                                   ("--ab", args.ab), ("--decisions", args.decisions is not None),
                                   ("--generate", args.generate), ("--quantize", args.quantize is not None),
                                   ("--fp32-gemm", getattr(args, "fp32_gemm", "3xtf32") != "3xtf32")) if on]
    if given:
        raise InputError(f"{', '.join(given)}: re-targeting a plan keeps what it was compiled with; only --arch "
                         f"(and --from-source) apply to a plan")
    if args.source_model is not None and not args.from_source:
        raise InputError("--source-model applies only with --from-source")
    from fusec import toolchain

    toolchain.require_compiler()
    arch = check_arch(args.arch)
    progress = Progress()
    plan = recompile(args.model, arch, args.output, from_source=args.from_source, model=args.source_model,
                     progress=progress)
    print(f"re-targeted {fmt_name(args.model)} -> {fmt_name(args.output)} for {plan.arch} ({progress.done()})")
    return 0


def run(args: argparse.Namespace) -> int:
    from fusec.fsutil import check_output_path

    if is_plan_file(args.model):
        return retarget(args)
    if args.from_source or args.source_model is not None:
        raise InputError("--from-source/--source-model apply when MODEL is a compiled plan being re-targeted")

    # before compiling: not a directory, device node, /proc file, or the model being read
    check_output_path(args.output, "plan", not_same_as=[args.model] if os.path.isfile(args.model) else [])
    from fusec import device

    progress = Progress()
    plan = compile_from_args(args, progress)
    progress("write", args.output)
    plan.save(args.output)
    info = plan.info()
    mem = info["memory"]
    print(f"compiled {fmt_name(args.model)} -> {fmt_name(args.output)} ({progress.done()})")
    launches = info["launches"] if "launches" in info else \
        ", ".join(f"{name} {e['launches']}" for name, e in info["entries"].items())
    print(f"  arch {info['arch']}  dtype {info['dtype']}  launches {launches}  "
          f"arena {mem['arena_bytes']:,} B  weights {mem['weights_bytes']:,} B"
          + ("  cuda-graph" if plan.cuda_graph else ""))
    if not device.gpu_available():
        how = "`fusec generate PLAN --prompt TEXT`" if "generation" in plan.manifest else "`fusec run`"
        note(f"  no GPU found: compiled for the target arch only; run it on a GPU with {how}")
    return 0
