"""Pieces shared by the command modules: the MODEL/--shapes arguments, loading, safe printing."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fusec.ir import Graph, Value

MODEL_HELP = "a built-in model name (see `fusec models`) or a path to an .onnx file"
SHAPES_HELP = ("static input shapes, NAME:DxDx... separated by commas, e.g. input_ids:8x128,attention_mask:8x128 "
               "(needed for inputs with dynamic dims; built-in models have defaults)")


def add_command(subparsers: Any, name: str, summary: str, description: str, examples: list[str]) -> argparse.ArgumentParser:
    """A subcommand parser whose --help shows ``description`` and an examples section."""
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    return subparsers.add_parser(name, help=summary, description=description, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--shapes", metavar="SHAPES", help=SHAPES_HELP)


def load_model(args: argparse.Namespace) -> Graph:
    """The Graph named by ``args.model`` with ``args.shapes`` applied (FusecError if either is bad)."""
    from fusec.loader import load_graph
    from fusec.shapes import parse_shapes

    shapes = parse_shapes(args.shapes) if args.shapes is not None else None
    return load_graph(args.model, shapes)


def fmt_name(name: str) -> str:
    """A name from a model file, printable on one line: plain names bare, others JSON-quoted
    (ASCII only, so quotes, newlines and non-ASCII cannot break a line or a terminal)."""
    if name and name.isascii() and all(c.isalnum() or c in "._/:-" for c in name):
        return name
    return json.dumps(name)


def value_record(v: Value) -> dict[str, Any]:
    """The JSON form of a graph input or output."""
    return {"name": v.name, "shape": list(v.shape), "dtype": v.dtype.value}
