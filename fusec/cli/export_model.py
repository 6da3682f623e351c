"""``fusec export-model NAME -o FILE.onnx``: write a model as an ONNX file."""

from __future__ import annotations

import argparse
from typing import Any

from fusec.cli._common import SHAPES_HELP, add_command, fmt_name, load_model


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "export-model", "write a built-in model as an ONNX file",
        "Build NAME (a built-in model, see `fusec models`; an .onnx path also works and\n"
        "round-trips through fusec's IR) and write it to FILE.onnx with its weights, with static\n"
        "input shapes (the defaults, or --shapes). The file loads in onnxruntime and in fusec.",
        ["fusec export-model gpt2-tiny -o gpt2-tiny.onnx",
         "fusec export-model bert-tiny --shapes input_ids:2x64,attention_mask:2x64 -o bert.onnx"])
    p.add_argument("model", metavar="NAME", help="a built-in model name (see `fusec models`) or an .onnx file")
    p.add_argument("-o", "--output", metavar="FILE.onnx", required=True, help="where to write the ONNX file")
    p.add_argument("--shapes", metavar="SHAPES", help=SHAPES_HELP)
    return p


def run(args: argparse.Namespace) -> int:
    import os

    from fusec.fsutil import check_output_path

    check_output_path(args.output, "ONNX file", not_same_as=[args.model] if os.path.isfile(args.model) else [])
    graph = load_model(args)
    from fusec.onnx_export import export_onnx

    export_onnx(graph, args.output)
    print(f"wrote {fmt_name(args.output)} ({len(graph.nodes)} nodes, {graph.weight_bytes:,} weight bytes)")
    return 0
