"""Per-block timeline of a decode step's last layer: when each block of each kernel started, passed
its PDL wait and ended, and on which SM (kernels compiled with FUSEC_TRACE=1: common.cuh's FC_TRACE
records %globaltimer into a module global, fc_trace). CUPTI gives a kernel's first start and last end;
this says how many of a kernel's blocks were resident (and loading their weights) before the kernel
before it ended, when their threads reached the PDL wait (once the loads before it issued; FUSEC_PDL_PIN=value: returned),
when it let them through, and how long the blocks' work after the wait took, in phases (thread 0's
FC_TRACE_PHASE marks, us after the wait): the product's x normalized / first tile summed in registers /
summed across warps; the tensor-core quantized product's first stage's copies landed / first run summed / every
warp's sums in shared memory; the attention's prologue done / key loop done / its key groups merged (a cluster
merge:) / rank 0 past its mbarrier (every split's partials stored into it) / its merge of the splits, or (a
global merge: the last split block of a head merges them all) / past the merging block's fence / its merge loop done.

    python benchmarks/block_trace.py OUT_DIR [--model qwen3-0.6b] [--batches 1,8] [--ab KNOB=V[+KNOB=V]]...

A module's trace holds its last launch of the step, so the table covers the last layer's kernels (and
the LM head). Times are us from the earliest traced start in the step; the traced kernels are the
decode products (gemv, and the quantized dp4a and tensor-core forms) and the decode attention. The trace changes the binaries (another cache key)
and adds a few instructions a block: compare variants with each other, not with untraced step times.
Writes OUT_DIR/block_trace.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TRACE_BLOCKS = 8192  # common.cuh FC_TRACE_BLOCKS
SLOTS = 10  # FC_TRACE_SLOTS: start, at the wait, after it, end, SM, phases 1-5 (FC_TRACE_PHASE)
PHASES = 5


def trace_ptrs(eng: Any) -> dict[str, int]:
    """Each loaded module's fc_trace address (modules compiled without the trace have none)."""
    out = {}
    for mid, mod in eng.device._modules.items():
        try:
            ptr = mod.get_global_var("fc_trace")
        except Exception:  # a module without the trace (no common.cuh)
            continue
        out[mid] = int(ptr[0] if isinstance(ptr, tuple) else ptr)
    return out


def read_traces(ptrs: dict[str, int]) -> dict[str, np.ndarray]:
    """Each module's fc_trace as [blocks, SLOTS] uint64."""
    import cupy as cp

    out = {}
    for mid, ptr in ptrs.items():
        out[mid] = host = np.empty((TRACE_BLOCKS, SLOTS), np.uint64)
        cp.cuda.runtime.memcpy(host.ctypes.data, ptr, host.nbytes, cp.cuda.runtime.memcpyDeviceToHost)
    return out


def clear_traces(ptrs: dict[str, int]) -> None:
    import cupy as cp

    for ptr in ptrs.values():
        cp.cuda.runtime.memset(ptr, 0, TRACE_BLOCKS * SLOTS * 8)


def pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if a.size else float("nan")


def timeline(plan: Any, traces: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """The last launch of each traced module, in launch order, with its blocks' times."""
    man = plan.manifest
    launches = [L for L in man["entries"]["decode"]["launches"] if "kernel" in L]
    last = {}
    for i, L in enumerate(launches):
        last[man["kernels"][L["kernel"]]["module"]] = i
    rows = []
    for i, L in enumerate(launches):
        mid = man["kernels"][L["kernel"]]["module"]
        if last[mid] != i or mid not in traces:
            continue
        g = L["grid"]
        n = min(int(g[0]) * int(g[1]) * int(g[2]), TRACE_BLOCKS)
        t = traces[mid][:n].astype(np.int64)
        if not (t[:, 0] > 0).all() or not (t[:, 3] > 0).all():
            continue  # a kernel that records no start/end (only the templates with FC_TRACE_SCOPE do)
        rows.append({"label": L["label"], "blocks": n, "start": t[:, 0], "at_wait": t[:, 1], "waited": t[:, 2],
                     "end": t[:, 3], "sm": t[:, 4], "phases": t[:, 5:5 + PHASES]})
    return rows


def _phase(r: dict[str, Any], i: int) -> float | None:
    ph = r.get("phases")
    if ph is None:
        return None
    ok = (ph[:, i] > 0) & (r["waited"] > 0)
    return round(pct((ph[ok, i] - r["waited"][ok]) * 1e-3, 50), 2) if ok.any() else None


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    t0 = min(int(r["start"].min()) for r in rows)
    prev_end = None
    out = []
    for r in rows:
        s, a, w, e = ((r[k] - t0) * 1e-3 for k in ("start", "at_wait", "waited", "end"))
        waited = w[r["waited"] > 0]
        at_wait = a[r["at_wait"] > 0]
        ready = float(waited.min()) if waited.size else None  # the kernel before it had completed
        before = prev_end if prev_end is not None else ready
        per_sm = np.bincount(r["sm"].astype(np.int64))
        out.append({
            "label": r["label"], "blocks": r["blocks"], "sms": int((per_sm > 0).sum()), "max_blocks_per_sm": int(per_sm.max()),
            "start_min": round(float(s.min()), 2), "start_p50": round(pct(s, 50), 2), "start_max": round(float(s.max()), 2),
            "started_before_prev_end": int((s < before).sum()) if before is not None else None,
            "at_wait_p50": round(pct(at_wait, 50), 2) if at_wait.size else None,
            "at_wait_max": round(float(at_wait.max()), 2) if at_wait.size else None,
            "waited_min": round(ready, 2) if ready is not None else None,
            "waited_p50": round(pct(waited, 50), 2) if waited.size else None,
            "waited_max": round(float(waited.max()), 2) if waited.size else None,
            "end_min": round(float(e.min()), 2), "end_p50": round(pct(e, 50), 2), "end_max": round(float(e.max()), 2),
            "after_wait_p50": round(pct(e - w, 50), 2) if waited.size else None,
            "after_wait_max": round(float((e - w).max()), 2) if waited.size else None,
            # the template's phase marks (FC_TRACE_PHASE), us after the block's wait passed: p50 over the
            # blocks that marked it
            **{f"phase{i + 1}_p50": _phase(r, i) for i in range(PHASES)},
            # the p50 end of the blocks on SMs holding n of this kernel's blocks, by n: do stacked SMs end later?
            "end_p50_by_sm_load": {int(n): round(pct(e[per_sm[r["sm"].astype(np.int64)] == n], 50), 2)
                                   for n in np.unique(per_sm[per_sm > 0])},
        })
        prev_end = float(e.max())
    return out


def block_rows(rows: list[dict[str, Any]], match: str, limit: int = 16) -> list[dict[str, Any]]:
    """Per-block times (us) of the kernels whose label contains ``match``: from the step's earliest block start,
    and the phase marks and the end after the block's own wait; the ``limit`` blocks that end last."""
    t0 = min(int(r["start"].min()) for r in rows)
    out = []
    for r in rows:
        if match not in r["label"]:
            continue
        w = r["waited"]
        blocks = []
        for i in range(r["blocks"]):
            after = (lambda v: round(float(v - w[i]) * 1e-3, 2) if v > 0 and w[i] > 0 else None)  # noqa: E731
            blocks.append({"block": i, "sm": int(r["sm"][i]), "start": round(float(r["start"][i] - t0) * 1e-3, 2),
                           "waited": round(float(w[i] - t0) * 1e-3, 2) if w[i] > 0 else None,
                           "phases": [after(v) for v in r["phases"][i]], "end_after_wait": after(r["end"][i])})
        blocks.sort(key=lambda b: (b["end_after_wait"] is None, -(b["end_after_wait"] or 0.0)))
        out.append({"label": r["label"], "blocks": blocks[:limit]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--modes", default="pdl", help="pdl, plain or both (pdl,plain): how the plan launches its kernels")
    ap.add_argument("--ab", action="append", default=[], metavar="KNOB=VALUE[+KNOB=VALUE]",
                    help="also trace the plan compiled with these knobs (disable=RULE[,RULE]: without those rules)")
    ap.add_argument("--blocks", default="", metavar="LABEL_PART",
                    help="also list the blocks (the 16 that end last) of the kernels whose label contains this, from "
                         "the first traced step: start, wait, phase marks and end, per block")
    args = ap.parse_args()
    os.environ["FUSEC_TRACE"] = "1"  # before fusec compiles anything
    from decode_step import _engine, model, parse_ab

    from fusec.compiler import compile_generation

    variants = {"default": ({}, ())} | {ab: parse_ab(ab) for ab in args.ab}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gm = model(args.model)
    tmp = tempfile.mkdtemp()
    doc: dict[str, Any] = {"model": args.model, "runs": []}
    md = [f"model {args.model}, context {args.context}; us from the step's earliest traced block start; "
          "'early': blocks that started before the kernel before it ended", ""]
    for batch in map(int, args.batches.split(",")):
        for name, (knobs, disabled) in variants.items():
            with mock.patch.dict(os.environ, knobs):  # the next variant runs with the defaults again
                plan = compile_generation(gm, batch=batch, max_seq_len=args.context + 160, prefill_len=args.context,
                                          dtype="bf16", eos_ids=[], disabled_fusions=disabled)
                path = os.path.join(tmp, f"b{batch}.fplan")
                plan.save(path)
                del plan
                for mode in args.modes.split(","):
                    plan, eng, _ = _engine(path, mode == "pdl", batch, warm=True)
                    steps, ptrs, per_block = [], trace_ptrs(eng), []
                    for _ in range(5):  # five steps, each read on its own: the medians over them go in the table
                        clear_traces(ptrs)
                        eng.decode()
                        eng.sync()
                        rows = timeline(plan, read_traces(ptrs))
                        steps.append(summarize(rows))
                        if args.blocks and not per_block:
                            per_block = block_rows(rows, args.blocks)
                    keys = [k for k in steps[0][0] if k not in ("label",)]
                    table = []
                    for j, row in enumerate(steps[0]):
                        med = {"label": row["label"]}
                        for k in keys:
                            if isinstance(row[k], dict):  # by blocks on the SM: the median of each count's values
                                vals_by = [(n, [s[j][k][n] for s in steps if n in s[j][k]]) for n in sorted(
                                    {n for s in steps for n in s[j][k]})]
                                med[k] = {n: round(float(np.median(v)), 2) for n, v in vals_by}
                                continue
                            vals = [s[j][k] for s in steps if s[j][k] is not None]
                            med[k] = round(float(np.median(vals)), 2) if vals else None
                        table.append(med)
                    import cupy as cp

                    a, b = cp.cuda.Event(), cp.cuda.Event()
                    times = []
                    for _ in range(5):  # step time of the traced binaries: compare variants of one run only
                        a.record(eng.stream)
                        for _ in range(20):
                            eng.decode()
                        b.record(eng.stream)
                        b.synchronize()
                        times.append(cp.cuda.get_elapsed_time(a, b) / 20)
                    doc["runs"].append({"batch": batch, "variant": name, "mode": mode, "kernels": table, "steps": steps,
                                        "step_ms": float(np.median(times)), "blocks": per_block})
                    md += [f"### batch {batch}, {name}, {mode} launches", "",
                           f"step (the traced binaries, medians of 5 x 20 replays): {np.median(times):.3f} ms", "",
                           "| kernel | blocks (SMs, max/SM) | start min / p50 / max | early | at the wait p50 / max | "
                           "wait passed min / p50 / max | end min / p50 / max | after wait p50 / max | phases 1 / ... / 5 after "
                           "the wait, p50 | end p50 by blocks on the SM |",
                           "|---|---|---|---|---|---|---|---|---|---|"]
                    for r in table:
                        md.append(f"| {r['label'][:40]} | {r['blocks']:.0f} ({r['sms']:.0f}, {r['max_blocks_per_sm']:.0f}) | "
                                  f"{r['start_min']} / {r['start_p50']} / {r['start_max']} | {r['started_before_prev_end']} | "
                                  f"{r['at_wait_p50']} / {r['at_wait_max']} | "
                                  f"{r['waited_min']} / {r['waited_p50']} / {r['waited_max']} | "
                                  f"{r['end_min']} / {r['end_p50']} / {r['end_max']} | "
                                  f"{r['after_wait_p50']} / {r['after_wait_max']} | "
                                  f"{' / '.join(str(r[f'phase{i + 1}_p50']) for i in range(PHASES))} | "
                                  f"{', '.join(f'{n}: {v}' for n, v in r['end_p50_by_sm_load'].items())} |")
                    md.append("")
                    for k in per_block:  # the blocks that end last of each kernel asked for (--blocks)
                        md += [f"{k['label']}: the blocks that end last (us; phases and end after the block's own wait)",
                               "", "| block | SM | start | wait passed | phases 1 / ... / 5 | end |",
                               "|---|---|---|---|---|---|"]
                        md += [f"| {b['block']} | {b['sm']} | {b['start']} | {b['waited']} | "
                               f"{' / '.join(str(p) for p in b['phases'])} | {b['end_after_wait']} |" for b in k["blocks"]]
                        md.append("")
                    print("\n".join(md[-len(table) - 6:]), flush=True)
                    eng = plan = None
    (out / "block_trace.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "block_trace.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
