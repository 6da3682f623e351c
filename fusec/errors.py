"""User-facing errors. The CLI turns any ``FusecError`` into a one-line message ``fusec: error: ...``
and its ``exit_code`` (1 unless a subclass says otherwise); any other exception is a bug in fusec
(exit 70, the traceback with ``--debug``). See ``fusec.cli`` for every exit code."""

from __future__ import annotations


class FusecError(Exception):
    """Base of every error caused by the user's model, inputs, options or files."""

    exit_code = 1


class ModelError(FusecError):
    """The model file or built-in model is unusable (unreadable, unsupported op, bad data)."""


class InputError(FusecError, ValueError):
    """The caller's inputs, shapes or options do not fit the model; the message names which."""


class CheckFailed(FusecError):
    """``fusec run --check/--compare``: outputs differ from the yardstick beyond the tolerance."""

    exit_code = 3
