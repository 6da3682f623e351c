"""Parse the ``--shapes`` option: ``"input_ids:8x128,attention_mask:8x128"``.

The result maps each named graph input to a static shape. Whether the names and ranks fit a model
is checked where the model is loaded (``fusec.loader``); this module only checks the text.
"""

from __future__ import annotations

import re

from fusec.errors import InputError

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
        out[name] = tuple(dims)
    return out


def format_shape(shape: tuple[int, ...]) -> str:
    """The inverse of one entry's dims: ``(8, 128)`` -> ``"8x128"``."""
    return "x".join(str(d) for d in shape)
