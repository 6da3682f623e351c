"""``fusec export-graph PLAN_OR_MODEL -o fused.onnx``: the fused graph as ONNX, for Netron."""

from __future__ import annotations

import argparse
import os
from typing import Any

from fusec.cli._common import add_command, fmt_name
from fusec.cli.profile import add_subject_arguments, subject_from_args
from fusec.errors import InputError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "export-graph", "write the fused graph as ONNX (one node per kernel) for Netron",
        "Write the graph PLAN_OR_MODEL executes as an ONNX file: one node per kernel. A fused kernel\n"
        "is a node of the custom domain ai.fusec named after its ops (matmul+add+gelu) whose\n"
        "attributes list the fused ops, the fusion rule and, for a plan, the kernels it launches;\n"
        "a kernel that is one standard ONNX op stays that op. Open the file in Netron (netron.app)\n"
        "to see the fused structure. It passes onnx.checker but does not run in onnxruntime (use\n"
        "`fusec export-model` for a runnable file). A plan stores no graph: it is rebuilt from the\n"
        "plan's source model (or --model) and checked against the plan's launches. Needs no GPU.",
        ["fusec export-graph gpt2-small -o gpt2-fused.onnx",
         "fusec export-graph gpt2.fplan -o gpt2-fused.onnx --no-weights",
         "fusec export-graph model.fplan --model model.onnx -o fused.onnx"])
    add_subject_arguments(p)
    p.add_argument("-o", "--output", metavar="FUSED.onnx", required=True, help="the ONNX file to write")
    p.add_argument("--no-weights", action="store_true",
                   help="leave the weights out (they become graph inputs with their shapes): a small file")
    return p


def run(args: argparse.Namespace) -> int:
    from fusec.fsutil import check_output_path

    check_output_path(args.output, "ONNX file", not_same_as=[args.model] if os.path.isfile(args.model) else [])
    if not args.output.endswith(".onnx"):
        raise InputError(f"-o {args.output!r}: the output must be an .onnx file")
    sub = subject_from_args(args)
    sub.need_graph("export-graph")
    from fusec.report.export_graph import DOMAIN, VIEW_DOC, export_fused

    kernels: dict[int, list[str]] = {}
    if sub.is_plan:
        for L in sub.describe():
            if L["node"] is not None and L["kernel"]:
                kernels.setdefault(L["node"], []).append(L["kernel"])
    meta = {"fusec.source": args.model, "fusec.launches": str(len(sub.launches))}
    if sub.is_plan:
        meta.update({"fusec.arch": str(sub.plan.arch), "fusec.dtype": str(sub.plan.dtype)})
    model = export_fused(sub.graph, args.output, weights=not args.no_weights, kernels=kernels, meta=meta)
    fused = sum(1 for n in model.graph.node if n.domain == DOMAIN)
    views = sum(1 for n in model.graph.node if n.doc_string == VIEW_DOC)
    weights = "weights left out (graph inputs)" if args.no_weights else f"{sub.graph.weight_bytes:,} weight bytes"
    print(f"wrote {fmt_name(args.output)}: {len(model.graph.node) - views} kernels ({fused} as {DOMAIN} nodes)"
          + (f" and {views} views" if views else "") + f", {weights}; open it in Netron (netron.app)")
    return 0
