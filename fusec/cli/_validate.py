"""``fusec run --check/--compare``: outputs against a yardstick, element by element.

An element matches when ``|got - want| <= atol + rtol * |want|`` (NaN matches NaN, an infinity the
same infinity); integer and boolean outputs must be equal. The table shows per output the largest
absolute error, the largest relative error (``|got - want| / |want|`` over elements with
``want != 0``) and how many elements do not match. Yardsticks: the numpy reference backend
(fp32), onnxruntime (``--check ort``), or a saved ``.npz`` of outputs (``--compare``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import zipfile
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from fusec.cli._common import fmt_name, note
from fusec.errors import CheckFailed, FusecError, InputError
from fusec.ir import Graph

# (atol, rtol) by the dtype the run stored floats in; fp32 accumulation everywhere.
DEFAULT_TOLERANCE = {"fp32": (1e-4, 1e-4), "tf32": (5e-3, 5e-3), "fp16": (1e-2, 1e-2), "bf16": (5e-2, 5e-2)}


@dataclasses.dataclass
class Diff:
    name: str
    shape: str
    max_abs: float
    max_rel: float
    mismatches: int
    total: int
    problem: str = ""  # a shape/dtype disagreement or a missing output: no element comparison

    @property
    def ok(self) -> bool:
        return not self.problem and self.mismatches == 0


def compare_one(name: str, got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> Diff:
    got, want = np.asarray(got), np.asarray(want)
    shape = "x".join(str(d) for d in want.shape) or "scalar"
    if got.shape != want.shape:
        return Diff(name, shape, float("nan"), float("nan"), want.size, want.size,
                    f"shape {got.shape} vs {want.shape}")
    kg, kw = _kind(got.dtype), _kind(want.dtype)
    if kg != kw:  # an integer yardstick for float outputs would compare truncated values
        return Diff(name, shape, float("nan"), float("nan"), want.size, want.size,
                    f"dtype {_dtype_name(got.dtype)} vs {_dtype_name(want.dtype)}")
    if kw in "biu":
        bad = got != want  # numpy compares the integer values exactly across widths
        err = np.abs(got.astype(np.float64) - want.astype(np.float64))
        return Diff(name, shape, float(err.max()) if err.size else 0.0, 0.0, int(bad.sum()), want.size)
    g, w = got.astype(np.float64), want.astype(np.float64)
    same_special = (np.isnan(g) & np.isnan(w)) | (np.isinf(g) & (g == w))
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(g - w)
        bad = ~same_special & ~(err <= atol + rtol * np.abs(w))
        err = np.where(same_special, 0.0, err)
        nz = (w != 0) & np.isfinite(w)
        rel = err[nz] / np.abs(w[nz])
    finite = err[np.isfinite(err)]
    max_abs = float(finite.max()) if finite.size else (0.0 if not err.size else float("inf"))
    if finite.size < err.size:
        max_abs = float("inf")
    max_rel = float(rel.max()) if rel.size else 0.0
    return Diff(name, shape, max_abs, max_rel, int(bad.sum()), want.size)


def _kind(dt: np.dtype) -> str:
    """'f' for every float dtype (bf16 included: ml_dtypes' has numpy kind 'V'), else numpy's kind."""
    return "f" if dt.kind == "f" or dt.name == "bfloat16" else dt.kind


def _dtype_name(dt: np.dtype) -> str:
    return dt.name if dt.kind != "V" or dt.name == "bfloat16" else dt.str


def compare(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], atol: float, rtol: float) -> list[Diff]:
    """One Diff per output of ``got``; an output ``want`` lacks is a problem, not a silent skip."""
    out = []
    for name, arr in got.items():
        if name not in want:
            out.append(Diff(name, "x".join(map(str, np.shape(arr))), float("nan"), float("nan"), 0, int(np.size(arr)),
                            "not in the yardstick"))
        else:
            out.append(compare_one(name, arr, want[name], atol, rtol))
    return out


def render(diffs: list[Diff], against: str, atol: float, rtol: float) -> str:
    """The per-output table, aligned; one header line naming the yardstick and tolerance."""
    rows = [("output", "shape", "max abs err", "max rel err", "mismatches", "result")]
    for d in diffs:
        rows.append((fmt_name(d.name), d.shape, _num(d.max_abs), _num(d.max_rel), f"{d.mismatches}/{d.total}",
                     "ok" if d.ok else f"FAIL ({d.problem})" if d.problem else "FAIL"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"check against {against} (atol {atol:g}, rtol {rtol:g}: |got - want| <= atol + rtol * |want|)"]
    for r in rows:
        cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1])] + [c.rjust(w) for c, w in zip(r[2:5], widths[2:5])] + [r[5]]
        lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)


def _num(x: float) -> str:
    return "-" if x != x else f"{x:.3e}"


def failure(diffs: list[Diff], against: str, atol: float, rtol: float) -> CheckFailed | None:
    """The one-line error for the outputs that did not match, or None when all did."""
    bad = [d for d in diffs if not d.ok]
    if not bad:
        return None
    parts = [f"{fmt_name(d.name)} ({d.problem or f'{d.mismatches} of {d.total} elements'})" for d in bad]
    which = "an output differs" if len(bad) == 1 else f"{len(bad)} outputs differ"
    return CheckFailed(f"{which} from {against} beyond atol {atol:g} + rtol {rtol:g} * |want|: " + ", ".join(parts))


def tolerance(args: Any, dtype: str) -> tuple[float, float]:
    atol_d, rtol_d = DEFAULT_TOLERANCE.get(dtype, DEFAULT_TOLERANCE["fp32"])
    atol = atol_d if args.atol is None else args.atol
    rtol = rtol_d if args.rtol is None else args.rtol
    for flag, v in (("--atol", atol), ("--rtol", rtol)):
        if not (v >= 0 and np.isfinite(v)):
            raise InputError(f"{flag} must be a finite number >= 0, got {v}")
    return float(atol), float(rtol)


def load_npz(path: str, what: str, names: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """The arrays of an .npz file named in ``names`` (all when None; none, to check the file first),
    each header checked before anything is inflated (``fusec.inputs.read_npz_members``: numeric
    dtypes, size limits, no pickles); an InputError naming the file otherwise."""
    from fusec.inputs import read_npz_members

    where = f"{what} {path!r}"
    try:
        with open(path, "rb") as f:
            if f.read(6).startswith(b"\x93NUMPY"):
                raise InputError(f"{where} is a single .npy array, not an .npz archive keyed by name")
            f.seek(0)
            with zipfile.ZipFile(f) as zf:
                out = read_npz_members(zf, where, "output", names=names)
    except InputError:
        raise
    except FileNotFoundError:
        raise InputError(f"{where} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"{where} is a directory") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, KeyError, RuntimeError, NotImplementedError) as e:
        raise InputError(f"{where} is not a readable .npz file ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})") from None
    return {k: a.view(_bf16()) if a.dtype == np.dtype("V2") else a for k, a in out.items()}


def _bf16() -> Any:
    from fusec.dtypes import DType

    return DType.BF16.np


def npz_shapes(path: str) -> dict[str, tuple[int, ...]] | None:
    """{name: shape} from the array headers of an .npz file (nothing inflated), or None when the
    file is not a regular .npz (a pipe is read once, later)."""
    if not os.path.isfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as zf:
            shapes = {}
            for info in zf.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with zf.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    shape, _, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                       else np.lib.format.read_array_header_2_0(f))
                if dtype.hasobject:
                    return None  # refused (unpickled never) by the inputs loader
                shapes[info.filename[:-4]] = tuple(int(d) for d in shape)
            return shapes
    except Exception:  # noqa: BLE001 -- numpy's header parser on untrusted bytes; the inputs loader reports it
        return None  # in one line


def ort_outputs(model: str, graph: Any, inputs: Mapping[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
    """The outputs onnxruntime computes for ``inputs``: on the .onnx file itself, else on the
    graph exported to ONNX (built-in models, a plan's source model)."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise InputError("--check ort needs onnxruntime, which is not installed: pip install onnxruntime "
                         "(or use --check, which compares with fusec's numpy reference)") from None
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    feeds = {k: np.asarray(v) for k, v in inputs.items()}
    if model.lower().endswith(".onnx") and os.path.isfile(model):
        return _ort_run(ort, model, opts, feeds, names)
    from fusec.onnx_export import export_onnx

    with tempfile.TemporaryDirectory(prefix="fusec-check-") as d:
        path = os.path.join(d, "model.onnx")
        export_onnx(graph, path)
        return _ort_run(ort, path, opts, feeds, names)


def _ort_run(ort: Any, path: str, opts: Any, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
    try:
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        wanted = [o.name for o in sess.get_outputs() if o.name in names]
        got = sess.run(wanted, feeds)
    except Exception as e:  # noqa: BLE001 -- onnxruntime raises its own types; the yardstick failed, say so
        raise InputError(f"--check ort: onnxruntime could not run the model ({str(e).strip().splitlines()[0][:200]})") from None
    return dict(zip(wanted, got))


def validate_outputs(args: argparse.Namespace, graph: Graph | None, plan: Any, inputs: dict[str, np.ndarray],
                      outputs: dict[str, np.ndarray], backend: str, dtype: str) -> list[FusecError]:
    """--check and --compare: print each table; return the failures (exit status 3)."""
    failures: list[FusecError] = []
    yardsticks: list[tuple[str, dict[str, np.ndarray]]] = []
    if args.check:
        ref_graph = graph if graph is not None else source_graph(plan, args)
        if args.check == "ort":
            src = args.model if graph is not None else source_path(plan, args)
            yardsticks.append(("onnxruntime", ort_outputs(src, ref_graph, inputs, list(outputs))))
        else:
            from fusec import reference

            if backend == "reference" and args.no_optimize:
                note("--check: --no-optimize runs the same raw graph the reference check runs", 1)
            from fusec.cli.profile import progress_stage

            with progress_stage("reference", None) as step:
                yardsticks.append(("the numpy reference (fp32)", reference.run(ref_graph, inputs, progress=step)))
    if args.compare:  # its headers were checked before the run; now the outputs' arrays
        yardsticks.append((f"{fmt_name(args.compare)}", load_npz(args.compare, "--compare file", names=list(outputs))))
    atol, rtol = tolerance(args, dtype) if yardsticks else (0.0, 0.0)
    for against, want in yardsticks:
        diffs = compare(outputs, want, atol, rtol)
        print(render(diffs, against, atol, rtol))
        bad = failure(diffs, against, atol, rtol)
        if bad is not None:
            failures.append(bad)
    return failures


def source_graph(plan, args: argparse.Namespace) -> Graph:
    """The plan's source model rebuilt for the reference (the digest the plan records must match)."""
    from fusec.loader import load_graph, resolve_source

    src = plan.manifest.get("source") or {}
    try:
        model = resolve_source(src, args.model, args.source_model)
        return load_graph(model, {k: tuple(v) for k, v in (src.get("shapes") or {}).items()} or None)
    except FusecError as e:
        raise FusecError(f"--check: cannot rebuild the plan's source model: {e} (give it with --source-model)") from None


def source_path(plan: Any, args: argparse.Namespace) -> str:
    from fusec.loader import resolve_source

    try:
        return resolve_source(plan.manifest.get("source") or {}, args.model, args.source_model)
    except FusecError:
        return ""


def bisecting(args: argparse.Namespace) -> bool:
    """--bisect (or a flag of it) given: the flags it needs and refuses, checked first, one line each."""
    if not (args.bisect or args.json or args.bisect_rows is not None):
        return False
    if not args.bisect:
        raise InputError("--json and --bisect-rows apply to --bisect: add --check --bisect")
    if args.check != "reference":
        raise InputError("--bisect compares every launch with the numpy reference: use --check, not --check ort "
                         "(onnxruntime gives the outputs only)" if args.check else
                         "--bisect needs --check: it compares every launch with the numpy reference")
    for flag, given in (("--compare", args.compare), ("--no-optimize", args.no_optimize),
                        ("--cuda-graph", args.cuda_graph), ("--stats", args.stats), ("--save-outputs", args.save_outputs)):
        if given:
            raise InputError(f"--bisect runs the plan eagerly, launch by launch, against the reference: drop {flag}")
    if args.backend == "reference":
        raise InputError("--bisect runs the plan launch by launch on the GPU: drop --backend reference")
    if args.bisect_rows is not None and args.bisect_rows < 0:
        raise InputError(f"--bisect-rows must be >= 0, got {args.bisect_rows}")
    return True


def check_bisect(args: argparse.Namespace, plan: Any) -> None:
    """--bisect: the plan's source record, then the GPU (one line each)."""
    if plan is not None:
        from fusec.debug import staged_for

        staged_for(plan, args.model, args.source_model)  # the graph it was compiled from, or why not
    from fusec import toolchain

    why = toolchain.gpu_missing_reason()
    if why is not None:
        raise FusecError(f"--bisect runs the plan launch by launch on the GPU: {why}")


def run_bisect(args: argparse.Namespace, plan: Any, inputs: dict[str, np.ndarray]) -> int:
    """Compile (unless a plan was given), bisect, print the table (or JSON) and the verdict;
    a divergence is CheckFailed (exit status 3) naming the launch, its node and op."""
    import json

    from fusec.debug import bisect

    model = args.source_model
    if plan is None:
        from fusec.cli.compile import compile_from_args

        plan = compile_from_args(args)
        model = args.model
    atol, rtol = tolerance(args, plan.dtype)
    report = bisect(plan, inputs, atol=atol, rtol=rtol, model=model)
    if args.json:
        print(json.dumps(report.to_json(), indent=1, default=float))
    else:
        print(f"bisect {fmt_name(args.model)} ({plan.dtype}, {len(report.rows)} rows) against the numpy reference "
              f"of the post-pass graph (atol {atol:g}, rtol {rtol:g})")
        print(report.table(args.bisect_rows))
        if report.inputs_off:
            print("inputs of the first diverging launch: " + ", ".join(
                f"{fmt_name(d['name'])} ({d['origin']}: {d['status']})" for d in report.inputs_off))
        if not report.diverged:
            print(report.verdict())
    if report.diverged:  # the verdict: one line on stderr
        raise CheckFailed(report.verdict())
    return 0
