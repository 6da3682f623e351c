"""``fusec explain MODEL``: what the pattern and fusion passes did to each layer, and why not.

Runs the optimizer and prints, per transformer layer, the kernels the fused graph will launch,
every fusion candidate that was rejected or left as a candidate (with its reason: illegal, not one
kernel the codegen can emit -- its capability query's answer --, or not profitable), and every near
match a pattern matcher declined (``PassOptions.decline``: pattern, node, one-line reason).
Layers are told apart by the layer number in node or weight names (``layers.3``, ``h.3``, ...);
anything without one is listed under "model". With ``--generate``, one entry of the generation plan
``fusec compile MODEL --generate`` makes (``--entry``: the decode step by default, prefill, admit, join),
with the same sizes and options; each kernel shows kernel selection's record (the decode attention's
splits and merge, a skinny product's form, ...).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fusec.cli._common import (
    add_command,
    add_fusion_arguments,
    add_json_flag,
    add_model_arguments,
    check_fusion_names,
    fmt_name,
    load_model,
)
from fusec.errors import InputError

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
         "fusec explain model.onnx --shapes input_ids:1x128,attention_mask:1x128",
         "fusec explain qwen3-0.6b --generate --batch 8 --max-seq-len 1024"])
    add_model_arguments(p)
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None,
                   help="storage dtype of the plan explained (default fp16, bf16 with --generate: as compile)")
    from fusec.cli.generate import add_generation_arguments

    add_generation_arguments(p, for_compile=True)
    p.add_argument("--entry", choices=("decode", "prefill", "admit", "join"), default="decode",
                   help="with --generate: the entry point explained (default decode; admit and join need "
                        "--admit-batch and --join)")
    add_json_flag(p)
    # --disable/--enable: the old spellings, hidden (deprecated) aliases of the shared flags
    add_fusion_arguments(p, deprecated_aliases=True)
    p.add_argument("--all", action="store_true", help="also list applied fusions, not only the declined ones")
    return p


def explain(graph: Any, disabled: list[str] = (), enabled: list[str] = (), show_applied: bool = False,
            dtype: str = "fp16", weights_nk: bool = False) -> dict[str, Any]:  # type: ignore[assignment]
    """The JSON-able explanation of optimizing ``graph`` (see the module docstring); ``weights_nk``: as a
    generation plan's entries are staged (``compile_generation``)."""
    from fusec.ir import Node
    from fusec.passes.fusion import describe_kernels, records
    from fusec.passes.fusion_rules import RULES
    from fusec.passes.match import Ctx, layer_of_name
    from fusec.passes.views import view_of

    unknown = sorted((set(disabled) | set(enabled)) - set(RULES))
    if unknown:
        raise InputError(f"unknown fusion rule(s) {', '.join(unknown)} (known: {', '.join(RULES)})")
    from fusec.codegen.compile import default_arch
    from fusec.compiler import DTYPES, stage, state_layout

    # the one staging path `fusec compile` and `inspect` take (same default dtype, states placed as compile_entries
    # places them), lowered as a dry run
    recs, state_bytes = state_layout(graph, DTYPES[dtype][0])
    st = stage(graph, dtype, default_arch(), disabled_fusions=disabled, enabled_fusions=enabled, dry_run=True,
               weights_nk=weights_nk, state_layout={r["name"]: r["offset"] for r in recs}, sync_base=state_bytes)
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
    if args.dtype is None:
        args.dtype = "bf16" if args.generate else "fp16"  # as compile
    if args.generate:
        report = {"model": args.model, "entry": args.entry,
                  **explain(_generation_entry(args), args.disable_fusion, args.enable_fusion, args.all, args.dtype,
                            weights_nk=True)}
    else:
        from fusec.cli.compile import refuse_generation_flags

        refuse_generation_flags(args)
        report = {"model": args.model, **explain(load_model(args), args.disable_fusion, args.enable_fusion, args.all,
                                                 args.dtype)}
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=True))
    else:
        print(render_text(report))
    return 0


def _generation_entry(args: argparse.Namespace) -> Any:
    """The graph of entry ``args.entry`` of the generation plan ``compile --generate`` would make with ``args``."""
    from fusec.cli.compile import generation_setup
    from fusec.compiler import DTYPES
    from fusec.genmodel import build_graphs

    gm, sizes = generation_setup(args)
    graphs = build_graphs(gm, sizes["batch"], sizes["max_seq_len"], sizes["prefill_len"], storage=DTYPES[args.dtype][0],
                          admit_batch=sizes["admit_batch"], join=sizes["join"])
    if args.entry not in graphs:
        flag = {"admit": "--admit-batch A", "join": "--join"}[args.entry]
        raise InputError(f"the plan has no {args.entry} entry: compile it with {flag} (entries: {', '.join(graphs)})")
    return graphs[args.entry]
