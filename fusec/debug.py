"""Bisecting a compiled plan: the FIRST launch whose output diverges from the reference.

``bisect(plan_or_model, inputs)`` runs the plan's launch list one launch at a time on the GPU
(eager, never the CUDA graph; ``Executor.step``), reads back after each launch the value(s) that
launch completes while they are still in the arena (later launches reuse the memory), and
compares each with the numpy reference's value of the same IR value of the post-pass graph (the
graph the plan was lowered from, fused bodies included: ``fusec.reference``).

How launches map to IR values: the lowering labels every launch ``#i ...`` with the index ``i`` of
its node in the post-pass graph (``fusec.lower._label``); a node is one or more launches, and its
outputs are complete after its LAST launch, at the memory plan's offsets (arena) or in the state
region. Earlier launches of a node (a GEMM before its epilogue) write scratch or partial results,
and the state write-backs copy values already compared: those rows are "not compared", with the
reason, never skipped. The graph is rebuilt from the plan's source record (built-in name, or a
file checked by digest) with the recorded options and staged again without compiling
(``dry_run``); its launch labels must equal the plan's, else the mapping is refused.

Each compared value gets: max abs error, normwise relative error (max abs / max |ref|), elements
beyond ``atol + rtol * |ref|``, non-finite elements (and how many of them the reference has too),
and ``local``: the max abs error against the reference evaluated on the GPU's OWN inputs of the
node (a large local error: this kernel is wrong; a small one: the error came in with its inputs).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fusec.errors import FusecError
from fusec.ir import Graph, Node, Value

_LABEL = re.compile(r"#(\d+) ")


@dataclasses.dataclass
class Slot:
    """What launch ``index`` completes: ``node`` (its index in the post-pass graph) or None, and
    ``values`` [(IR value, (space, byte offset))] when it is the node's last launch."""

    index: int
    label: str
    node: int | None
    values: list[tuple[Value, tuple[str, int]]]
    why_not: str = ""  # set when nothing is compared after this launch
    reads: list[tuple[Value, tuple[str, int]]] = dataclasses.field(default_factory=list)  # first launch of a node:
    # its inputs made by launches (or given; an input read through a launch-less view: the value it views),
    # re-read just before it to catch one overwritten before its use
    views: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # a read value -> the node's inputs viewing it


def launch_map(graph: Graph, launches: list[Mapping[str, Any]], offsets: Mapping[str, int],
               state: Mapping[str, tuple[str, int]] | None = None,
               state_layout: Mapping[str, int] | None = None) -> list[Slot]:
    """One Slot per launch (see the module docstring). ``offsets``: the memory plan's {value name:
    arena offset}; ``state``: its {value name: (state name, offset in it)}; ``state_layout``: the
    manifest's {state name: offset in the state region}."""
    state, state_layout = dict(state or {}), dict(state_layout or {})
    nodes: list[int | None] = []
    for L in launches:
        m = _LABEL.match(str(L.get("label", "")))
        nodes.append(int(m.group(1)) if m and int(m.group(1)) < len(graph.nodes) else None)
    last = {n: i for i, n in enumerate(nodes) if n is not None}
    first = {n: i for i, n in reversed(list(enumerate(nodes))) if n is not None}
    made = {o.name for n in last for o in graph.nodes[n].outputs} | {v.name for v in graph.inputs}
    producer = {o.name: k for k, node in enumerate(graph.nodes) for o in node.outputs}

    def storage(v: Value) -> Value:
        """The launched value (or graph input) whose bytes ``v`` reads: a launch-less node (a view,
        an alias) reads its first input's storage, so a read of it is a read of that value."""
        seen = 0
        while v.name not in made and (k := producer.get(v.name)) is not None and k not in last \
                and graph.nodes[k].inputs and seen < len(graph.nodes):
            v, seen = graph.nodes[k].inputs[0], seen + 1
        return v

    def where(v: Value) -> tuple[str, int] | None:
        if v.name in state:
            s, off = state[v.name]
            return ("state", int(state_layout[s]) + int(off))
        return ("arena", int(offsets[v.name])) if v.name in offsets else None

    slots = []
    for i, (L, n) in enumerate(zip(launches, nodes)):
        label = str(L.get("label", ""))
        if n is None:
            slots.append(Slot(i, label, None, [], "no node (a state write-back or an unlabelled launch)"))
            continue
        roots = {} if first[n] != i else {r.name: r for v in graph.nodes[n].inputs for r in [storage(v)]}
        reads = [(r, a) for r in roots.values() if r.name in made for a in [where(r)] if a is not None]
        views: dict[str, list[str]] = {}
        for v in graph.nodes[n].inputs if reads else []:
            if (r := storage(v)) is not v:
                views.setdefault(r.name, []).append(v.name)
        if last[n] != i:
            slots.append(Slot(i, label, n, [], f"partial: node #{n} is complete after launch {last[n]}", reads, views))
            continue
        vals = [(v, a) for v in graph.nodes[n].outputs for a in [where(v)] if a is not None]
        skipped = [v.name for v in graph.nodes[n].outputs if where(v) is None]
        slots.append(Slot(i, label, n, vals, f"{', '.join(skipped)} has no arena slot" if skipped and not vals else "",
                          reads, views))
    return slots


@dataclasses.dataclass
class Row:
    index: int
    label: str
    node: int | None
    ops: str  # the node's op, and a fused node's body ops
    value: str | None
    shape: list[int] | None
    dtype: str | None
    max_abs: float | None = None
    rel: float | None = None  # normwise: max abs error / max |ref|
    mismatches: int | None = None  # elements beyond atol + rtol * |ref|
    nonfinite: int | None = None  # non-finite elements of the GPU's value
    ref_nonfinite: int | None = None
    new_nonfinite: int | None = None  # non-finite on the GPU where the reference is finite
    local: float | None = None  # max abs error against the reference on the GPU's own inputs
    stale: list[str] = dataclasses.field(default_factory=list)  # inputs whose bytes changed before this node ran
    where: list[list[int]] = dataclasses.field(default_factory=list)  # up to 3 indices: non-finite, else beyond tol
    status: str = "ok"  # ok | DIVERGES | NONFINITE | not compared: <why>

    @property
    def bad(self) -> bool:
        return self.status in ("DIVERGES", "NONFINITE")


@dataclasses.dataclass
class Report:
    rows: list[Row]
    atol: float
    rtol: float
    first: int | None  # index into rows of the first bad row
    first_nonfinite: int | None  # ... of the first row non-finite where the reference is finite
    inputs_off: list[dict[str, Any]]  # the first bad node's inputs: name, origin, status

    @property
    def diverged(self) -> bool:
        return self.first is not None

    def verdict(self) -> str:
        n = len({r.index for r in self.rows if r.status in ("ok", "DIVERGES", "NONFINITE")})
        if self.first is None:
            return (f"no divergence: {n} of {len({r.index for r in self.rows})} launches compared with the reference "
                    f"(atol {self.atol:g}, rtol {self.rtol:g}), all within tolerance and finite")
        r = self.rows[self.first]
        what = (f"{r.new_nonfinite} non-finite elements where the reference is finite"
                if r.status == "NONFINITE" else
                f"{r.mismatches} elements beyond atol {self.atol:g} + rtol {self.rtol:g}*|ref| (max abs {r.max_abs:.3g})")
        off = [d["name"] for d in self.inputs_off if d["status"] == "off"]
        came = f"; inputs already off: {', '.join(off)}" if off else "; none of its inputs was already off"
        if r.stale:
            came += f"; inputs overwritten in the arena before it ran (memory plan?): {', '.join(r.stale)}"
        if r.local is not None:
            came += f"; local error {r.local:.3g} (on the GPU's own inputs)"
        if self.first_nonfinite is not None and self.first_nonfinite != self.first:
            came += f"; first non-finite at launch {self.rows[self.first_nonfinite].index}"
        return (f"first divergence at launch {r.index} ({r.label}), node #{r.node} [{r.ops}], value {r.value!r}: "
                f"{what} (at {', '.join(map(str, r.where))}){came}")

    def table(self, around: int | None = None, at: int | None = None) -> str:
        """The rows as aligned text; ``around``: only that many rows either side of row ``at``
        (default: the first bad one)."""
        rows, at = self.rows, self.first if at is None else at
        if around is not None and at is not None:
            rows = rows[max(0, at - around): at + around + 1]
        elif around is not None:
            rows = rows[: 2 * around + 1]
        head = ("launch", "label", "ops", "value", "shape", "dtype", "max abs", "rel", "beyond tol", "nonfinite",
                "local", "result")
        first = self.rows[self.first] if self.first is not None else None
        cells = [head] + [(str(r.index), r.label, _short(r.ops), r.value or "-", "x".join(map(str, r.shape or [])) or "-",
                           r.dtype or "-", *map(_fmt, (r.max_abs, r.rel, r.mismatches, r.nonfinite, r.local)),
                           r.status + (f" (stale input {', '.join(r.stale)})" if r.stale else "")
                           + (" <== FIRST" if r is first else "")) for r in rows]
        widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
        lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(head))).rstrip() for c in cells]
        if len(rows) < len(self.rows):
            lines.append(f"({len(rows)} of {len(self.rows)} rows shown)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"diverged": self.diverged, "atol": self.atol, "rtol": self.rtol,
                "first": None if self.first is None else self.rows[self.first].index,
                "first_nonfinite": None if self.first_nonfinite is None else self.rows[self.first_nonfinite].index,
                "verdict": self.verdict(), "inputs_of_first": self.inputs_off,
                "launches": [{k: _jsonable(v) for k, v in dataclasses.asdict(r).items()} for r in self.rows]}


def _jsonable(x: Any) -> Any:
    """Strict JSON: a non-finite error figure as the string "inf" or "nan"."""
    return str(x) if isinstance(x, float) and not np.isfinite(x) else x


def _short(ops: str, n: int = 48) -> str:
    return ops if len(ops) <= n else ops[: n - 3] + "..."


def _fmt(x: float | int | None) -> str:
    return "-" if x is None else str(x) if isinstance(x, int) else f"{x:.2e}"


def node_ops(node: Node) -> str:
    if node.op.value == "fused":
        return "fused: " + " ".join(n.op.value for n in node.attrs.body.nodes)
    return node.op.value


def diff(got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> dict[str, Any]:
    """Error figures of one value (see Row); NaN matches NaN and an infinity the same infinity."""
    g, w = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    fin_g, fin_w = np.isfinite(g), np.isfinite(w)
    both = fin_g & fin_w
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(g - w)
        same = (np.isnan(g) & np.isnan(w)) | (np.isinf(g) & (g == w))
        beyond = ~same & ~(err <= atol + rtol * np.abs(w))
    max_abs = float(err[both].max()) if both.any() else 0.0
    scale = float(np.abs(w[fin_w]).max()) if fin_w.any() else 0.0
    worst = ~fin_g & fin_w if (~fin_g & fin_w).any() else beyond
    where = [[int(i) for i in ix] for ix in np.argwhere(worst)[:3]]
    return {"max_abs": max_abs, "rel": max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf")),
            "where": where,
            "mismatches": int(beyond.sum()), "nonfinite": int((~fin_g).sum()), "ref_nonfinite": int((~fin_w).sum()),
            "new_nonfinite": int((~fin_g & fin_w).sum())}


def reference_values(graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every value of ``graph`` by name, as the numpy reference computes it."""
    from fusec.reference import check_inputs, eval_node

    env: dict[str, np.ndarray] = dict(check_inputs(graph, inputs))
    env.update({c.name: c.data for c in graph.constants})
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for node in graph.nodes:
            for v, r in zip(node.outputs, eval_node(node, [env[v.name] for v in node.inputs])):
                env[v.name] = r
    return env


def compare_launches(graph: Graph, slots: list[Slot], ref: Mapping[str, np.ndarray], inputs: Mapping[str, np.ndarray],
                     step: Callable[[Callable[[int], None]], None],
                     read: Callable[[tuple[str, int], Value], np.ndarray],
                     atol: float, rtol: float, local: bool = True) -> Report:
    """The comparison itself, over any executor: ``step(after)`` runs the launches one at a time,
    calling ``after(i)`` once launch ``i`` finished; ``read(addr, value)`` gives the value's bytes
    at ``addr`` as a host array. ``ref``: the reference's values by name (``reference_values``)."""
    from fusec.reference import eval_node

    gpu: dict[str, np.ndarray] = {v.name: np.asarray(inputs[v.name]) for v in graph.inputs if v.name in inputs}
    gpu.update({c.name: c.data for c in graph.constants})
    rows: list[Row] = []
    done = [0]  # nodes before this index are accounted for (views replayed on the GPU's values)

    def catch_up(upto: int) -> None:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for node in graph.nodes[done[0]:upto]:
                if all(v.name in gpu for v in node.inputs) and not any(o.name in gpu for o in node.outputs):
                    for v, r in zip(node.outputs, eval_node(node, [gpu[v.name] for v in node.inputs])):
                        gpu[v.name] = r  # a launch-less node (view, alias): exact on the GPU's own values
        done[0] = max(done[0], upto)

    stale: dict[int, list[str]] = {}  # node -> inputs overwritten between their launch and this node's first

    def check_reads(j: int) -> None:
        for v, addr in slots[j].reads if j < len(slots) else []:
            if v.name in gpu and np.asarray(read(addr, v)).tobytes() != np.asarray(gpu[v.name]).tobytes():
                # the value and the node's inputs that read it through views (the inputs table names those)
                stale.setdefault(slots[j].node, []).extend([v.name, *slots[j].views.get(v.name, [])])

    def after(i: int) -> None:
        record(i)
        check_reads(i + 1)  # the next node's inputs, just before its first launch

    def record(i: int) -> None:
        s = slots[i]
        node = graph.nodes[s.node] if s.node is not None else None
        ops = node_ops(node) if node is not None else "-"
        if not s.values:
            rows.append(Row(i, s.label, s.node, ops, None, None, None, status=f"not compared: {s.why_not}"))
            return
        catch_up(s.node)
        mine = None
        if local and all(v.name in gpu for v in node.inputs):
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                mine = dict(zip((o.name for o in node.outputs), eval_node(node, [gpu[v.name] for v in node.inputs])))
        for v, addr in s.values:
            got = np.array(read(addr, v))  # a copy: later launches may overwrite the slot
            gpu[v.name] = got
            row = Row(i, s.label, s.node, ops, v.name, list(v.shape), v.dtype.value, stale=stale.get(s.node, []))
            if v.name not in ref:
                row.status = "not compared: the reference has no value of this name"
            else:
                d = diff(got, ref[v.name], atol, rtol)
                row.max_abs, row.rel, row.mismatches = d["max_abs"], d["rel"], d["mismatches"]
                row.nonfinite, row.ref_nonfinite, row.where = d["nonfinite"], d["ref_nonfinite"], d["where"]
                row.new_nonfinite = d["new_nonfinite"]
                row.status = "NONFINITE" if d["new_nonfinite"] else "DIVERGES" if d["mismatches"] else "ok"
                if mine is not None:
                    dl = diff(got, mine[v.name], atol, rtol)
                    row.local = float("inf") if dl["new_nonfinite"] else dl["max_abs"]
            rows.append(row)
        done[0] = max(done[0], s.node + 1)

    step(after)
    first = next((k for k, r in enumerate(rows) if r.bad), None)
    first_nf = next((k for k, r in enumerate(rows) if r.status == "NONFINITE"), None)
    return Report(rows, atol, rtol, first, first_nf,
                  _inputs_status(graph, rows[first], gpu, ref, atol, rtol) if first is not None else [])


def _inputs_status(graph: Graph, row: Row, gpu: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray],
                   atol: float, rtol: float) -> list[dict[str, Any]]:
    """Each input of the first bad node: where it comes from and whether the GPU's value was off."""
    node = graph.nodes[row.node]
    producer = {o.name: i for i, n in enumerate(graph.nodes) for o in n.outputs}
    graph_inputs = {v.name for v in graph.inputs}
    out = []
    for v in node.inputs:
        origin = "weight" if v.is_const else "graph input" if v.name in graph_inputs else f"node #{producer.get(v.name)}"
        if v.name in row.stale:
            status = "overwritten before use"
        elif v.is_const or v.name in graph_inputs:
            status = "given"
        elif v.name in gpu and v.name in ref:
            d = diff(gpu[v.name], ref[v.name], atol, rtol)
            status = "off" if d["mismatches"] or d["new_nonfinite"] else "ok"
        else:
            status = "not compared"
        out.append({"name": v.name, "origin": origin, "status": status})
    return out


def staged_for(plan: Any, where: str = "the plan", model: Any = None) -> Any:
    """The post-pass graph and memory plan of ``plan``, rebuilt from its source record (``model``:
    the source file or Graph when the record cannot name it) and staged without compiling; its
    launch labels must equal the plan's. FusecError in one line when that is not possible."""
    from fusec.compiler import stage
    from fusec.loader import load_graph, resolve_source

    m = plan.manifest
    if "entries" in m:
        raise FusecError(f"{where} has several entry points (generation); bisect a one-entry plan: "
                         "compile the model without --generate")
    src = m.get("source") or {}
    shapes = {k: tuple(v) for k, v in (src.get("shapes") or {}).items()} or None
    if isinstance(model, Graph):
        graph = model
    else:
        if src.get("kind") not in ("builtin", "file"):
            raise FusecError(f"{where} does not record a source model that can be rebuilt (kind "
                             f"{src.get('kind')!r}); bisect needs the graph it was compiled from: compile from "
                             "the model instead (fusec run MODEL --check --bisect)")
        graph = load_graph(resolve_source(src, where, model), shapes)
    st = stage(graph, m["dtype"], m["arch"], dry_run=True, **{k: v for k, v in (src.get("options") or {}).items()
                                                                if k in _STAGE_OPTIONS})
    mine, theirs = [L["label"] for L in st.lowered.launches], [L.get("label", "") for L in m["launches"]]
    if mine != theirs:
        k = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        raise FusecError(f"{where}: its launch list differs from the one its source model lowers to now "
                         f"({len(theirs)} vs {len(mine)} launches, first difference at launch {k}); "
                         "compile from the model instead (fusec run MODEL --check --bisect)")
    return st


_STAGE_OPTIONS = ("disabled_fusions", "enabled_fusions", "fusion_overrides", "choices", "fp32_gemm")


def bisect(plan_or_model: Any, inputs: Mapping[str, Any], *, atol: float = 1e-4, rtol: float = 1e-4,
           local: bool = True, model: Any = None, **compile_options: Any) -> Report:
    """Run ``plan_or_model`` launch by launch on the GPU and compare every launch's output with
    the reference (module docstring). A model (built-in name, ONNX path, Graph) is compiled first
    with ``compile_options`` (``fusec.compile``'s: shapes, dtype, disabled_fusions, choices, ...);
    a Plan is mapped through its source record (``model``: its source file or Graph, where the
    record cannot name it). Needs a GPU."""
    import fusec
    from fusec.plan import Plan

    plan = plan_or_model
    if not isinstance(plan, Plan):
        plan = fusec.compile(plan_or_model, **compile_options)
        model = plan_or_model if model is None else model
    st = staged_for(plan, getattr(plan, "_where", "the plan"), model)
    ex = plan.with_cuda_graph(False)._exec()
    feeds = _feeds(st.graph, inputs)
    slots = launch_map(st.graph, list(plan.manifest["launches"]), st.memory.offsets, st.memory.state,
                       {r["name"]: r["offset"] for r in plan.manifest.get("state", [])})
    ref = reference_values(st.graph, feeds)
    dev = ex.device

    def read(addr: tuple[str, int], v: Value) -> np.ndarray:
        buf = dev.arena if addr[0] == "arena" else dev.state
        host = dev.view(buf, addr[1], v.shape, v.dtype).get()
        return host.view(v.dtype.np) if host.dtype != v.dtype.np else host

    return compare_launches(st.graph, slots, ref, feeds, lambda after: ex.step(feeds, after), read, atol, rtol, local)


def _feeds(graph: Graph, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The inputs as host arrays of the post-pass graph's input types (floats cast to the plan's
    storage dtype, as ``fusec run`` feeds an fp16 plan; int32 token ids as the plan's int64)."""
    out = {}
    for v in graph.inputs:
        if v.name not in inputs:
            raise FusecError(f"bisect: missing input {v.name!r} (the plan takes "
                             f"{', '.join(repr(x.name) for x in graph.inputs)})")
        a = np.asarray(inputs[v.name])
        out[v.name] = a.astype(v.dtype.np) if a.dtype != v.dtype.np and a.dtype.kind in "fiub" else a
    return out


__all__ = ["Report", "Row", "Slot", "bisect", "compare_launches", "diff", "launch_map", "reference_values", "staged_for"]
