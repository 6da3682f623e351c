"""User-facing errors. The CLI turns any ``FusecError`` into a one-line message and exit code 1;
anything else is a bug in fusec and keeps its traceback."""

from __future__ import annotations


class FusecError(Exception):
    """Base of every error caused by the user's model, inputs, options or files."""


class ModelError(FusecError):
    """The model file or built-in model is unusable (unreadable, unsupported op, bad data)."""


class InputError(FusecError, ValueError):
    """The caller's inputs, shapes or options do not fit the model; the message names which."""
