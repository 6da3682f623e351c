"""ONNX backend node tests through fusec: the reference backend and the compile path.

ONNX ships one small model per op behaviour (``onnx.backend.test.loader.load_node_model_tests()``,
built in memory by onnx >= 1.19) with its inputs and expected outputs. Each test ends in one of:

- ``pass``: imported, run by the reference backend, every output matches (dtype, shape, values
  within the test's rtol/atol);
- ``refused``: fusec raised a ``FusecError`` (an unsupported op, dtype, shape...) — a clean refusal;
- ``wrong``: it ran, but an output differs (the reason says which and by how much);
- ``crashed``: any other exception: a bug in fusec.

The compile path (``compile_case``) takes a test the reference passes through ``compiler.stage``,
code generation and NVRTC for an arch (no GPU needed, nothing runs): pass, refused or crashed.
``benchmarks/conformance.py`` runs every test and writes the tables (CONFORMANCE.md);
``tests/test_conformance.py`` asserts no crash and a pass-count floor.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from fusec.errors import FusecError

STATUSES = ("pass", "refused", "wrong", "crashed")


@dataclasses.dataclass
class Result:
    name: str  # the ONNX test name, e.g. test_softmax_axis_0_expanded
    op: str  # the ONNX op under test (an _expanded test counts under its op)
    status: str  # one of STATUSES
    reason: str = ""  # refused / wrong / crashed: one line


def load_cases() -> list[Any]:
    """ONNX's node test cases (a list of ``onnx.backend.test.case.test_case.TestCase``)."""
    from onnx.backend.test.loader import load_node_model_tests

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return list(load_node_model_tests())


def op_names(cases: Iterable[Any]) -> dict[str, str]:
    """{test name: the op under test}. A plain test has one node: its op. An ``_expanded`` test
    (the op's function body, inlined) takes the op of its plain sibling."""
    cases = list(cases)
    plain = {c.name: c.model.graph.node[0].op_type for c in cases
             if "_expanded" not in c.name and len(c.model.graph.node) >= 1}
    out = {}
    for c in cases:
        if c.name in plain:
            out[c.name] = plain[c.name]
            continue
        base = re.sub(r"_expanded.*$", "", c.name)
        out[c.name] = plain.get(base) or _guess_op(base, plain)
    return out


def _guess_op(base: str, plain: dict[str, str]) -> str:
    """The op of the longest plain test name that prefixes ``base`` (siblings share a prefix)."""
    best = ""
    for name in plain:
        if base.startswith(name) and len(name) > len(best):
            best = name
    return plain[best] if best else base.removeprefix("test_")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _inputs(case: Any) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """{input name: array} and {input name: shape} for the case's first data set (positional
    over the graph inputs that are not initializers)."""
    graph = case.model.graph
    inits = {t.name for t in graph.initializer}
    names = [vi.name for vi in graph.input if vi.name not in inits]
    arrays = [_array(a) for a in case.data_sets[0][0]]
    feeds = dict(zip(names, arrays))
    static = {vi.name for vi in graph.input if vi.type.tensor_type.HasField("shape")
              and all(d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim)}
    # shapes for inputs the model leaves open (as a user gives them); static ones come from the model
    shapes = {n: tuple(int(d) for d in np.shape(a)) for n, a in feeds.items()
              if isinstance(a, np.ndarray) and n not in static}
    return feeds, shapes


def _array(a: Any) -> Any:
    """A test's data as numpy: dtypes numpy lacks (bfloat16, float8, int4) come as TensorProtos."""
    import onnx

    return onnx.numpy_helper.to_array(a) if isinstance(a, onnx.TensorProto) else a


def compare(name: str, expected: Any, got: Any, rtol: float, atol: float) -> str:
    """'' when ``got`` matches ``expected`` as ONNX's backend runner checks it, else why not
    (dtype, shape, then allclose; bfloat16 compared in fp32 with rtol at least two bf16 ulps)."""
    if isinstance(expected, np.generic):  # a numpy scalar: a 0-d tensor
        expected = np.asarray(expected)
    if not isinstance(expected, np.ndarray):
        return f"output {name!r}: expected a {type(expected).__name__}, not a tensor"
    got = np.asarray(got)
    if got.dtype != expected.dtype:
        return f"output {name!r}: dtype {got.dtype}, expected {expected.dtype}"
    if got.shape != expected.shape:
        return f"output {name!r}: shape {list(got.shape)}, expected {list(expected.shape)}"
    if expected.dtype.kind in "biu":
        bad = int(np.count_nonzero(got != expected))
        return f"output {name!r}: {bad} of {expected.size} elements differ" if bad else ""
    if expected.dtype.name == "bfloat16":
        rtol = max(rtol, 2.0**-6)
    e64, g64 = expected.astype(np.float32).astype(np.float64), got.astype(np.float32).astype(np.float64)
    with np.errstate(all="ignore"):
        ok = np.isclose(g64, e64, rtol=rtol, atol=atol, equal_nan=True)
    if ok.all():
        return ""
    with np.errstate(all="ignore"):
        err = np.where(ok, 0.0, np.abs(g64 - e64))
    return (f"output {name!r}: {int((~ok).sum())} of {expected.size} elements differ "
            f"(max abs error {float(np.nanmax(err)) if np.isfinite(err).any() else float('nan'):.3g})")


def _guarded(name: str, op: str, fn: Callable[[], str]) -> Result:
    """Run ``fn`` (returns '' on a match, else the mismatch) and classify what happened."""
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            why = fn()
    except FusecError as e:
        return Result(name, op, "refused", _one_line(e))
    except Exception as e:  # noqa: BLE001 -- classifying the crash is the point
        where = traceback.extract_tb(e.__traceback__)[-1]
        return Result(name, op, "crashed", f"{type(e).__name__}: {_one_line(e)} "
                      f"[{where.filename.rsplit('/', 1)[-1]}:{where.lineno}]")
    return Result(name, op, "wrong" if why else "pass", why)


_RUNTIME_INPUT = re.compile(r"input \d+ \('((?:[^'\\]|\\.)*)'\) depends on run-time data")


def bind_inputs(case: Any, names: Sequence[str]) -> Any:
    """A copy of ``case`` whose graph inputs ``names`` are initializers holding the test's values
    (an input that decides a shape, as an exporter that fixed it would have written it)."""
    import copy

    import onnx

    feeds, _ = _inputs(case)
    model = copy.deepcopy(case.model)
    keep = [vi for vi in model.graph.input if vi.name not in names]
    for name in names:
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(feeds[name]), name))
    del model.graph.input[:]
    model.graph.input.extend(keep)
    data = [(list(a for vi, a in zip(case.model.graph.input, case.data_sets[0][0]) if vi.name not in names),
             case.data_sets[0][1])]
    return dataclasses.replace(case, model=model, data_sets=data) if dataclasses.is_dataclass(case) else case


def reference_case(case: Any, op: str, bind_shape_inputs: bool = False) -> Result:
    """Import ``case`` and run it on fusec's numpy reference backend. ``bind_shape_inputs``: when
    the import refuses a graph input because it decides a shape, retry with that input bound to
    the test's value (``bind_inputs``), as many times as there are such inputs."""
    from fusec import reference
    from fusec.loader import load_graph

    def go(c: Any) -> str:
        feeds, shapes = _inputs(c)
        graph = load_graph(c.model, shapes)
        outs = reference.run(graph, feeds)
        for vi, want in zip(c.model.graph.output, c.data_sets[0][1]):
            why = compare(vi.name, _array(want), outs[vi.name], c.rtol, c.atol)
            if why:
                return why
        return ""

    res = _guarded(case.name, op, lambda: go(case))
    bound: list[str] = []
    inputs = {vi.name for vi in case.model.graph.input}
    while bind_shape_inputs and res.status == "refused":
        m = _RUNTIME_INPUT.search(res.reason)
        if not m or m.group(1) not in inputs or m.group(1) in bound:
            break
        bound.append(m.group(1))
        bound_case = bind_inputs(case, bound)
        res = _guarded(case.name, op, lambda: go(bound_case))
    return res


def compile_case(case: Any, op: str, arch: str = "sm_90", dtype: str = "fp32") -> Result:
    """Import ``case`` and take it through the passes, lowering, codegen and NVRTC for ``arch``."""
    from fusec.compiler import compile_entries
    from fusec.loader import load_graph

    def go() -> str:
        _, shapes = _inputs(case)
        graph = load_graph(case.model, shapes)
        compile_entries({"main": graph}, dtype=dtype, arch=arch)
        return ""

    return _guarded(case.name, op, go)


def run_all(cases: Sequence[Any], compile_path: bool = False, arch: str = "sm_90", dtype: str = "fp32",
            only: Callable[[str, str], bool] | None = None,
            progress: Callable[[int, int, Result], None] | None = None) -> tuple[list[Result], list[Result]]:
    """Reference results for every case (``only(name, op)`` filters), and compile results for the
    ones the reference passes when ``compile_path``."""
    ops = op_names(cases)
    ref: list[Result] = []
    comp: list[Result] = []
    chosen = [c for c in cases if only is None or only(c.name, ops[c.name])]
    for i, c in enumerate(chosen):
        r = reference_case(c, ops[c.name])
        ref.append(r)
        if progress:
            progress(i, len(chosen), r)
        if compile_path and r.status == "pass":
            comp.append(compile_case(c, ops[c.name], arch, dtype))
    return ref, comp


def run_bound(cases: Sequence[Any], ref: Sequence[Result]) -> list[Result]:
    """``ref`` with each refusal of a shape-deciding graph input re-run with such inputs bound to
    the test's values (``reference_case(..., bind_shape_inputs=True)``); other results as they are."""
    by_name = {c.name: c for c in cases}
    return [reference_case(by_name[r.name], r.op, True) if r.status == "refused" and _RUNTIME_INPUT.search(r.reason)
            else r for r in ref]


# ---- tables ---------------------------------------------------------------------------------


def counts(results: Iterable[Result]) -> dict[str, int]:
    c = collections.Counter(r.status for r in results)
    return {s: c.get(s, 0) for s in STATUSES}


def reason_group(reason: str) -> str:
    """A refusal reason without the model/node/value names, so equal causes group together."""
    if "unsupported node(s)" in reason:
        return "unsupported op(s) (see the unsupported-op table)"
    r = re.sub(r"^[^:]*: node '[^']*' \([^)]*\): ", "", reason)  # "label: node 'n' (Op): "
    r = re.sub(r"^[^:]*: (?=(has \d+ unsupported|input|value|graph output|node))", "", r)
    r = re.sub(r"at node\(s\) [^;]*", "", r)
    r = re.sub(r"^#\d+ ", "", r)  # the lowering's node number
    r = re.sub(r"\bon (bool|[iu](8|16|32|64)|f(16|32|64)|bf16)\b", "on <dtype>", r)
    r = re.sub(r"'[^']*'", "'…'", r)
    r = re.sub(r"\[[0-9, ]*\]", "[…]", r)
    r = re.sub(r"\b\d+\b", "N", r)
    return " ".join(r.split())[:160]


def per_op_table(ref: Sequence[Result], comp: Sequence[Result] = ()) -> list[str]:
    by_op: dict[str, list[Result]] = collections.defaultdict(list)
    for r in ref:
        by_op[r.op].append(r)
    cby: dict[str, list[Result]] = collections.defaultdict(list)
    for r in comp:
        cby[r.op].append(r)
    lines = ["| op | tests | pass | refused | wrong | crashed | compile pass / refused / crashed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for op in sorted(by_op, key=str.lower):
        c = counts(by_op[op])
        cc = counts(cby.get(op, []))
        comp_cell = f"{cc['pass']} / {cc['refused']} / {cc['crashed']}" if cby.get(op) else ""
        lines.append(f"| {op} | {len(by_op[op])} | {c['pass']} | {c['refused']} | {c['wrong']} | {c['crashed']} "
                     f"| {comp_cell} |")
    return lines


def reason_table(results: Sequence[Result], status: str, limit: int = 40) -> list[str]:
    groups: dict[str, list[Result]] = collections.defaultdict(list)
    for r in results:
        if r.status == status:
            groups[reason_group(r.reason)].append(r)
    lines = ["| tests | reason | ops |", "| ---: | --- | --- |"]
    for why, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:limit]:
        ops = sorted({r.op for r in rs})
        shown = ", ".join(ops[:6]) + (f" and {len(ops) - 6} more" if len(ops) > 6 else "")
        lines.append(f"| {len(rs)} | {why.replace('|', '/')} | {shown} |")
    if len(groups) > limit:
        lines.append(f"| {sum(len(v) for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))[limit:])} "
                     f"| ({len(groups) - limit} more reasons) | |")
    return lines


def missing_ops(results: Sequence[Result]) -> dict[str, tuple[int, int]]:
    """{unsupported op: (tests it blocks, tests where it is the only unsupported op)}, from the
    importer's "has N unsupported node(s): 'Op' (domain 'd', ...)" refusals."""
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for r in results:
        if r.status != "refused" or "unsupported node(s)" not in r.reason:
            continue
        found = sorted(set(re.findall(r"'([^']+)' \(domain '([^']*)'", r.reason)))
        for op, dom in found:
            key = op if dom in ("", "ai.onnx") else f"{dom}.{op}"
            out[key][0] += 1
            out[key][1] += len(found) == 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def missing_table(results: Sequence[Result]) -> list[str]:
    miss = missing_ops(results)
    lines = ["| unsupported op | tests it blocks | of which it alone blocks |", "| --- | ---: | ---: |"]
    for op, (n, alone) in sorted(miss.items(), key=lambda kv: (-kv[1][0], kv[0])):
        lines.append(f"| {op} | {n} | {alone} |")
    return lines


def listing(results: Sequence[Result], status: str) -> list[str]:
    return [f"- `{r.name}` ({r.op}): {r.reason.replace('|', '/')}" for r in results if r.status == status]
