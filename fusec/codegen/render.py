"""Rendering of the CUDA templates: one Jinja environment and the typed values it may receive.

A template receives only values fusec made: identifiers checked by a regex (``Ident``), C types
from an allow-list (``CType``), checked ints, floats formatted by fusec (``FloatLit``), and code
fusec emitted from its own op table (``CCode``). ``render`` walks the context and refuses
anything else, in particular a plain ``str``, so no string from a model file (node names,
attribute strings) can reach generated source.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

from fusec.dtypes import DType

_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def _templates_dir() -> Path:
    # Installed wheels carry the templates as package data of fusec.templates; an editable
    # checkout has them at the top level. Both resolve through the package itself.
    try:
        import fusec.templates as t

        return Path(t.__file__).resolve().parent
    except ImportError:  # a plain checkout on sys.path without installing: templates/ at the top
        return Path(__file__).resolve().parents[2] / "templates"


class Ident(str):
    """A C identifier fusec generated; the constructor checks it."""

    def __new__(cls, text: str) -> Ident:
        if not isinstance(text, str) or not _IDENT_RE.match(text):
            raise ValueError(f"not a valid generated identifier: {text!r}")
        return super().__new__(cls, text)


class CType(str):
    """A C type name from the allow-list; build with ``ctype(dtype)``."""


class FloatLit(str):
    """A finite fp32 literal such as ``1e-05f``; build with ``float_lit(x)``."""


class CCode(str):
    """Code fusec emitted from its own tables (expression lines); never built from model strings."""


# Half and bfloat16 are fusec's own 2-byte structs (templates/common.cuh), not cuda_fp16.h's types:
# the generated source then needs no CUDA headers, compiles wherever libnvrtc is, and the cache key
# (source, options, arch, NVRTC version) fully determines the binary.
_CTYPES: dict[DType, str] = {
    DType.F32: "float",
    DType.F16: "fc_half",
    DType.BF16: "fc_bf16",
    DType.I64: "long long",
    DType.I32: "int",
    DType.BOOL: "bool",
}

# The type expressions compute in: fp16/bf16 compute in fp32 and round on store.
_COMPUTE: dict[DType, str] = {
    DType.F32: "float", DType.F16: "float", DType.BF16: "float",
    DType.I64: "long long", DType.I32: "int", DType.BOOL: "bool",
}


def ctype(dt: DType) -> CType:
    if not isinstance(dt, DType) or dt not in _CTYPES:
        raise ValueError(f"dtype {dt!r} is not allowed in generated code")
    return CType(_CTYPES[dt])


def compute_ctype(dt: DType) -> CType:
    if not isinstance(dt, DType) or dt not in _COMPUTE:
        raise ValueError(f"dtype {dt!r} is not allowed in generated code")
    return CType(_COMPUTE[dt])


def cint(v: Any, lo: int | None = None, hi: int | None = None, what: str = "value") -> int:
    """A checked Python int (bools and numpy scalars of other kinds are refused)."""
    if isinstance(v, bool) or not isinstance(v, int):
        try:
            import numpy as np

            if isinstance(v, np.integer):
                v = int(v)
            else:
                raise TypeError
        except TypeError:
            raise ValueError(f"{what} must be an int, got {type(v).__name__}") from None
    if lo is not None and v < lo:
        raise ValueError(f"{what} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{what} must be <= {hi}, got {v}")
    return int(v)


def float_lit(x: Any, what: str = "float") -> FloatLit:
    """``repr(float(x)) + 'f'``, refused unless finite and representable in fp32."""
    f = float(x)
    if not math.isfinite(f) or abs(f) > 3.4028234663852886e38:
        raise ValueError(f"{what} must be a finite fp32 value, got {x!r}")
    r = repr(f)
    if "e" not in r and "." not in r:
        r += ".0"
    return FloatLit(r + "f")


def _check(value: Any, path: str) -> None:
    if value is None or type(value) in (bool, int, Ident, CType, FloatLit, CCode):
        return
    if isinstance(value, (tuple, list)):
        for i, x in enumerate(value):
            _check(x, f"{path}[{i}]")
        return
    if isinstance(value, Mapping):
        for k, x in value.items():
            Ident(k)
            _check(x, f"{path}.{k}")
        return
    if getattr(value, "__fusec_template_safe__", False):  # frozen records whose fields are checked leaves
        for k in value.__dataclass_fields__:
            _check(getattr(value, k), f"{path}.{k}")
        return
    raise TypeError(f"template variable {path} has type {type(value).__name__}; templates take only "
                    "Ident, CType, FloatLit, CCode, int, bool and containers of them")


def _make_env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        keep_trailing_newline=True,
    )


def _include_cuh(name: str) -> str:
    """Paste a helper header verbatim (not rendered: C++ braces must not be read as Jinja)."""
    if not re.match(r"^[a-z_]+\.cuh$", name):
        raise ValueError(f"bad helper header name {name!r}")
    return f"// ---- {name} ----\n" + (_templates_dir() / name).read_text() + f"// ---- end {name} ----\n"


_ENV = _make_env()
_ENV.globals["include_cuh"] = _include_cuh


def render(template: str, **ctx: Any) -> str:
    """Render ``templates/<template>`` after checking every context value (see module doc)."""
    if not _IDENT_RE.match(template.replace(".cu.jinja", "").replace(".", "_")):
        raise ValueError(f"bad template name {template!r}")
    for k, v in ctx.items():
        Ident(k)
        _check(v, k)
    return _ENV.get_template(template).render(**ctx)

