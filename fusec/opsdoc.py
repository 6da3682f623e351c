"""Generate docs/OPS.md, the published list of what fusec supports, from the tables themselves:
the ONNX importer's handler registry, opset range and element types, and the IR's op table
(``fusec.ops.OP_INFO``: fusion kind, arity, and the dtypes its shape/dtype rule accepts, found by
asking the rule). Nothing here is written by hand, so the page cannot drift from the code; a CPU
test (tests/test_opsdoc.py) fails when the committed page differs from this output.

    python -m fusec.opsdoc > docs/OPS.md
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

REGENERATE = "python -m fusec.opsdoc > docs/OPS.md"
_PROBE_SHAPE = (4,)


def _frontend_modules() -> list[Any]:
    """The importer's modules: those ``fusec.frontend.onnx_import`` loads (it imports every
    handler module), in name order."""
    import fusec.frontend.onnx_import  # noqa: F401

    return [sys.modules[n] for n in sorted(sys.modules) if n.startswith("fusec.frontend.")]


def _onnx_to_ir(mods: Iterable[Any]) -> tuple[dict[str, set[str]], set[str]]:
    """{ONNX op: IR op names} from the importer's module-level tables (dicts of ONNX op name to
    ``Op``), and the ONNX ops listed in its fold-only tables (names with FOLD in them)."""
    from fusec.ops import Op

    maps: dict[str, set[str]] = {}
    folded: set[str] = set()
    for mod in mods:
        for attr, table in sorted(vars(mod).items()):
            if not attr.isupper() and not attr.lstrip("_").isupper():
                continue
            if isinstance(table, dict) and table and all(isinstance(k, str) for k in table):
                if "FOLD" in attr.upper():
                    folded.update(table)
                elif all(isinstance(v, Op) for v in table.values()):
                    for k, v in table.items():
                        maps.setdefault(k, set()).add(v.value)
            elif isinstance(table, (set, frozenset, tuple)) and "FOLD" in attr.upper() \
                    and all(isinstance(k, str) for k in table):
                folded.update(table)
    return maps, folded


def _probe_dtypes(op: Any) -> list[str] | None:
    """The dtypes op's rule accepts for same-shape inputs of one dtype (a leading bool condition
    tried too), or None when the op's attributes or signature cannot be probed that way."""
    from fusec.dtypes import DType
    from fusec.ops import OP_INFO, infer

    from fusec.ops import FusionKind

    info = OP_INFO[op]
    lo, hi = info.arity
    if lo < 1 or (hi >= 0 and hi != lo) or lo > 3:
        return None
    if lo > 1 and info.kind not in (FusionKind.ELEMENTWISE, FusionKind.BROADCAST):
        return None  # inputs of different roles (data, indices): one dtype for all says nothing
    attrs = _probe_attrs(info.attrs)
    if attrs is None:
        return None
    ok = []
    for dt in DType:
        for first in (dt, DType.BOOL) if lo > 1 else (dt,):  # a leading condition: where(cond, a, b)
            types = [(_PROBE_SHAPE, first)] + [(_PROBE_SHAPE, dt)] * (lo - 1)
            try:
                infer(op, attrs, types)
            except Exception:  # the rule says no: not accepted
                continue
            ok.append(dt.value)
            break
    return ok or None


def _probe_attrs(cls: type) -> Any:
    """An attribute record for a 1-D probe input of 4 elements: required fields by their name
    (axis 0, a shape of (4,), ...); None when a required field is not one of these."""
    import dataclasses

    from fusec.dtypes import DType

    known = {"axes": (0,), "axis": 0, "k": 1, "shape": _PROBE_SHAPE, "perm": (0,), "starts": (0,), "ends": (4,),
             "steps": (1,), "repeats": (1,), "upper": True, "left": True, "to": DType.F32}
    kw = {}
    for f in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ():
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if f.name not in known:
                return None
            kw[f.name] = known[f.name]
    try:
        return cls(**kw)
    except (TypeError, ValueError):
        return None


def _row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def render() -> str:
    """The whole page, deterministic for a given fusec and onnx."""
    import onnx

    from fusec.compiler import DTYPES as PLAN_DTYPES
    from fusec.dtypes import DType
    from fusec.frontend.onnx_ctx import DOMAIN_HANDLERS, HANDLERS
    from fusec.frontend.onnx_import import MIN_OPSET
    from fusec.frontend.onnx_load import ONNX_TO_DTYPE
    from fusec.ops import OP_INFO
    from fusec.plancheck_fields import DTYPES as PLAN_TENSOR_DTYPES

    mods = _frontend_modules()
    maps, folded = _onnx_to_ir(mods)
    top = onnx.defs.onnx_opset_version()
    onnx_types = sorted((onnx.helper.tensor_dtype_to_string(k).removeprefix("TensorProto."), v.value)
                        for k, v in ONNX_TO_DTYPE.items())
    lines = [
        "# Supported ops, opsets and dtypes",
        "",
        f"Generated from fusec's tables by `{REGENERATE}`; do not edit by hand",
        "(tests/test_opsdoc.py checks that this page is what the generator prints).",
        "",
        "## ONNX import",
        "",
        f"- Opsets: the default domain (`ai.onnx`), opset {MIN_OPSET} to {top} (the newest the installed",
        "  `onnx` package defines). Of other domains: "
        + ", ".join(f"`{d}` `{t}`" for d, t in sorted(DOMAIN_HANDLERS)) + "; the rest are refused, naming the node.",
        "- Element types of inputs, outputs and initializers (ONNX type -> fusec dtype): "
        + ", ".join(f"{a} -> {b}" for a, b in onnx_types) + ".",
        f"- {len(HANDLERS)} ONNX ops. \"IR ops\" is what an op becomes when the importer's tables say so",
        "  (others are decomposed by their handler into the IR ops below)"
        + ("; \"constants only\" ops are folded at import and refused when they read run-time data." if folded
           else "."),
        "",
        _row(("ONNX op", "IR ops") + (("note",) if folded else ())),
        _row(("---", "---") + (("---",) if folded else ())),
    ]
    for name in sorted(HANDLERS):
        ir = ", ".join(f"`{x}`" for x in sorted(maps.get(name, ()))) or "-"
        note = ("constants only" if name in folded else "",) if folded else ()
        lines.append(_row((f"`{name}`", ir) + note))
    lines += [
        "",
        "## IR ops",
        "",
        f"{len(OP_INFO)} ops in one closed vocabulary (`fusec.ops.Op`). Kind: what fusion may assume",
        "(TVM's pattern kinds). Dtypes: what the op's shape/dtype rule accepts for inputs of one dtype",
        "(\"-\": the rule needs a specific signature; see `fusec/ops.py`). A compiled plan's inputs,",
        "outputs and state are limited to the plan tensor dtypes below.",
        "",
        _row(("op", "kind", "inputs", "dtypes")),
        _row(("---", "---", "---", "---")),
    ]
    for op, info in OP_INFO.items():
        lo, hi = info.arity
        arity = str(lo) if lo == hi else f"{lo}..{hi if hi >= 0 else 'n'}"
        dts = _probe_dtypes(op)
        lines.append(_row((f"`{op.value}`", info.kind.name.lower(), arity, ", ".join(dts) if dts else "-")))
    lines += [
        "",
        "## Dtypes",
        "",
        "- IR dtypes: " + ", ".join(d.value for d in DType) + ".",
        "- Plan tensors (inputs, outputs, state of a compiled plan): " + ", ".join(PLAN_TENSOR_DTYPES) + ".",
        "- Plan precision (`--dtype`): " + ", ".join(f"{k} (storage {s}, matrix products {c})"
                                                   for k, (s, c) in PLAN_DTYPES.items()) + ".",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
