"""A generation plan's prefill entry on the GPU: its time (median of graph runs, inputs' copy
included), launches, and the per-kernel profile of its runs (CUPTI kernel records: own time per
kernel, summed per layer position), for the default plan and for variants compiled with other knobs,
timed in turns in one process.

    python benchmarks/prefill_step.py OUT_DIR [--model qwen3-0.6b|llama-1b] [--batch 1] [--prompt 128] [--cache ROWS]
                                      [--ab KNOB=VALUE[+KNOB=VALUE]] ...

Each variant's first token and KV caches after the prefill are compared with the default's bit for
bit (a variant may change the order of sums: then it says so, and how far the caches moved). Writes
OUT_DIR/prefill_step.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_step import _engine, model, parse_ab, profile_mode  # noqa: E402


def _prefill_ms(eng: Any, start: Any) -> float:
    import cupy as cp

    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(eng.stream)
    start()
    b.record(eng.stream)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b)


def _state(eng: Any) -> dict[str, np.ndarray]:
    """The plan's states on the host; bf16 ones (raw 16-bit words on the device) as ml_dtypes' bfloat16, so that
    differences are of values, not of bit patterns."""
    import ml_dtypes

    out = {}
    for r in eng.plan.manifest["state"]:
        a = eng.read_state(r["name"])
        out[r["name"]] = a.view(ml_dtypes.bfloat16) if r.get("dtype") == "bf16" and a.dtype == np.uint16 else a
    return out


def compare(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, Any]:
    out: dict[str, Any] = {"bit_identical": [], "differ": {}}
    for k in a:
        if np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)):
            out["bit_identical"].append(k)
        else:
            x, y = a[k].astype(np.float64), b[k].astype(np.float64)
            d = float(np.max(np.abs(x - y))) if x.size else 0.0
            scale = float(np.max(np.abs(x))) if x.size else 0.0
            # the largest difference, and that over the largest magnitude in the default's state (a few bf16 steps
            # are ~1e-2 of it; a wrong product is O(1))
            out["differ"][k] = {"max_abs": d, "rel": d / scale if scale else float("inf")}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--cache", type=int, default=0, help="the plans' cache rows (default: the prompt + 16)")
    ap.add_argument("--rounds", type=int, default=15, help="timed runs of each plan, in turns")
    ap.add_argument("--ab", action="append", default=[], metavar="KNOB=VALUE[+KNOB=VALUE]",
                    help="also time a plan compiled with these knobs (disable=RULE[,RULE]: without those fusion rules)")
    args = ap.parse_args()
    from fusec.compiler import compile_generation

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gm = model(args.model)
    tmp = tempfile.mkdtemp()
    variants = {"default": ({}, ())}
    for ab in args.ab:
        variants[ab] = parse_ab(ab)
    paths, launches = {}, {}
    for name, (knobs, disabled) in variants.items():
        with mock.patch.dict(os.environ, knobs):  # the next variant runs with the defaults again
            plan = compile_generation(gm, batch=args.batch, max_seq_len=args.cache or args.prompt + 16, prefill_len=args.prompt,
                                      dtype="bf16", eos_ids=[], disabled_fusions=disabled)
        paths[name] = os.path.join(tmp, f"{len(paths)}.fplan")
        plan.save(paths[name])
        launches[name] = len(plan.manifest["entries"]["prefill"]["launches"])
        del plan
    engines = {n: _engine(p, True, args.batch) for n, p in paths.items()}
    for _, _eng, start in engines.values():  # warm: graphs captured, kernels loaded
        start()
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            _, eng, start = engines[n]
            times[n].append(_prefill_ms(eng, start))
    states = {n: _state(engines[n][1]) for n in names}
    results: dict[str, Any] = {"model": args.model, "batch": args.batch, "prompt": args.prompt,
                               "cache": args.cache or args.prompt + 16, "variants": {}}
    for n in names:
        results["variants"][n] = {"prefill_ms": statistics.median(times[n]), "prefill_ms_all": times[n],
                                  "launches": launches[n], "vs_default": compare(states["default"], states[n])}
        print(n, json.dumps({k: v for k, v in results["variants"][n].items() if k != "prefill_ms_all"}), flush=True)
    engines.clear()
    for n in names:  # after every timing: attached CUPTI slows every later graph launch
        prof, timeline = profile_mode(paths[n], True, args.batch, entry="prefill")
        results["variants"][n]["profile"] = prof
        results["variants"][n]["timeline"] = timeline
        if n == "default" and isinstance(prof, dict):
            top = sorted(prof["by_kernel_us"].items(), key=lambda kv: -kv[1]["per_step"] * kv[1]["median_us"])
            for k, v in top[:16]:
                print(f"  {v['per_step'] * v['median_us']:8.1f} us  {v['per_step']:5.1f} x {v['median_us']:6.2f}  {v['label'][:40]}  {k[:60]}")
            print("wall", prof["wall_us"], "busy", prof["busy_us"], "gap median", prof["gap_us_median"], flush=True)
    (out / "prefill_step.json").write_text(json.dumps(results, indent=1, default=str))
    md = [f"model {args.model}, batch {args.batch}, prompt {args.prompt}, cache rows {results['cache']}", "",
          "| variant | launches | prefill ms (median, in turns) | same bits as default | profile wall / busy us |",
          "|---|---|---|---|---|"]
    for n, r in results["variants"].items():
        p = r["profile"]
        pw = f'{p["wall_us"]:.0f} / {p["busy_us"]:.0f}' if isinstance(p, dict) else str(p)
        same = "yes" if not r["vs_default"]["differ"] else "no: " + ", ".join(
            f"{k} {v['max_abs']:.3g} ({v['rel']:.2g} of its largest)" for k, v in list(r["vs_default"]["differ"].items())[:3])
        md.append(f"| {n} | {r['launches']} | {r['prefill_ms']:.3f} | {same} | {pw} |")
    (out / "prefill_step.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
