"""The one ordered list of passes, the driver that runs it, and the facts ``fusec inspect`` reports.

``optimize(graph)`` runs ``PIPELINE`` in order. Before anything runs, the order is checked: a
pass's ``REQUIRES`` must all appear earlier in the list (or in ``graph.meta["passes"]``, the
record of passes an earlier ``optimize`` ran), else ``PassOrderError``. Each pass must copy
``graph.meta`` forward; the driver carries over any key a pass dropped, so records survive.

To add a pass: write ``passes/<name>.py`` (``NAME``, optional ``REQUIRES``, ``run``) and add one
line to ``PIPELINE`` in its section.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from fusec.ir import Graph, IRError, print_graph, verify
from fusec.passes import (
    constant_fold,
    cse,
    dce,
    fusion,
    memory_plan,
    merge_gemms,
    pad_gemm,
    precision,
    quantize,
    recognize_activations,
    recognize_attention,
    recognize_norms,
    recognize_rope,
    recognize_softmax,
    select_kernels,
    simplify,
    split_norms,
    split_tf32,
    transpose_cache,
    views,
)
from fusec.passes.base import PassOptions
from fusec.weight_report import weight_formats

PIPELINE: list[ModuleType] = [
    # -- canonicalization: fold, remove no-ops, merge duplicates, drop the dead
    constant_fold,
    simplify,
    cse,
    dce,
    # -- pattern recognition (attention, norms, GELU, RoPE ...)
    recognize_norms,
    recognize_activations,
    recognize_softmax,
    recognize_rope,
    recognize_attention,
    # -- weight-only quantization (PassOptions.quantize; nothing without): from the fp32 weights
    quantize,
    # -- storage precision (after recognition: high-level ops keep fp32 math inside)
    precision,
    # -- layout: weight-transpose caching (or a transpose flag), GEMM merges, N padded to 16 bytes
    transpose_cache,
    merge_gemms,
    pad_gemm,
    # -- a norm shared by skinny products that could not merge: one copy each, their prologue
    split_norms,
    # -- fp32 products with a constant weight as one 3xTF32 tensor-core GEMM (PassOptions.fp32_gemm)
    split_tf32,
    # -- fusion grouping
    fusion,
    # -- canonicalize what the rewrites left behind
    cse,
    dce,
    # -- how each node runs (family, variant, the weight layout it reads), recorded on the node:
    #    the last rewrite (the nodes the lowering reads are the ones it decided for)
    select_kernels,
    # -- execution planning: keep last (no graph rewrites after the plan)
    views,
    memory_plan,
]

# Keys passes leave in graph.meta (or options.stats) that ``report`` passes through when present.
REPORT_KEYS: tuple[str, ...] = ("patterns", "fusions", "kernels", "transposes_cached", "transposes_flagged",
                                "gemms_merged", "gemms_padded", "norms_split", "quantized", "gemms_split_tf32", "split_tf32_extra_bytes", "weights_relaid",
                                "views")


class PassOrderError(RuntimeError):
    """A pass is scheduled before a pass it requires (a bug in the pipeline list, not user input)."""


def pass_name(mod: ModuleType) -> str:
    return str(getattr(mod, "NAME", mod.__name__.rsplit(".", 1)[-1]))


def check_order(pipeline: Sequence[ModuleType], already_run: Sequence[str] = ()) -> None:
    """Raise PassOrderError naming the first pass whose REQUIRES are not met earlier in ``pipeline``."""
    seen = set(already_run)
    for i, mod in enumerate(pipeline):
        missing = [r for r in getattr(mod, "REQUIRES", ()) if r not in seen]
        if missing:
            raise PassOrderError(f"pass #{i} {pass_name(mod)!r} requires {', '.join(map(repr, missing))} "
                                 f"to run before it, but {'it has' if len(missing) == 1 else 'they have'} not")
        seen.add(pass_name(mod))


def optimize(graph: Graph, options: PassOptions | None = None, dump_dir: str | os.PathLike[str] | None = None,
             verify_each: bool = False, progress: Callable[[str, int, int], None] | None = None,
             pipeline: Sequence[ModuleType] | None = None) -> tuple[Graph, PassOptions]:
    """Run every pass of ``pipeline`` (default ``PIPELINE``) in order; returns (graph, options).

    ``dump_dir``: write ``00-input.txt`` and then ``NN-<pass>.txt`` (the printer's text) after each
    pass. ``verify_each``: run ``fusec.ir.verify`` after every pass; a failure names the pass.
    ``progress(pass_name, index, total)`` is called before each pass (index from 0).
    """
    passes = list(PIPELINE if pipeline is None else pipeline)
    options = options if options is not None else PassOptions()
    history = list(graph.meta.get("passes", []))
    check_order(passes, history)
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
        _dump(dump_dir, "00-input.txt", graph)
    for i, mod in enumerate(passes):
        name = pass_name(mod)
        if progress is not None:
            progress(name, i, len(passes))
        before = graph
        graph = mod.run(graph, options).graph
        if graph is before:  # never write records into the caller's Graph object
            graph = graph.copy()
        for k, v in before.meta.items():
            graph.meta.setdefault(k, v)
        history.append(name)
        graph.meta["passes"] = list(history)
        if verify_each:
            try:
                verify(graph)
            except IRError as e:
                raise IRError(f"after pass #{i + 1} {name!r}: {e}") from e
        if dump_dir is not None:
            _dump(dump_dir, f"{i + 1:02d}-{name}.txt", graph)
    return graph, options


def _dump(dump_dir: str | os.PathLike[str], fname: str, graph: Graph) -> None:
    with open(os.path.join(dump_dir, fname), "w", encoding="utf-8") as f:
        f.write(print_graph(graph))


def report(graph: Graph, options: PassOptions | None = None, plan: Any = None) -> dict[str, Any]:
    """JSON-able facts about an (optimized) graph for ``fusec inspect --json``.

    Always: name, node/constant counts, parameters, the op histogram, and memory numbers (planned
    now, so they describe this graph). Any ``REPORT_KEYS`` found in ``graph.meta`` (first) or
    ``options.stats`` are passed through; passes extend the report by recording those keys.
    """
    stats = options.stats if options is not None else {}
    if plan is None:  # callers that already planned this graph pass their plan
        plan = memory_plan.plan_memory(graph)
    out: dict[str, Any] = {
        "name": graph.name,
        "nodes": len(graph.nodes),
        "constants": len(graph.constants),
        "parameters": graph.num_parameters,
        "ops": graph.op_histogram(),
        "memory": plan.summary(),
        "weights": weight_formats(graph),  # per tensor: format, bytes; and the bytes one run reads
    }
    for key in REPORT_KEYS:
        if key in graph.meta:
            out[key] = graph.meta[key]
        elif key in stats:
            out[key] = stats[key]
    if "passes" in graph.meta:
        out["passes"] = list(graph.meta["passes"])
    if options is not None:
        out["stats"] = dict(sorted(options.stats.items()))
        out["declines"] = [list(d) for d in options.declines]
    return out
