"""What a report is about: a plan file or a model, resolved into its launches and fused graph.

A plan stores its launch list (one record per kernel launch or cuBLAS call, each with a label
``#<node index> <op>[ fused[<rule>]][ <part>]``) and the kernels' names, but not the fused graph:
which ops each kernel fuses and the memory plan's liveness live in the graph. ``load_subject``
rebuilds that graph from the plan's recorded source model (or ``--model``) with the same path the
compiler takes (``fusec.compiler.stage``, as a dry run: no NVRTC), and accepts it only when it
lowers to exactly the plan's launch labels and memory numbers; a generation plan's entries are
rebuilt from the decoder it records, in compile_generation's order. When it cannot (no recorded
source, a changed source file, other compile options), ``Subject.missing`` says what is missing
and reports that need the graph refuse with that sentence.

For a model, the graph is built and staged here; ``Subject.compiled()`` compiles the real plan
when one is needed (``fusec profile MODEL``).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fusec.errors import FusecError
from fusec.ops import Op

# Pure data movement inside a fused body: left out of a kernel's short name (still in its op list).
_LAYOUT_OPS = frozenset({"reshape", "transpose", "slice", "expand", "concat", "tile"})
_SHORT_TERMS = 5
_LABEL = re.compile(r"^#(\d+) (\S+)(?: fused\[([^\]]*)\])?(?: (.+))?$")


@dataclasses.dataclass
class Subject:
    """A plan or a model, as much of it as could be resolved."""

    target: str  # what the user named
    is_plan: bool
    entry: str
    launches: list[dict[str, Any]]  # the entry's launch records (manifest, or a dry-run lowering)
    kernels: list[dict[str, Any]]  # the plan's kernel table ([] for a model: nothing compiled yet)
    memory: dict[str, Any]  # the manifest's memory numbers (a model: the memory plan's summary)
    graph: Any = None  # the fused fusec.ir.Graph, or None (see missing)
    mplan: Any = None  # its passes.memory_plan.MemoryPlan
    plan: Any = None  # the fusec.plan.Plan (a plan file, or compiled on demand)
    missing: str | None = None  # why graph is None
    _compile: Callable[[Any], Any] | None = None

    def need_graph(self, what: str) -> None:
        """Refuse a report that needs the fused graph when it could not be rebuilt."""
        if self.graph is None:
            raise FusecError(f"{what} needs the plan's fused graph: {self.missing}")

    def compiled(self, progress: Callable[[str, str], None] | None = None) -> Any:
        """The runnable Plan (a model is compiled on first use, with the options it was staged with)."""
        if self.plan is None and self._compile is not None:
            from fusec.plan import entry_points

            self.plan = self._compile(progress)
            launches = list(entry_points(self.plan.manifest)[self.entry]["launches"])
            mismatch = _mismatch([L.get("label", "") for L in launches], [L.get("label", "") for L in self.launches])
            if mismatch is not None:  # not expected: compile and the dry run take one path
                self.graph, self.mplan, self.missing = None, None, f"the compiled plan differs from the dry run ({mismatch})"
            self.launches, self.kernels = launches, list(self.plan.manifest["kernels"])
        return self.plan

    def describe(self) -> list[dict[str, Any]]:
        """One record per launch: index, label, name, ops, rule, node, part, kernel."""
        return describe_launches(self.launches, self.graph, self.kernels)


def load_subject(target: str, *, shapes: Mapping[str, Sequence[int]] | None = None, dtype: str = "fp16",
                 arch: str | None = None, disabled_fusions: Sequence[str] = (), enabled_fusions: Sequence[str] = (),
                 model: str | None = None, entry: str | None = None,
                 progress: Callable[[str, str], None] | None = None) -> Subject:
    """Resolve ``target`` (a .fplan file, a built-in model name or an .onnx path).

    For a plan, ``model`` names its source model when the plan does not record one; ``shapes``,
    ``dtype`` and ``arch`` then come from the plan. ``entry``: which entry point (default: the first)."""
    if progress is not None:
        progress("build", target)
    plan = _plan_or_none(target)
    if plan is not None:
        return _plan_subject(target, plan, model, entry, disabled_fusions, enabled_fusions, progress)
    if model is not None:
        raise FusecError(f"--model applies to a plan file; {target!r} is a model")
    if entry not in (None, "main"):
        raise FusecError(f"--entry {entry!r}: a model has one entry point, 'main'")
    from fusec.codegen.compile import default_arch
    from fusec.loader import load_graph

    graph = load_graph(target, shapes)
    arch = arch or default_arch()
    staged = _stage(graph, dtype, arch, progress, disabled_fusions=disabled_fusions, enabled_fusions=enabled_fusions)

    def compile_plan(progress: Callable[[str, str], None] | None) -> Any:
        import fusec

        return fusec.compile(graph, dtype=dtype, arch=arch, disabled_fusions=disabled_fusions,
                             enabled_fusions=enabled_fusions, progress=progress)

    return Subject(target, False, "main", list(staged.lowered.launches), [], staged.memory.summary(),
                   graph=staged.graph, mplan=staged.memory, _compile=compile_plan)


def is_plan_file(target: str) -> bool:
    """Does ``target`` name a plan file (by its magic bytes)?"""
    from fusec.planfile import MAGIC

    if not os.path.isfile(target):
        return False
    with open(target, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _plan_or_none(target: str) -> Any:
    """A validated Plan when ``target`` is a plan file, else None."""
    if not is_plan_file(target):
        return None
    from fusec.plan import Plan

    return Plan.load(target)


def _stage(graph: Any, dtype: str, arch: str, progress: Callable[[str, str], None] | None, **options: Any) -> Any:
    """``fusec.compiler.stage`` as a dry run (passes, memory plan, launch list; no NVRTC)."""
    from fusec.compiler import DTYPES, stage

    if dtype not in DTYPES:
        raise FusecError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    return stage(graph, dtype, arch, dry_run=True, progress=progress, **options)


def _plan_subject(target: str, plan: Any, model: str | None, entry: str | None, disabled: Sequence[str],
                  enabled: Sequence[str], progress: Callable[[str, str], None] | None) -> Subject:
    from fusec.plan import entry_points

    m = plan.manifest
    entries = entry_points(m)
    name = entry or next(iter(entries))
    if name not in entries:
        raise FusecError(f"--entry {name!r}: the plan has no such entry point (entries: {', '.join(map(repr, entries))})")
    sub = Subject(target, True, name, list(entries[name]["launches"]), list(m["kernels"]), dict(m["memory"]), plan=plan)
    if len(entries) > 1:
        return _generation_subject(sub, model, progress)
    src = m.get("source") or {}
    source = model or src.get("model")
    if model is None and src.get("kind") == "file" and source:
        source = os.path.join(os.path.dirname(os.path.abspath(target)), str(source))  # recorded: its base name
    if not source:
        sub.missing = f"{target} records no fused graph and no source model; give the model it was compiled from with --model"
        return sub
    recorded = src.get("options") or {}  # the compile options that shape the graph, where the plan records them
    options = {"disabled_fusions": tuple(disabled) or tuple(recorded.get("disabled_fusions") or ()),
               "enabled_fusions": tuple(enabled) or tuple(recorded.get("enabled_fusions") or ()),
               "fusion_overrides": dict(recorded.get("fusion_overrides") or {}),
               "choices": dict(recorded.get("choices") or {}),
               "fp32_gemm": str(recorded.get("fp32_gemm") or "3xtf32")}  # --fp32-gemm sgemm is recorded
    from fusec.loader import load_graph

    shapes = {k: tuple(v) for k, v in (src.get("shapes") or {}).items()} or None
    try:
        if src.get("kind") == "file" and src.get("sha256") and os.path.isfile(source):
            from fusec import loader

            digest = getattr(loader, "file_sha256", None)
            if digest is not None and digest(source) != src["sha256"]:
                raise FusecError(f"{source!r} is not the file the plan was compiled from (its sha256 differs)")
        graph = load_graph(source, shapes)
        staged = _stage(graph, str(m["dtype"]), str(m["arch"]), progress=progress, **options)
    except FusecError as e:
        sub.missing = f"its source model cannot be rebuilt ({e}); give it with --model"
        return sub
    mismatch = _mismatch([L.get("label", "") for L in sub.launches], [L.get("label", "") for L in staged.lowered.launches])
    got, want = staged.memory.summary(), m["memory"]
    for key in ("planned_bytes", "lower_bound_bytes"):
        if mismatch is None and key in want and int(want[key]) != int(got[key]):
            mismatch = f"memory {key} {int(got[key]):,} vs the plan's {int(want[key]):,}"
    if mismatch is not None:
        sub.missing = (f"its source model {source!r} rebuilt here does not give the plan's launches ({mismatch}); "
                       "was it compiled with other --disable-fusion/--enable-fusion flags or A/B decisions? "
                       "Pass the same flags, or the model it came from with --model")
        return sub
    sub.graph, sub.mplan = staged.graph, staged.memory
    return sub


def _generation_subject(sub: Subject, model: str | None, progress: Callable[[str, str], None] | None) -> Subject:
    """A generation plan's entry: its prefill and decode graphs are built again from the decoder
    the plan records (``manifest["generation"]``) and staged in the compiler's order (state layout
    of the first graph, kernels and weights shared, weights read [N, K]), as compile_generation does."""
    m = sub.plan.manifest
    gen = m.get("generation") or {}
    source = model or gen.get("source")
    if model is None and source and not _is_builtin(str(source)):
        source = os.path.join(os.path.dirname(os.path.abspath(sub.target)), str(source))  # recorded: its base name
    if not source:
        sub.missing = f"{sub.target} is a generation plan that records no decoder; give it with --model"
        return sub
    try:
        from fusec.compiler import DTYPES, stage, state_layout
        from fusec.genmodel import build_graphs, load_generation_model

        if progress is not None:
            progress("build", str(source))
        graphs = build_graphs(load_generation_model(source), int(gen["batch"]), int(gen["max_seq_len"]),
                              gen.get("prefill_len"), gen.get("eos_ids"))
        dtype, arch = str(m["dtype"]), str(m["arch"])
        recs, _ = state_layout(next(iter(graphs.values())), DTYPES[dtype][0])
        layout, shared, staged = {r["name"]: r["offset"] for r in recs}, None, None
        for name, graph in graphs.items():
            st = stage(graph, dtype, arch, state_layout=layout, shared=shared, dry_run=True, weights_nk=True,
                       progress=progress)
            shared = st.lowered
            if name == sub.entry:
                staged = st
    except (FusecError, KeyError, TypeError) as e:
        sub.missing = f"its decoder {source!r} cannot be rebuilt ({type(e).__name__}: {e}); give it with --model"
        return sub
    mismatch = "no such entry rebuilt" if staged is None else \
        _mismatch([L.get("label", "") for L in sub.launches], [L.get("label", "") for L in staged.lowered.launches])
    if mismatch is not None:
        sub.missing = f"its decoder {source!r} rebuilt here does not give the plan's {sub.entry} launches ({mismatch})"
        return sub
    sub.graph, sub.mplan = staged.graph, staged.memory
    return sub


def _is_builtin(name: str) -> bool:
    from fusec.loader import builtin_names

    return name in builtin_names()


def _mismatch(have: list[str], rebuilt: list[str]) -> str | None:
    if have == rebuilt:
        return None
    for i, (a, b) in enumerate(zip(have, rebuilt)):
        if a != b:
            return f"launch {i} is {a!r} in the plan, {b!r} rebuilt"
    return f"{len(rebuilt)} launches rebuilt, {len(have)} in the plan"


# ---- naming launches ---------------------------------------------------------------------------

def node_ops(node: Any) -> list[str]:
    """The ops a node computes, in order: a fused node's body (nested bodies flattened)."""
    if node.op == Op.FUSED:
        return [op for inner in node.attrs.body.nodes for op in node_ops(inner)]
    return [node.op.value]


def short_name(ops: Sequence[str]) -> str:
    """A kernel's name from its ops: layout ops dropped (unless nothing else), repeats as ``xN``,
    at most five terms (``matmul+add+gelu``, ``attention``, ``cast+sub+mul+min``)."""
    core = [o for o in ops if o not in _LAYOUT_OPS] or list(ops)
    terms: list[str] = []
    counts: list[int] = []
    for o in core:
        if terms and terms[-1] == o:
            counts[-1] += 1
        else:
            terms.append(o)
            counts.append(1)
    parts = [t if n == 1 else f"{t}x{n}" for t, n in zip(terms, counts)]
    if len(parts) > _SHORT_TERMS:
        parts = parts[:_SHORT_TERMS - 1] + [f"...({len(ops)} ops)"]
    return "+".join(parts)


def parse_label(label: str) -> dict[str, Any]:
    """``#3 fused fused[gemm_epilogue] epilogue`` -> node 3, op fused, rule gemm_epilogue, part
    epilogue. Labels of other shapes (a state write-back) give node None."""
    m = _LABEL.match(label or "")
    if m is None:
        return {"node": None, "op": None, "rule": None, "part": label or None}
    return {"node": int(m.group(1)), "op": m.group(2), "rule": m.group(3), "part": m.group(4)}


def describe_launches(launches: Sequence[Mapping[str, Any]], graph: Any = None,
                      kernels: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """Each launch named after the ops of its node (the fused graph), else after its label."""
    out = []
    for i, L in enumerate(launches):
        lab = parse_label(str(L.get("label", "")))
        node = None
        if graph is not None and lab["node"] is not None and lab["node"] < len(graph.nodes):
            node = graph.nodes[lab["node"]]
        if node is not None:
            ops = node_ops(node)
            name = short_name(ops)
        else:
            ops = [lab["op"]] if lab["op"] and lab["op"] != "fused" else []
            name = (f"fused[{lab['rule']}]" if lab["rule"] else lab["op"]) or str(L.get("label", "")) or f"launch {i}"
        if lab["part"] and lab["node"] is not None:
            name = f"{name} ({lab['part']})"
        if L.get("type") == "gemm":
            kernel = f"cublas_gemm_{L.get('dtype', '?')} m={L.get('m')} n={L.get('n')} k={L.get('k')} batch={L.get('batch')}"
        elif "kernel" in L and int(L["kernel"]) < len(kernels):
            kernel = str(kernels[int(L["kernel"])]["entry"])
        else:
            kernel = None
        rec = {"index": i, "label": str(L.get("label", "")), "name": name, "ops": ops, "rule": lab["rule"],
               "node": lab["node"], "part": lab["part"], "kernel": kernel, "type": L.get("type", "kernel")}
        rec.update({k: list(L[k]) for k in ("grid", "block") if k in L})
        out.append(rec)
    return out
