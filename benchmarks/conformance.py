"""Run ONNX's backend node tests through fusec and tabulate the outcome per op.

    python benchmarks/conformance.py                        # reference backend only, summary on stdout
    python benchmarks/conformance.py --compile              # + the sm_90 compile path (NVRTC, no GPU)
    python benchmarks/conformance.py --compile --write CONFORMANCE.md --json out.json
    python benchmarks/conformance.py --filter softmax -v    # tests whose name or op contains "softmax"

See ``fusec/conformance.py`` for what pass / refused / wrong / crashed mean.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import onnx

from fusec import conformance as C


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", action="store_true", help="also take every reference pass through the compile path")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--dtype", default="fp32", help="compile dtype (fp32, tf32, fp16, bf16)")
    ap.add_argument("--filter", default="", help="only tests whose name or op contains this (case-insensitive)")
    ap.add_argument("--write", metavar="MD", help="write the Markdown report here (e.g. CONFORMANCE.md)")
    ap.add_argument("--json", metavar="FILE", help="write every result as JSON here")
    ap.add_argument("--bind-shape-inputs", action="store_true",
                    help="also count the tests that pass once graph inputs deciding a shape (Reshape's shape, "
                         "Reduce's axes...) are bound to the test's values at compile time (a separate row)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every test that does not pass")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    cases = C.load_cases()
    flt = args.filter.lower()
    only = (lambda name, op: flt in name.lower() or flt in op.lower()) if flt else None

    def progress(i: int, n: int, r: C.Result) -> None:
        if args.verbose and r.status != "pass":
            print(f"[{i + 1}/{n}] {r.status:8s} {r.name}: {r.reason}", file=sys.stderr)
        elif (i + 1) % 200 == 0:
            print(f"[{i + 1}/{n}] {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    ref, comp = C.run_all(cases, compile_path=args.compile, arch=args.arch, dtype=args.dtype, only=only,
                          progress=progress)
    bound = C.run_bound(cases, ref) if args.bind_shape_inputs else []
    if args.verbose:
        for r in comp:
            if r.status != "pass":
                print(f"compile {r.status:8s} {r.name}: {r.reason}", file=sys.stderr)
    secs = time.perf_counter() - t0
    summary = _summary(ref, comp, args, secs, bound)
    print("\n".join(summary))
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write("\n".join(_report(ref, comp, args, summary)) + "\n")
        print(f"wrote {args.write}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"reference": [vars(r) for r in ref], "compile": [vars(r) for r in comp]}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _summary(ref: list[C.Result], comp: list[C.Result], args: argparse.Namespace, secs: float,
             bound: list[C.Result]) -> list[str]:
    rc = C.counts(ref)
    lines = ["| path | tests | pass | refused | wrong | crashed |", "| --- | ---: | ---: | ---: | ---: | ---: |",
             f"| reference (numpy) | {len(ref)} | {rc['pass']} | {rc['refused']} | {rc['wrong']} | {rc['crashed']} |"]
    if bound:
        bc = C.counts(bound)
        lines.append(f"| reference, shape-deciding inputs bound to the test's values | {len(bound)} | {bc['pass']} "
                     f"| {bc['refused']} | {bc['wrong']} | {bc['crashed']} |")
    if args.compile:
        cc = C.counts(comp)
        lines.append(f"| compile {args.arch} {args.dtype} (of the reference passes) | {len(comp)} | {cc['pass']} "
                     f"| {cc['refused']} | — | {cc['crashed']} |")
    lines.append("")
    lines.append(f"onnx {onnx.__version__}, {len(ref)} node tests, {secs:.0f} s")
    return lines


def _report(ref: list[C.Result], comp: list[C.Result], args: argparse.Namespace, summary: list[str]) -> list[str]:
    cmd = "python benchmarks/conformance.py" + (" --compile" if args.compile else "") + (
        " --bind-shape-inputs" if args.bind_shape_inputs else "") + (
        f" --filter {args.filter}" if args.filter else "") + f" --write {args.write}"
    out = ["# ONNX node-test conformance", "",
           "ONNX's backend node tests (`onnx.backend.test.loader.load_node_model_tests()`) run through fusec's "
           "numpy reference backend (import, run, compare every output's dtype, shape and values within the "
           "test's rtol/atol) and, for the tests the reference passes, through the compile path (passes, "
           "lowering, code generation and NVRTC for the target arch; nothing runs on a GPU). "
           "*refused*: a one-line `FusecError`; *wrong*: an output differs; *crashed*: any other exception "
           "(a bug). `tests/test_conformance.py` keeps the reference crash count at 0 and the pass count at "
           "or above `tests/conformance_floor.json`.", "",
           "fusec compiles static shapes, so a graph input that decides a shape (Reshape's target, Reduce's "
           "axes, Slice's starts, OneHot's depth) is refused: the node tests feed those as run-time inputs. "
           "With `--bind-shape-inputs` a separate row counts the tests that pass once such inputs are bound to "
           "the test's values, as an exporter that fixed them writes them (initializers); the plain row is "
           "the headline number.", "",
           f"Generated {datetime.date.today().isoformat()} by `{cmd}` at {_revision()}.", "", "## Summary", ""]
    out += summary
    out += ["", "## Refusals by reason (reference)", ""] + C.reason_table(ref, "refused")
    if args.compile:
        out += ["", "## Compile-path refusals by reason", ""] + C.reason_table(comp, "refused")
    for title, rs, st in (("Wrong results (reference)", ref, "wrong"), ("Crashes (reference)", ref, "crashed"),
                          ("Compile-path crashes", comp, "crashed")):
        lst = C.listing(rs, st)
        out += ["", f"## {title}: {len(lst)}", ""] + (lst or ["none"])
    out += ["", "## Per op", ""] + C.per_op_table(ref, comp)
    out += ["", "## Unsupported ops (reference refusals naming them)", ""] + C.missing_table(ref)
    return out


def _revision() -> str:
    """The git commit of this checkout (+ "with uncommitted changes" when dirty), if known."""
    import subprocess

    try:
        rev = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10,
                             cwd=__file__.rsplit("/", 2)[0]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    if not rev:
        return "an unknown revision"
    return f"commit {rev.removesuffix('-dirty')}" + (" with uncommitted changes" if rev.endswith("-dirty") else "")


if __name__ == "__main__":
    sys.exit(main())
