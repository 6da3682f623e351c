"""``fusec inspect MODEL``: what a model is made of.

The report is a plain JSON-able dict built by ``build_report``; the text form is rendered from
the same dict. Later stages add their own top-level keys (say ``"compile"``: a dict the compiler
fills) and both forms pick them up: ``--json`` as is, the text form through ``_render_extra``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fusec.cli._common import add_command, add_model_arguments, fmt_name, load_model, value_record
from fusec.ir import Graph

# Keys the text renderer lays out itself; any other key is rendered generically.
_CORE_KEYS = ("model", "graph", "inputs", "outputs", "parameters", "weights_bytes", "constants", "nodes", "ops",
              "imported_ops", "fusions")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "inspect", "summarize a model: ops, parameters, weight bytes, inputs and outputs",
        "Load MODEL (verifying the graph) and report its op histogram, number of parameters,\n"
        "weight bytes, and its inputs and outputs with shapes and dtypes. Names from the model\n"
        "file are printed JSON-quoted when they hold anything unusual.\n\n"
        "With --json, prints exactly one JSON object with at least the keys model, ops,\n"
        "parameters, weights_bytes, inputs and outputs (each input/output {name, shape, dtype}).",
        ["fusec inspect gpt2-tiny", "fusec inspect model.onnx --shapes input_ids:1x128,attention_mask:1x128 --json"])
    add_model_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def build_report(graph: Graph, model: str) -> dict[str, Any]:
    """The facts ``inspect`` reports about ``graph`` (JSON-able)."""
    report: dict[str, Any] = {
        "model": model,
        "graph": graph.name,
        "inputs": [value_record(v) for v in graph.inputs],
        "outputs": [value_record(v) for v in graph.outputs],
        "parameters": graph.num_parameters,
        "weights_bytes": graph.weight_bytes,
        "constants": len(graph.constants),
        "nodes": len(graph.nodes),
        "ops": graph.op_histogram(),
    }
    if graph.meta:  # records passes left on the graph (documented JSON-able)
        report["meta"] = graph.meta
    return report


def optimized_report(graph: Graph) -> dict[str, Any]:
    """What compilation makes of ``graph``: the optimized op histogram, the exact number of
    kernel launches, patterns, fusion decisions, transposes cached, GEMMs merged, memory."""
    from fusec.codegen.compile import default_arch
    from fusec.compiler import stage

    # the one staging path `fusec compile` takes (fp32, this GPU's arch or sm_90), lowered as a
    # dry run: "kernels" counts launches (a cuBLAS GEMM and its epilogue are two)
    st = stage(graph, "fp32", default_arch(), dry_run=True)
    rep = dict(st.report)
    rep["kernels"] = st.lowered.report["launches"]
    rep["kernels_by_kind"] = st.lowered.report["by_template"]
    rep.setdefault("transposes_cached", 0)
    rep.setdefault("gemms_merged", 0)
    rep.setdefault("transposes_flagged", 0)
    rep.setdefault("gemms_padded", 0)
    rep.setdefault("patterns", {})
    rep.setdefault("fusions", [])
    return rep


def run(args: argparse.Namespace) -> int:
    from fusec.cli.run import load_plan_or_none

    plan = load_plan_or_none(args.model)
    if plan is not None:
        report = {"model": args.model, **plan.info()}
        print(json.dumps(report, indent=2, ensure_ascii=True) if args.json else render_plan(report))
        return 0
    graph = load_model(args)
    report = build_report(graph, args.model)
    opt = optimized_report(graph)
    report["imported_ops"] = report["ops"]
    report["ops"] = opt.pop("ops")
    report["nodes"] = opt.pop("nodes")
    for key in ("name", "constants", "parameters", "declines", "stats", "passes"):
        opt.pop(key, None)
    report.update(opt)
    if args.json:
        # ensure_ascii: names from model files come out as \\uXXXX escapes, valid on any terminal
        print(json.dumps(report, indent=2, ensure_ascii=True))
    else:
        print(render_text(report))
    return 0


def render_plan(report: dict[str, Any]) -> str:
    mem = report["memory"]
    lines = [f"plan        {fmt_name(report['model'])}",
             f"arch        {report['arch']}   dtype {report['dtype']}   fusec {report.get('fusec_version')}"
             + ("   cuda-graph" if report.get("cuda_graph") else ""),
             f"memory      arena {_bytes(mem['arena_bytes'])}, weights {_bytes(mem['weights_bytes'])}"]
    lines.extend(_signature_lines(report))
    lines.append(f"kernels ({report['launches']} launches per run):")
    for k in report["kernels"]:
        geo = f"grid {k['grid']} block {k['block']} smem {k['smem']}" if "grid" in k else \
            f"m={k['m']} n={k['n']} k={k['k']} batch={k['batch']}"
        lines.append(f"  {k['label']:<28} {k['name']:<28} {geo}")
    return "\n".join(lines)


def _signature_lines(report: dict[str, Any]) -> list[str]:
    """The inputs and outputs, one per line, names printed safely."""
    lines = []
    for key in ("inputs", "outputs"):
        lines.append(f"{key}:")
        for v in report[key]:
            lines.append(f"  {fmt_name(v['name'])}  {v['dtype']}[{','.join(str(d) for d in v['shape'])}]")
    return lines


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def render_text(report: dict[str, Any]) -> str:
    lines = [f"model       {fmt_name(report['model'])}",
             f"graph       {fmt_name(report['graph'])}",
             f"parameters  {report['parameters']:,}",
             f"weights     {_bytes(report['weights_bytes'])} ({report['weights_bytes']:,} bytes in "
             f"{report['constants']} constants)"]
    lines.extend(_signature_lines(report))
    lines.append(f"ops ({report['nodes']} nodes):")
    width = max((len(k) for k in report["ops"]), default=0)
    for op, count in report["ops"].items():
        lines.append(f"  {op:<{width}}  {count}")
    for key, value in report.items():
        if key not in _CORE_KEYS:
            lines.extend(_render_extra(key, value, 0))
    return "\n".join(lines)


def _render_extra(key: str, value: Any, depth: int) -> list[str]:
    pad = "  " * depth
    if isinstance(value, dict) and value:
        out = [f"{pad}{fmt_name(str(key))}:"]
        for k, v in value.items():
            out.extend(_render_extra(str(k), v, depth + 1))
        return out
    # scalars and lists on one line, JSON-escaped so nothing from a model file can break it
    text = value if isinstance(value, (int, float)) and not isinstance(value, bool) else json.dumps(value, default=str)
    return [f"{pad}{fmt_name(str(key))}: {text}"]
