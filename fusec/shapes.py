"""Parse the ``--shapes`` option: ``"input_ids:8x128,attention_mask:8x128"``.

The result maps each named graph input to a static shape. Whether the names and ranks fit a model
is checked where the model is loaded (``fusec.loader``); this module only checks the text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fusec.errors import InputError

# Size limits, checked before anything is allocated (a hostile model or a typo in --shapes must be a
# one-line error, not a numpy MemoryError). Raise them with the environment variables.
MAX_ELEMENTS_ENV = "FUSEC_MAX_ELEMENTS"
DEFAULT_MAX_ELEMENTS = 2**32  # per tensor
MAX_BYTES_ENV = "FUSEC_MAX_BYTES"
DEFAULT_MAX_BYTES = 2**36  # per tensor, and per file read into memory (64 GiB)


def _env_limit(name: str, default: int) -> int:
    from fusec import knobs

    text = (knobs.raw(name) or "").strip()
    if not text:
        return default
    try:
        value = int(float(text)) if ("e" in text.lower() or "." in text) else int(text)
    except (ValueError, OverflowError):
        raise InputError(f"environment variable {name}={text!r} is not a number") from None
    if value <= 0:
        raise InputError(f"environment variable {name}={text!r} must be positive")
    return value


def max_elements() -> int:
    """The largest tensor (in elements) fusec creates or accepts: ``$FUSEC_MAX_ELEMENTS``, default 2**32."""
    return _env_limit(MAX_ELEMENTS_ENV, DEFAULT_MAX_ELEMENTS)


def max_bytes() -> int:
    """The largest tensor or file (in bytes) fusec reads into memory: ``$FUSEC_MAX_BYTES``, default 64 GiB."""
    return _env_limit(MAX_BYTES_ENV, DEFAULT_MAX_BYTES)


def check_size(shape: Sequence[int], what: str, itemsize: int = 1) -> int:
    """The element count of ``shape``; InputError naming ``what`` when it passes a limit."""
    n = math.prod(int(d) for d in shape)
    if n > max_elements():
        raise InputError(f"{what} has {n} elements (shape {list(shape)}), more than the limit {max_elements()} "
                         f"(set {MAX_ELEMENTS_ENV} to raise it)")
    if n * itemsize > max_bytes():
        raise InputError(f"{what} needs {n * itemsize} bytes (shape {list(shape)}), more than the limit "
                         f"{max_bytes()} (set {MAX_BYTES_ENV} to raise it)")
    return n


def normalize_shapes(shapes: Mapping[str, Any] | None, allow_zero: bool = False) -> dict[str, tuple[int, ...]] | None:
    """API shapes ({name: dims}) as {str: tuple of positive ints}; anything else (1.5, "8",
    True, a negative dim, a huge product) is an InputError naming the input, never truncated.
    ``allow_zero``: let 0 through (the ONNX importer accepts it where the model fixes that dim at 0)."""
    if shapes is None:
        return None
    if not isinstance(shapes, Mapping):
        raise InputError(f"shapes must map input names to dims, got {type(shapes).__name__}")
    out: dict[str, tuple[int, ...]] = {}
    for name, dims in shapes.items():
        if not isinstance(name, str):
            raise InputError(f"shapes: input name {name!r} is not a string")
        if isinstance(dims, (str, bytes)) or not isinstance(dims, Sequence) and not hasattr(dims, "__iter__"):
            raise InputError(f"shape of input {name!r} must be a sequence of ints, got {dims!r:.80}")
        try:
            items = list(dims)
        except TypeError:
            raise InputError(f"shape of input {name!r} must be a sequence of ints, got {dims!r:.80}") from None
        fixed = []
        for i, d in enumerate(items):
            if isinstance(d, bool) or not hasattr(d, "__index__"):
                raise InputError(f"shape of input {name!r} must be a sequence of ints, got {dims!r:.80} "
                                 f"(dim {i} is {d!r:.40}, not an integer)")
            d = int(d.__index__())
            if d < 0 or (d == 0 and not allow_zero):
                raise InputError(f"input {name!r}: dim {i} must be positive, got {d}")
            fixed.append(d)
        check_size(fixed, f"input {name!r}")
        out[name] = tuple(fixed)
    return out

_EXAMPLE = "input_ids:8x128,attention_mask:8x128"
# ASCII digits only: str.isdigit() also accepts characters such as '²' that int() rejects.
_INT = re.compile(r"[+-]?[0-9]+")


def _bad(part: str, why: str) -> InputError:
    # repr() keeps the message on one line whatever the user typed (newlines, quotes, non-ASCII).
    return InputError(f"bad --shapes entry {part!r}: {why} (expected NAME:DxDx..., e.g. {_EXAMPLE!r})")


def parse_shapes(text: str) -> dict[str, tuple[int, ...]]:
    """``"a:1x8,b:1x8"`` -> ``{"a": (1, 8), "b": (1, 8)}``.

    Entries are separated by commas; a name and its dims by the LAST colon (so names holding a
    colon, as some exporters make, still parse); dims by ``x``. A scalar input is ``name:`` (no
    dims). Malformed text, non-integer or non-positive dims and duplicate names raise InputError
    quoting the bad part.
    """
    if not text.strip():
        raise InputError(f"--shapes is empty (expected NAME:DxDx..., e.g. {_EXAMPLE!r})")
    out: dict[str, tuple[int, ...]] = {}
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            raise _bad(raw, "empty entry (stray comma?)")
        name, sep, dims_text = part.rpartition(":")
        name = name.strip()
        if not sep:
            raise _bad(part, "missing ':' between the input name and its dims")
        if not name:
            raise _bad(part, "missing input name")
        dims: list[int] = []
        dims_text = dims_text.strip().lower()  # accept 8X128 too
        for d in dims_text.split("x") if dims_text else []:
            d = d.strip()
            if not _INT.fullmatch(d):
                raise _bad(part, f"dim {d!r} is not an integer")
            n = int(d)
            if n <= 0:
                raise _bad(part, f"dim {n} is not positive")
            dims.append(n)
        if name in out:
            raise _bad(part, f"input {name!r} is given twice")
        try:
            check_size(dims, f"--shapes input {name!r}")
        except InputError as e:
            raise InputError(f"bad --shapes entry {part!r}: {e}") from None
        out[name] = tuple(dims)
    return out


def format_shape(shape: tuple[int, ...]) -> str:
    """The inverse of one entry's dims: ``(8, 128)`` -> ``"8x128"``."""
    return "x".join(str(d) for d in shape)
