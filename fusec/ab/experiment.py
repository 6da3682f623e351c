"""``fusec.ab.run``: measure every candidate, decide, then check the assembled plan as a whole.

Flow: load the model; list the experiments (``fusec.ab.regions.candidates``); order them by
expected effect (region bytes + FLOPs, times the number of candidates sharing the region) so a
``budget_s`` spends its time where it matters most; for each, take a cached result or build both
variants of its region graph, compare their outputs on the same random non-zero inputs, time
both in the plan's execution mode and decide (``fusec.ab.decide``). Last, time the rule-based
plan, the all-unfused plan and the plan assembled from the decisions; if the assembled plan is
slower than the rule-based one, the ledger says so and keeps the rule-based plan (``kept``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fusec.ab import cache as C
from fusec.ab.decide import FUSED, MARGIN, NOT_MEASURED, TOLERANCE, UNFUSED, decide, rel_error
from fusec.ab.ledger import Entry, Ledger
from fusec.ab.regions import Candidate, candidates, describe
from fusec.ab.runner import GpuRunner, Runner
from fusec.errors import InputError

Progress = Callable[[int, int, str], None]


def run(model: Any, shapes: Mapping[str, Sequence[int]] | None = None, dtype: str = "fp16", cuda_graph: bool = True,
        candidates: Sequence[str] | None = None, budget_s: float | None = None, progress: Progress | None = None, *,
        runner: Runner | None = None, use_cache: bool = True, margin: float = MARGIN, whole_plan: bool = True,
        iters: int = 200) -> Ledger:
    """Measure the fusion candidates and kernel choices of ``model``; returns the ``Ledger``.

    ``candidates``: only experiments whose candidate key, rule ("mlp", "choice", ...) or a member
    label is listed. ``budget_s``: stop measuring after this many seconds; the rest are recorded
    as "not measured (budget)" (cached results are still used). ``progress(i, n, name)`` is
    called before each experiment and once with i == n at the end. ``runner``: how plans are
    built and measured (default: ``GpuRunner``, which needs a GPU).
    """
    from fusec.compiler import DTYPES
    from fusec.loader import load_graph

    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    runner = runner if runner is not None else GpuRunner()
    graph = load_graph(model, shapes)
    _, exps = _candidates(graph, DTYPES[dtype][0], candidates)
    env = runner.environment()
    tol = TOLERANCE[dtype]
    order = sorted(range(len(exps)), key=lambda i: -exps[i].weight)
    entries: dict[int, Entry] = {}
    t0 = time.perf_counter()
    for n_done, i in enumerate(order):
        c = exps[i]
        if progress is not None:
            progress(n_done, len(order), c.name)
        entry = Entry(**describe(c))
        ckey = C.key({"signature": c.region.signature, "kind": c.kind, "rule": c.rule, "variant": c.variant,
                      "default": c.default, "dtype": dtype, "cuda_graph": cuda_graph, "margin": margin, "env": env})
        hit = C.get(ckey) if use_cache else None
        if hit is not None:
            for f in ("fused", "unfused", "max_error", "tolerance", "decision", "reason"):
                setattr(entry, f, hit.get(f))
            entry.cached = True
        elif budget_s is not None and time.perf_counter() - t0 >= budget_s:
            entry.reason = "not measured (budget)"
        else:
            _measure(runner, c, entry, dtype, cuda_graph, tol, margin, iters)
            if use_cache and entry.decision != NOT_MEASURED:
                C.put(ckey, {f: getattr(entry, f) for f in ("fused", "unfused", "max_error", "tolerance", "decision", "reason")})
        entries[i] = entry
    ledger = Ledger(_model_name(model, graph), dtype, cuda_graph, {k: list(v) for k, v in (shapes or {}).items()},
                    margin, env, [entries[i] for i in range(len(exps))])
    if whole_plan:
        if progress is not None:
            progress(len(order), len(order), "whole-plan check")
        ledger.whole_plan = check_whole_plan(runner, model, shapes, dtype, cuda_graph, ledger, iters)
    if progress is not None:
        progress(len(order), len(order), "done")
    return ledger


def _candidates(graph: Any, storage: str, only: Sequence[str] | None) -> tuple[Any, list[Candidate]]:
    return candidates(graph, storage, list(only) if only else None)


def _model_name(model: Any, graph: Any) -> str:
    return os.fspath(model) if isinstance(model, (str, os.PathLike)) else str(graph.name)


def _failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _reproduced(c: Candidate, plan: Any) -> str | None:
    """None when the fused build really holds the candidate, else why not."""
    rep = plan.manifest.get("report", {})
    if c.kind == "fusion":
        from fusec.passes.fusion_rules import FusionRecord

        recs = [r for r in map(FusionRecord.from_json, rep.get("fusions", [])) if r.key == c.key]
        if not recs or not recs[0].applied:
            why = recs[0].reason if recs else "no such candidate"
            return f"candidate not reproduced in the region graph ({why})"
        return None
    ch = rep.get("lowering", {}).get("choices", {})
    if c.key not in ch.get("applied", {}):
        return f"kernel variant not applied in the region ({ch.get('declined', {}).get(c.key, 'no such choice point')})"
    return None


def _measure(runner: Runner, c: Candidate, entry: Entry, dtype: str, cuda_graph: bool, tol: float, margin: float,
             iters: int) -> None:
    """Fill ``entry`` with both variants' timings, the error and the decision."""
    (f_ovr, u_ovr), (f_ch, u_ch) = c.overrides, c.choices
    entry.tolerance = tol
    try:
        unfused = runner.build(c.region.graph, dtype=dtype, cuda_graph=cuda_graph, overrides=u_ovr, choices=u_ch)
        inputs = runner.inputs(unfused, int.from_bytes(os.urandom(4), "little"))  # fresh each run
        ref = runner.outputs(unfused, inputs)
        entry.unfused = _timing(runner.time(unfused, cuda_graph, iters))
    except Exception as e:  # the baseline itself fails: nothing to compare against
        entry.decision, entry.reason = NOT_MEASURED, f"unfused variant failed: {_failure(e)}"
        return
    failure = None
    try:
        fused = runner.build(c.region.graph, dtype=dtype, cuda_graph=cuda_graph, overrides=f_ovr, choices=f_ch)
        failure = _reproduced(c, fused)
        if failure is None:
            entry.max_error = rel_error(runner.outputs(fused, inputs), ref)
            entry.fused = _timing(runner.time(fused, cuda_graph, iters))  # timed even when wrong: the ledger shows it
    except Exception as e:  # a variant that cannot be built or run is rejected, with the error recorded
        failure = _failure(e)
    entry.decision, entry.reason = decide(entry.fused, entry.unfused, entry.max_error, tol, margin, failure)


def _timing(t: Mapping[str, Any]) -> dict[str, Any]:
    return {k: t[k] for k in ("median_ms", "p10_ms", "p90_ms", "min_ms", "runs", "mode") if k in t}


def check_whole_plan(runner: Runner, model: Any, shapes: Mapping[str, Sequence[int]] | None, dtype: str,
                     cuda_graph: bool, ledger: Ledger, iters: int) -> dict[str, Any]:
    """Time the rule-based, all-unfused and assembled plans; keep the assembled one only when it
    is no slower than the rule-based one."""
    from fusec.passes.fusion_rules import RULES

    out: dict[str, Any] = {}
    overrides, choices = ledger.overrides(), ledger.choices()
    builds = {"rule_based": {}, "unfused": {"disabled": tuple(RULES)},
              "assembled": {"overrides": overrides, "choices": choices}}
    for name, kw in builds.items():
        try:
            plan = runner.build(model, dtype=dtype, cuda_graph=cuda_graph, shapes=shapes, **kw)
            out[name] = _timing(runner.time(plan, cuda_graph, iters))
        except Exception as e:
            out[name] = None
            out[f"{name}_error"] = _failure(e)
    rb, asm = out.get("rule_based"), out.get("assembled")
    changed = sum(1 for e in ledger.entries if e.decision in (FUSED, UNFUSED) and (e.decision != e.rule_default))
    if rb is None or asm is None:
        out["kept"], out["note"] = "rule_based", "whole-plan check incomplete; keeping the rule-based plan"
    elif asm["median_ms"] > rb["median_ms"]:
        out["kept"] = "rule_based"
        out["note"] = (f"the assembled plan is SLOWER than the rule-based plan ({asm['median_ms']:.4f} ms vs "
                       f"{rb['median_ms']:.4f} ms); keeping the rule-based plan")
    else:
        out["kept"] = "assembled"
        out["note"] = (f"assembled plan {asm['median_ms']:.4f} ms vs rule-based {rb['median_ms']:.4f} ms "
                       f"({changed} decisions differ from the rules); keeping the assembled plan")
    return out
