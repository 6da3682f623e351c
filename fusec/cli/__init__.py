"""The ``fusec`` command line.

Each command is one module of this package exposing ``add_parser(subparsers)`` (returns its
argparse parser) and ``run(args) -> int``; ``COMMANDS`` below is the single list that registers
them, so adding a command is one new module plus one entry here.

Exit codes: 0 success; 1 a ``FusecError`` (bad model, inputs, shapes, options or files, a missing
CUDA toolchain piece), an OS error (naming the path), running out of memory or a too-deeply nested
input; 2 bad usage (argparse); 3 ``run --check``/``--compare`` found outputs that differ; 70 an
unexpected exception (a bug in fusec); 130 Ctrl-C (files being written are removed). Every failure
is one line ``fusec: error: <message>`` on stderr; ``--debug`` (or ``FUSEC_DEBUG=1``) adds the
traceback, and a multi-line message (a compiler log) goes whole to a log file the line names.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from fusec.errors import FusecError

# Module names under fusec.cli, in the order `fusec --help` lists them.
COMMANDS: tuple[str, ...] = ("models", "inspect", "explain", "compile", "run", "bench", "generate", "train", "ab", "export_model",
                             "doctor") + ("profile", "export_graph", "memory", "serve")

EXIT_ERROR, EXIT_USAGE, EXIT_MISMATCH, EXIT_BUG, EXIT_INTERRUPTED = 1, 2, 3, 70, 130

_DESCRIPTION = """\
fusec: a kernel-fusion compiler for transformer models (ONNX -> graph IR -> fused CUDA plans).

MODEL arguments take a built-in model name (see `fusec models`) or a path to an .onnx or .gguf
file; `generate` and `compile --generate` also take a Hugging Face checkpoint directory or hub id.
Run `fusec COMMAND --help` for what each command does, its options and an example;
`fusec doctor` checks the CUDA toolchain and says how to install what is missing."""

_EPILOG = """\
examples:
  fusec models
  fusec inspect gpt2-tiny --json
  fusec run gpt2-tiny --shapes input_ids:2x32,attention_mask:2x32
  fusec run model.onnx --inputs in.npz --save-outputs out.npz --check
  python -m fusec doctor

exit status: 0 success, 1 error (one line `fusec: error: ...`), 2 usage error,
3 outputs differ (run --check/--compare), 70 a bug in fusec, 130 interrupted"""


class _VersionAction(argparse.Action):
    """``--version``: fusec's version and the toolchain's (CuPy, NVRTC, driver, numpy, onnx)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):  # noqa: A002
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from fusec.toolchain import versions

        v = versions()
        print(f"fusec {v.pop('fusec')}")
        print("  " + ", ".join(f"{k.replace('_', ' ')} {val if val else 'not installed' if k != 'cuda_driver' else 'none'}"
                               for k, val in v.items()))
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    from fusec.cli._common import add_global_flags

    from fusec import knobs

    env = "\n".join("  " + line for line in knobs.describe())
    parser = argparse.ArgumentParser(prog="fusec", allow_abbrev=False, description=_DESCRIPTION,
                                     epilog=f"{_EPILOG}\n\nenvironment variables (read when used):\n{env}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_VersionAction, help="print fusec's and the CUDA toolchain's versions")
    add_global_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"fusec.cli.{name}")
        cmd_parser = module.add_parser(sub)
        cmd_parser.set_defaults(_run=module.run)
    return parser


def _debug_wanted(argv: Sequence[str]) -> bool:
    from fusec import knobs
    from fusec.errors import InputError

    try:
        on = bool(knobs.get("FUSEC_DEBUG"))
    except InputError:  # FUSEC_DEBUG=yes-please: debugging was asked for
        on = True
    return on or "--debug" in argv


def main(argv: Sequence[str] | None = None) -> int:
    """Run one fusec command; returns the process exit code (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_wanted(argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # files being written are temp files until the last moment; atomic_write removed them
        _cancel_compiles()
        return _fail("interrupted", EXIT_INTERRUPTED, debug)
    except BrokenPipeError:
        # `fusec inspect ... | head`: the reader left; not an error worth a traceback.
        _silence_stdout()
        return EXIT_ERROR
    except FusecError as e:
        message = _with_log(str(e)) if getattr(e, "log", None) is not None else str(e)
        return _fail(message, e.exit_code, debug)
    except MemoryError:
        return _fail("out of memory: the model, its inputs or its shapes need more memory than this machine has "
                     "(check --shapes and the input files)", EXIT_ERROR, debug)
    except RecursionError:
        return _fail("the model or an input file is nested too deeply to process (RecursionError)", EXIT_ERROR, debug)
    except Exception as e:  # noqa: BLE001 -- the last resort: never a bare traceback
        from fusec.toolchain import explain_missing

        missing = explain_missing(e)
        if missing is not None:
            return _fail(missing, EXIT_ERROR, debug)
        if isinstance(e, OSError):
            return _fail(_os_error(e), EXIT_ERROR, debug)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return _fail(f"internal error, a bug in fusec: {type(e).__name__}: {first} "
                     f"(run again with --debug for the traceback, and please report it)", EXIT_BUG, debug)


def entry() -> None:
    """The ``fusec`` executable (and ``python -m fusec``): ``main``, then exit with its code. After
    Ctrl-C the process ends at once: it does not wait for the NVRTC compiles still running on the
    pool's threads (the interpreter joins them at exit; a cache entry they were writing is a temp
    file that the next writer of that cache directory removes)."""
    code = main()
    if code == EXIT_INTERRUPTED:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def _cancel_compiles() -> None:
    """Ctrl-C: the compiles still queued are not wanted (the interpreter would run them at exit)."""
    if "fusec.codegen.compile" in sys.modules:
        sys.modules["fusec.codegen.compile"].cancel_queued()


def _main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help/--version (0) and usage errors (2): return, so callers in-process get a code
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    from fusec.cli import _common

    _common.set_verbosity(args)
    return int(args._run(args))


def _fail(message: str, code: int, debug: bool) -> int:
    if debug:
        import traceback

        traceback.print_exc()
    print_error(message)
    return code


def _with_log(message: str) -> str:
    """A compiler error's message (its log follows the first line) as its first line; the whole
    text goes to a log file that the line names."""
    lines = message.strip().splitlines()
    if len(lines) <= 1:
        return message
    import tempfile

    try:
        fd, path = tempfile.mkstemp(prefix="fusec-error-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(message.rstrip() + "\n")
    except OSError:
        return f"{lines[0].rstrip(':')} (+{len(lines) - 1} more lines; run with --debug to see them)"
    return f"{lines[0].rstrip(':')} (full log: {path})"


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
