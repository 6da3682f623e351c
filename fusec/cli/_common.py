"""Pieces shared by the command modules: the MODEL/--shapes arguments, the global flags
(--debug, -q/-v) and fusion flags every command shares, loading, safe printing."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fusec.ir import Graph, Value

MODEL_HELP = "a built-in model name (see `fusec models`) or a path to an .onnx or .gguf file"
SHAPES_HELP = ("static input shapes, NAME:DxDx... separated by commas, e.g. input_ids:8x128,attention_mask:8x128 "
               "(needed for inputs with dynamic dims; built-in models have defaults)")


QUIET, NORMAL, VERBOSE = 0, 1, 2
# How much goes to stderr besides results and errors: -q (QUIET) only those; -v (VERBOSE) also
# every progress step and timings. Set by fusec.cli.main from the parsed flags.
VERBOSITY = NORMAL


def add_global_flags(parser: argparse.ArgumentParser, top: bool = False) -> None:
    """--debug, -q, -v: accepted before the command and after it (``fusec -q run ...`` or
    ``fusec run ... -q``). On subcommands they default to SUPPRESS so they never undo the top level's."""
    default = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    g = parser.add_argument_group("global options")
    g.add_argument("--debug", action="store_true", default=default(False),
                   help="show the traceback of an error (also FUSEC_DEBUG=1)")
    loud = g.add_mutually_exclusive_group()
    loud.add_argument("-q", "--quiet", action="store_true", default=default(False),
                      help="print only results and errors (no notes or progress on stderr)")
    loud.add_argument("-v", "--verbose", action="store_true", default=default(False),
                      help="also print every progress step and timings on stderr")


def set_verbosity(args: argparse.Namespace) -> None:
    global VERBOSITY
    if getattr(args, "quiet", False) and getattr(args, "verbose", False):
        from fusec.errors import InputError

        raise InputError("-q/--quiet and -v/--verbose exclude each other")
    VERBOSITY = QUIET if getattr(args, "quiet", False) else VERBOSE if getattr(args, "verbose", False) else NORMAL


def note(message: str, level: int = NORMAL) -> None:
    """A line on stderr that is not a result (a note, progress, a timing), shown at ``level`` and above."""
    if VERBOSITY >= level:
        print(message, file=sys.stderr)


def add_command(subparsers: Any, name: str, summary: str, description: str, examples: list[str]) -> argparse.ArgumentParser:
    """A subcommand parser whose --help shows ``description`` and an examples section."""
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    p = subparsers.add_parser(name, allow_abbrev=False, help=summary, description=description, epilog=epilog,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_global_flags(p)
    return p


def add_fusion_arguments(p: argparse.ArgumentParser, deprecated_aliases: bool = False) -> None:
    """--disable-fusion/--enable-fusion RULE, the same on every command that compiles or optimizes
    (checked by ``check_fusion_names``). ``deprecated_aliases``: also the hidden old spellings
    --disable/--enable (explain's before the flags were unified)."""
    from fusec.passes.fusion_rules import RULES

    known = ", ".join(RULES)
    p.add_argument("--disable-fusion", metavar="RULE", action="append", default=[],
                   help=f"turn a fusion rule off (repeatable): {known}")
    p.add_argument("--enable-fusion", metavar="RULE", action="append", default=[], help="turn a fusion rule on (repeatable)")
    if deprecated_aliases:
        p.add_argument("--disable", dest="disable_fusion", action="append", help=argparse.SUPPRESS)
        p.add_argument("--enable", dest="enable_fusion", action="append", help=argparse.SUPPRESS)


def check_fusion_names(args: argparse.Namespace) -> None:
    """Unknown --disable-fusion/--enable-fusion names: one line listing the known rules."""
    from fusec.errors import InputError
    from fusec.passes.fusion_rules import RULES

    for flag, names in (("--disable-fusion", getattr(args, "disable_fusion", [])),
                        ("--enable-fusion", getattr(args, "enable_fusion", []))):
        unknown = [n for n in names if n not in RULES]
        if unknown:
            raise InputError(f"{flag}: unknown fusion rule {', '.join(repr(n) for n in unknown)} "
                             f"(known: {', '.join(RULES)})")


def add_json_flag(p: argparse.ArgumentParser, what: str = "one JSON object") -> None:
    """--json, the same switch on every command: print ``what`` on stdout instead of text."""
    p.add_argument("--json", action="store_true", help=f"print {what} on stdout instead of text")


def add_model_arguments(parser: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:  # noqa: A002
    parser.add_argument("model", metavar="MODEL", help=help)
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
