"""The text form of ``fusec inspect``: the report dict (the same one ``--json`` prints) laid out
for people: readable byte counts (KiB/MiB/GiB), aligned tables, and the sections the README
promises: op histograms (imported and optimized), recognized patterns, fusion decisions, kernel
count, the memory plan (naive / planned / lower bound); for a plan also its source, toolchain and
kernels with their launch configurations. Names from model files go through ``fmt_name``, and
every other string a plan holds is printed escaped too (``one_line``: a plan's report is checked for
types, not for terminal escapes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fusec.cli import one_line
from fusec.cli._common import fmt_name
from fusec.runtime.guard import fmt_bytes

# Keys the model renderer lays out itself; any other key is rendered generically.
CORE_KEYS = ("model", "graph", "inputs", "outputs", "parameters", "weights_bytes", "constants", "nodes", "ops",
             "imported_ops", "fusions", "patterns", "memory", "kernels", "kernels_by_kind", "meta", "lowering",
             "transposes_cached", "transposes_flagged", "gemms_merged", "gemms_padded", "weights_relaid", "views",
             "weights", "quantized")


def table(rows: Sequence[Sequence[Any]], header: Sequence[str] | None = None, indent: int = 2,
          right: Sequence[int] = ()) -> list[str]:
    """Rows as lines with aligned columns (``right``: column indexes aligned to the right)."""
    cells = [[str(c) for c in r] for r in ([list(header)] if header else []) + [list(r) for r in rows]]
    if not cells:
        return []
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(max(len(r) for r in cells))]
    out = []
    for r in cells:
        parts = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)]
        out.append((" " * indent + "  ".join(parts)).rstrip())
    return out


def _shape(v: Mapping[str, Any]) -> str:
    return f"{v['dtype']}[{','.join(str(d) for d in v['shape'])}]"


def signature_lines(report: Mapping[str, Any]) -> list[str]:
    """The inputs and outputs, one aligned row each, names printed safely."""
    lines = []
    for key in ("inputs", "outputs"):
        lines.append(f"{key}:")
        lines.extend(table([(fmt_name(v["name"]), _shape(v)) for v in report[key]]))
    return lines


def _ops_lines(ops: Mapping[str, int], imported: Mapping[str, int] | None, nodes: Any) -> list[str]:
    if imported is None:
        lines = [f"ops ({nodes} nodes):"]
        lines.extend(table([(fmt_name(str(k)), v) for k, v in ops.items()], right=(1,)))
        return lines
    names = list(imported) + [k for k in ops if k not in imported]
    lines = [f"ops (imported {sum(imported.values())} nodes -> optimized {nodes}):"]
    lines.extend(table([(fmt_name(str(k)), imported.get(k, 0) or "-", ops.get(k, 0) or "-") for k in names],
                       header=("op", "imported", "optimized"), right=(1, 2)))
    return lines


def _patterns_lines(patterns: Mapping[str, int]) -> list[str]:
    found = {k: v for k, v in patterns.items() if v}
    if not found:
        return ["patterns    none recognized"]
    return ["patterns    " + ", ".join(f"{fmt_name(str(k))} {one_line(str(v))}" for k, v in found.items())]


def _fusion_lines(fusions: Sequence[Mapping[str, Any]]) -> list[str]:
    applied = sum(1 for f in fusions if f.get("decision") == "applied")
    lines = [f"fusion decisions ({applied} applied, {len(fusions) - applied} rejected):"]
    rows = []
    for f in fusions:
        members = f.get("members") or []
        where = fmt_name(str(f["layer"])) if f.get("layer") else "-"
        rows.append((one_line(str(f.get("rule") or f.get("kind") or "-")), one_line(str(f.get("decision", "-"))),
                     where, len(members), one_line(str(f.get("reason") or ""))))
    lines.extend(table(rows, header=("rule", "decision", "layer", "ops", "reason"), right=(3,)))
    return lines


def _memory_lines(mem: Mapping[str, Any]) -> list[str]:
    parts = [f"{k.removesuffix('_bytes')} {fmt_bytes(mem[k])}" for k in ("arena_bytes", "weights_bytes",
                                                                            "state_bytes", "scratch_bytes")
             if k in mem and (mem[k] or k in ("arena_bytes", "weights_bytes"))]
    lines = ["memory      " + ", ".join(parts)] if parts else []
    if "planned_bytes" in mem:
        lines.append(f"memory plan naive {fmt_bytes(mem.get('naive_bytes', 0))} -> planned "
                     f"{fmt_bytes(mem['planned_bytes'])} (lower bound {fmt_bytes(mem.get('lower_bound_bytes', 0))})")
    return lines


def _kernel_lines(kernels: Sequence[Mapping[str, Any]], compiled: int | None, by_kind: Mapping[str, int] | None) -> list[str]:
    head = f"kernels     {len(kernels)} launches per run"
    if compiled is not None:
        head += f", {compiled} compiled kernels"
    lines = [head]
    if by_kind:
        lines.append("  by kind: " + ", ".join(f"{fmt_name(str(k))} {v}" for k, v in by_kind.items()))
    rows = []
    for i, k in enumerate(kernels):
        if "grid" in k:
            geo = f"grid {k['grid']} block {k['block']} smem {fmt_bytes(k['smem'])}"
        else:
            geo = f"m={k['m']} n={k['n']} k={k['k']} batch={k['batch']}"
        rows.append((i, k.get("label", ""), k["name"], geo))
    lines.extend(table(rows, header=("#", "label", "kernel", "launch"), right=(0,)))
    return lines


def weights_lines(w: Mapping[str, Any] | None, quantized: Mapping[str, Any] | None = None) -> list[str]:
    """Weight formats (``fusec.weight_report``): a summary per format, then one row per tensor."""
    if not w:
        return []
    lines = [f"weights read per step {fmt_bytes(int(w.get('step_bytes', 0)))} (every weight once, embedding rows only)"]
    if quantized and quantized.get("products"):
        lines.append(f"quantized   {quantized['products']} products with --quantize {one_line(str(quantized['method']))}"
                     + (f" (group {quantized['group']})" if quantized.get("group") else ""))
    elif quantized and quantized.get("method"):  # asked for, and nothing fit: say so, with the pass's reasons
        kept = quantized.get("kept") or {}
        why = "; ".join(f"{n} kept: {one_line(str(r))}" for r, n in kept.items()) or "no product over a constant weight"
        lines.append(f"quantized   no product with --quantize {one_line(str(quantized['method']))} ({why})")
    rows = [(one_line(str(f)), s["tensors"], f"{s['weights']:,}", fmt_bytes(int(s["bytes"])),
             f"{8 * s['bytes'] / max(1, s['weights']):.2f}") for f, s in (w.get("by_format") or {}).items()]
    lines.append("weight formats:")
    lines.extend(table(rows, header=("format", "tensors", "weights", "bytes", "bits/weight"), right=(1, 2, 3, 4)))
    rows = [(fmt_name(str(t["name"])), one_line(str(t["format"])) + (" (embedding)" if t.get("embedding") else ""),
             "x".join(str(d) for d in t["shape"]), fmt_bytes(int(t["bytes"])), t["bits_per_weight"])
            for t in w.get("tensors") or []]
    lines.extend(table(rows, header=("tensor", "format", "shape", "bytes", "bits/weight"), right=(3, 4)))
    return lines


def _report_lines(rep: Mapping[str, Any]) -> list[str]:
    """The compiler's report stored in a plan: optimized ops, patterns, fusion decisions, weights."""
    lines = weights_lines(rep.get("weights"), rep.get("quantized"))
    if rep.get("ops"):
        lines.extend(_ops_lines(rep["ops"], None, rep.get("nodes", sum(rep["ops"].values()))))
    if "patterns" in rep:
        lines.extend(_patterns_lines(rep["patterns"]))
    if rep.get("fusions") is not None:
        lines.extend(_fusion_lines(rep["fusions"]))
    return lines


def _source_line(src: Mapping[str, Any] | None) -> list[str]:
    if not src:
        return []
    text = fmt_name(str(src["model"])) if src.get("model") else "(in memory)"
    kind = {"builtin": "built-in", "file": "file"}.get(str(src.get("kind")), src.get("kind"))
    if kind:
        text += f" ({kind}"
        text += f", sha256 {src['sha256'][:16]}...)" if src.get("sha256") else ")"
    if src.get("shapes"):
        text += "  shapes " + ",".join(f"{fmt_name(k)}:{'x'.join(map(str, v))}" for k, v in src["shapes"].items())
    return [f"source      {text}"]


def render_plan(report: Mapping[str, Any]) -> str:
    """``fusec inspect PLAN``: a one- or multi-entry plan."""
    lines = [f"plan        {fmt_name(report['model'])}"]
    lines.extend(_source_line(report.get("source")))
    lines.append(f"arch        {report['arch']}   dtype {report['dtype']}   fusec {report.get('fusec_version')}"
                 + ("   cuda-graph" if report.get("cuda_graph") else ""))
    lines.append(f"toolchain   NVRTC {report.get('nvrtc_version', '?')}, CuPy {report.get('cupy_version', '?')}, "
                 f"driver {report.get('driver_version', '?')} (at compile)")
    lines.extend(_memory_lines(report["memory"]))
    if "entries" in report:
        for name, e in report["entries"].items():
            lines.append(f"entry {name}:")
            lines.extend("  " + ln for ln in signature_lines(e))
            lines.extend("  " + ln for ln in _kernel_lines(e["kernels"], None, None))
        return "\n".join(lines)
    lines.extend(signature_lines(report))
    rep = report.get("report") or {}
    lines.extend(_report_lines(rep))
    low = rep.get("lowering") or {}
    lines.extend(_kernel_lines(report["kernels"], low.get("kernels_compiled"), low.get("by_template")))
    return "\n".join(lines)


def render_text(report: Mapping[str, Any]) -> str:
    """``fusec inspect MODEL``: the model as imported and what compiling it makes of it."""
    lines = [f"model       {fmt_name(report['model'])}",
             f"graph       {fmt_name(report['graph'])}",
             f"parameters  {report['parameters']:,}",
             f"weights     {fmt_bytes(report['weights_bytes'])} ({report['weights_bytes']:,} bytes in "
             f"{report['constants']} constants)"]
    lines.extend(signature_lines(report))
    lines.extend(_ops_lines(report["ops"], report.get("imported_ops"), report["nodes"]))
    if "patterns" in report:
        lines.extend(_patterns_lines(report["patterns"]))
    if report.get("fusions") is not None:
        lines.extend(_fusion_lines(report["fusions"]))
    if "kernels" in report:
        kinds = report.get("kernels_by_kind") or {}
        lines.append(f"kernels     {report['kernels']} launches per run"
                     + (" (" + ", ".join(f"{fmt_name(str(k))} {v}" for k, v in kinds.items()) + ")" if kinds else ""))
    if "memory" in report:
        mem = report["memory"]
        lines.append(f"memory plan naive {fmt_bytes(mem.get('naive_bytes', 0))} -> planned "
                     f"{fmt_bytes(mem.get('planned_bytes', 0))} (lower bound {fmt_bytes(mem.get('lower_bound_bytes', 0))})")
    layout = {k: report[k] for k in ("transposes_cached", "transposes_flagged", "gemms_merged", "gemms_padded", "views")
              if k in report}
    if layout:
        lines.append("layout      " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in layout.items()))
    lines.extend(weights_lines(report.get("weights"), report.get("quantized")))
    for key, value in report.items():
        if key not in CORE_KEYS:
            lines.extend(render_extra(key, value, 0))
    return "\n".join(lines)


def render_extra(key: str, value: Any, depth: int) -> list[str]:
    pad = "  " * depth
    if isinstance(value, dict) and value:
        out = [f"{pad}{fmt_name(str(key))}:"]
        for k, v in value.items():
            out.extend(render_extra(str(k), v, depth + 1))
        return out
    # scalars and lists on one line, JSON-escaped so nothing from a model file can break it
    text = value if isinstance(value, (int, float)) and not isinstance(value, bool) else json.dumps(value, default=str)
    return [f"{pad}{fmt_name(str(key))}: {text}"]
