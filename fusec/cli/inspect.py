"""``fusec inspect MODEL``: what a model is made of.

The report is a plain JSON-able dict built by ``build_report``; the text form is rendered from
the same dict (``fusec.cli.inspect_text``). A plan is mapped, not read: its weights are never
touched (``fusec.planfile``). Later stages add their own top-level keys (say ``"compile"``: a dict
the compiler fills) and both forms pick them up: ``--json`` as is, the text form generically.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fusec.cli._common import add_command, add_model_arguments, load_model, value_record
from fusec.cli.inspect_text import render_plan, render_text
from fusec.ir import Graph


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "inspect", "summarize a model: ops, parameters, weight bytes, inputs and outputs",
        "Load MODEL (verifying the graph) and report its op histogram, number of parameters,\n"
        "weight bytes, and its inputs and outputs with shapes and dtypes. Names from the model\n"
        "file are printed JSON-quoted when they hold anything unusual.\n\n"
        "With --json, prints exactly one JSON object with at least the keys model, ops,\n"
        "parameters, weights_bytes, inputs and outputs (each input/output {name, shape, dtype}).\n\n"
        "A .gguf file is read from its header alone (no weight is loaded): the architecture and\n"
        "whether `fusec generate` runs it, the dims and options, the tokenizer, the tensor types.",
        ["fusec inspect gpt2-tiny", "fusec inspect model.onnx --shapes input_ids:1x128,attention_mask:1x128 --json",
         "fusec inspect Qwen3-0.6B-Q8_0.gguf"])
    add_model_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp16",
                   help="storage dtype of the plan reported (default fp16, as compile)")
    from fusec.cli.compile import add_quantize_arguments

    add_quantize_arguments(p)
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


def optimized_report(graph: Graph, dtype: str = "fp16", **quantize: Any) -> dict[str, Any]:
    """What compilation makes of ``graph``: the optimized op histogram, the exact number of
    kernel launches, patterns, fusion decisions, transposes cached, GEMMs merged, memory, weight
    formats (``quantize``: ``fusec.compiler.quantize_options``)."""
    from fusec.codegen.compile import default_arch
    from fusec.compiler import stage

    # the one staging path `fusec compile` takes (this GPU's arch or sm_90), lowered as a dry run:
    # "kernels" counts launches (a cuBLAS GEMM and its epilogue are two)
    st = stage(graph, dtype, default_arch(), dry_run=True, **quantize)
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

    if args.model.lower().endswith(".gguf"):  # the header alone: architecture, dims, tokenizer, tensor types
        from fusec.cli.inspect_gguf import gguf_report, render_gguf

        rep = gguf_report(args.model)
        print(json.dumps(rep, indent=2, ensure_ascii=True) if args.json else render_gguf(rep))
        return 0
    plan = load_plan_or_none(args.model)
    if plan is not None:
        report = {"model": args.model, **plan.info()}
        print(json.dumps(report, indent=2, ensure_ascii=True) if args.json else render_plan(report))
        return 0
    from fusec.cli.compile import quantize_from_args

    quant = quantize_from_args(args)
    graph = load_model(args)
    report = build_report(graph, args.model)
    opt = optimized_report(graph, args.dtype, **quant)
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
