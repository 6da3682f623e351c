"""The ``fusec`` command line.

Each command is one module of this package exposing ``add_parser(subparsers)`` (returns its
argparse parser) and ``run(args) -> int``; ``COMMANDS`` below is the single list that registers
them, so adding a command is one new module plus one entry here.

Exit codes: 0 success; 2 bad usage (argparse); 1 a ``FusecError`` (bad model, inputs, shapes or
files), printed as one line ``fusec: error: <message>`` on stderr, and likewise an OS error (naming
the path), running out of memory or a too-deeply nested input; 130 Ctrl-C (temporary files are
removed). Any other exception is a bug in fusec and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from fusec import __version__
from fusec.errors import FusecError

# Module names under fusec.cli, in the order `fusec --help` lists them.
COMMANDS: tuple[str, ...] = ("models", "inspect", "explain", "compile", "run", "bench", "generate", "ab", "export_model")

_DESCRIPTION = """\
fusec: a kernel-fusion compiler for transformer models (ONNX -> graph IR -> fused CUDA plans).

MODEL arguments take a built-in model name (see `fusec models`) or a path to an .onnx file.
Run `fusec COMMAND --help` for what each command does, its options and an example."""

_EPILOG = """\
examples:
  fusec models
  fusec inspect gpt2-tiny --json
  fusec run gpt2-tiny --shapes input_ids:2x32,attention_mask:2x32
  fusec run model.onnx --inputs in.npz --save-outputs out.npz"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusec", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"fusec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"fusec.cli.{name}")
        cmd_parser = module.add_parser(sub)
        cmd_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one fusec command; returns the process exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help/--version (0) and usage errors (2): return, so callers in-process get a code
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        return int(args._run(args))
    except FusecError as e:
        print_error(str(e))
        return 1
    except KeyboardInterrupt:
        # files being written are temp files until the last moment; atomic_write removed them
        print_error("interrupted")
        return 130
    except MemoryError:
        print_error("out of memory: the model, its inputs or its shapes need more memory than this machine has "
                    "(check --shapes and the input files)")
        return 1
    except RecursionError:
        print_error("the model or an input file is nested too deeply to process (RecursionError)")
        return 1
    except OSError as e:
        if isinstance(e, BrokenPipeError):
            raise
        print_error(_os_error(e))
        return 1
    except BrokenPipeError:
        # `fusec inspect ... | head`: the reader left; not an error worth a traceback.
        _silence_stdout()
        return 1


def _os_error(e: OSError) -> str:
    """An OS error as one line naming the path(s) involved."""
    what = e.strerror or str(e) or type(e).__name__
    paths = [p for p in (e.filename, e.filename2) if p is not None]
    if paths:
        return f"{' -> '.join(repr(os.fsdecode(p)) if isinstance(p, bytes) else repr(p) for p in paths)}: {what}"
    return f"{what} ({type(e).__name__})"


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured)
        pass


def print_error(message: str) -> None:
    """``fusec: error: <message>`` as exactly one line, whatever the message holds."""
    line = one_line(message)
    enc = getattr(sys.stderr, "encoding", None) or "utf-8"
    # A name from a model file may not be encodable on this terminal; escape rather than crash.
    line = line.encode(enc, "backslashreplace").decode(enc, "replace")
    print(f"fusec: error: {line}", file=sys.stderr)


def one_line(text: str) -> str:
    """Escape line breaks and other control characters, so the text stays on one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
