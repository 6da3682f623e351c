"""``fusec explain MODEL``: what the pattern and fusion passes did to each layer, and why not.

Runs the optimizer and prints, per transformer layer, the kernels the fused graph will launch,
every fusion candidate that was rejected or left as a candidate (with its reason: illegal, not one
kernel the codegen can emit -- its capability query's answer --, or not profitable), and every near
match a pattern matcher declined (``PassOptions.decline``: pattern, node, one-line reason).
Layers are told apart by the layer number in node or weight names (``layers.3``, ``h.3``, ...);
anything without one is listed under "model".
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fusec.cli._common import (add_command, add_fusion_arguments, add_json_flag, add_model_arguments, check_fusion_names,
                               fmt_name, load_model)

_GLOBAL = "model"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "explain", "per layer: recognized patterns, kernels, and why a pattern or fusion was declined",
        "Optimize MODEL and explain the result layer by layer: the kernels each layer launches,\n"
        "fusion candidates that were rejected or left as candidates (with the reason), and the near\n"
        "matches a pattern pass declined (attention, norms, GELU, RoPE ...) with a one-line reason.\n"
        "--disable-fusion/--enable-fusion RULE flip fusion rules (the same flags as compile and run)\n"
        "to see what changes.",
        ["fusec explain gpt2-tiny", "fusec explain llama-tiny --enable-fusion mlp --json",
         "fusec explain model.onnx --shapes input_ids:1x128,attention_mask:1x128"])
    add_model_arguments(p)
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp16",
                   help="storage dtype of the plan explained (default fp16, as compile)")
    add_json_flag(p)
    # --disable/--enable: the old spellings, hidden (deprecated) aliases of the shared flags
    add_fusion_arguments(p, deprecated_aliases=True)
    p.add_argument("--all", action="store_true", help="also list applied fusions, not only the declined ones")
    return p


def explain(graph: Any, disabled: list[str] = (), enabled: list[str] = (), show_applied: bool = False,
            dtype: str = "fp16") -> dict[str, Any]:  # type: ignore[assignment]
    """The JSON-able explanation of optimizing ``graph`` (see the module docstring)."""
    from fusec.errors import InputError
    from fusec.ir import Node
    from fusec.passes.fusion import describe_kernels, records
    from fusec.passes.fusion_rules import RULES
    from fusec.passes.match import Ctx, layer_of_name
    from fusec.passes.views import view_of

    unknown = sorted((set(disabled) | set(enabled)) - set(RULES))
    if unknown:
        raise InputError(f"unknown fusion rule(s) {', '.join(unknown)} (known: {', '.join(RULES)})")
    from fusec.codegen.compile import default_arch
    from fusec.compiler import stage

    # the one staging path `fusec compile` and `inspect` take (same default dtype), lowered as a dry run
    st = stage(graph, dtype, default_arch(), disabled_fusions=disabled, enabled_fusions=enabled, dry_run=True)
    g, opts = st.graph, st.options
    layers: dict[str, dict[str, list[Any]]] = {}

    def slot(layer: str | None) -> dict[str, list[Any]]:
        return layers.setdefault(layer or _GLOBAL, {"kernels": [], "fusions": [], "declined": []})

    ctx = Ctx(g)
    kernels = describe_kernels(g)
    launches: list[Node] = [n for n in g.nodes if view_of(n) is None]
    for n, text in zip(launches, kernels):
        sel = getattr(n, "kernel", None)  # kernel selection's record: a product's back end, the spec parameters
        # the back end where it had alternatives, or where it is not the family's namesake (a gated unit's fusec_gemm)
        variant = f" [{sel.variant}]" if sel is not None and sel.variant and (sel.key or sel.variant != sel.family) \
            else ""
        params = getattr(sel, "params", ())
        slot(ctx.layer(n))["kernels"].append(text + variant
                                             + (f" ({', '.join(f'{k} {v}' for k, v in params)})" if params else ""))
    for rec in records(g):
        if show_applied or not rec.applied:
            slot(rec.layer)["fusions"].append({"rule": rec.rule, "decision": rec.decision.value, "legal": rec.legal,
                                               "reason": rec.reason, "members": list(rec.members)})
    for pattern, where, reason in opts.declines:
        slot(layer_of_name(where.split(":", 1)[0]) if ":" in where else None)["declined"].append(
            {"pattern": pattern, "where": where, "reason": reason})
    return {"graph": g.name, "patterns": g.meta.get("patterns", {}), "kernels": g.meta.get("kernels"),
            "launches": st.lowered.report["launches"],
            "transposes_cached": g.meta.get("transposes_cached"), "gemms_merged": g.meta.get("gemms_merged"),
            "transposes_flagged": g.meta.get("transposes_flagged", 0), "gemms_padded": g.meta.get("gemms_padded", 0),
            "layers": dict(sorted(layers.items(), key=lambda kv: _layer_key(kv[0])))}


def _layer_key(name: str) -> tuple[int, int, str]:
    if name == _GLOBAL:
        return (0, 0, name)
    num = name.rsplit(".", 1)[-1]
    return (1, int(num) if num.isdigit() else 0, name)


def render_text(report: dict[str, Any]) -> str:
    pats = ", ".join(f"{k} {v}" for k, v in report["patterns"].items())
    lines = [f"graph    {fmt_name(report['graph'])}", f"patterns {pats}",
             f"kernels  {report['kernels']} fused nodes and ops, {report['launches']} launches (a cuBLAS GEMM and its "
             f"epilogue are two; transposes cached {report['transposes_cached']}, "
             f"read with trans_b {report.get('transposes_flagged', 0)}, gemms merged {report['gemms_merged']}, "
             f"N padded {report.get('gemms_padded', 0)})"]
    for layer, info in report["layers"].items():
        lines.append(f"{fmt_name(layer)}:")
        lines.append(f"  kernels ({len(info['kernels'])}): " + "; ".join(info["kernels"]))
        for f in info["fusions"]:
            lines.append(f"  fusion {f['rule']} {f['decision']}: {json.dumps(f['reason'])} "
                         f"[{', '.join(fmt_name(m) for m in f['members'][:8])}{' ...' if len(f['members']) > 8 else ''}]")
        for d in info["declined"]:
            lines.append(f"  declined {d['pattern']} at {fmt_name(d['where'])}: {json.dumps(d['reason'])}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    check_fusion_names(args)
    report = explain(load_model(args), args.disable_fusion, args.enable_fusion, args.all, args.dtype)
    report = {"model": args.model, **report}
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=True))
    else:
        print(render_text(report))
    return 0
