"""One generation plan's decode step, measured and broken down (GPU): tokens/s, launches per step,
what the driver did per step (CUPTI), and per-launch times grouped by kernel family.

    python benchmarks/decode_profile.py OUT.json [--model qwen3-0.6b] [--batches 1,8]

The per-launch times come from ``Plan.profile`` (CUDA events around each launch, launched one by
one): they overstate small kernels (each pays a launch), so read them as shares, not as the
CUDA-graph step time, which ``decode_tok_s`` reports.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from fusec.compiler import compile_generation
from fusec.runtime.generation import generate_with_plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    results = {}
    for b in map(int, args.batches.split(",")):
        t0 = time.time()
        plan = compile_generation(args.model, batch=b, max_seq_len=args.prompt + args.new, prefill_len=args.prompt,
                                  dtype="bf16", eos_ids=[])
        compile_s = time.time() - t0
        rng = np.random.default_rng(0)
        prompts = [list(rng.integers(0, int(plan.manifest["generation"]["vocab_size"]), args.prompt)) for _ in range(b)]
        generate_with_plan(plan, prompts, max_new_tokens=8)  # warm-up
        r = generate_with_plan(plan, prompts, max_new_tokens=args.new)
        dec = r.stats["decode"]
        by_kind: dict[str, float] = {}
        for p in plan.profile({}, repeats=3, entry="decode"):
            k = p["kind"].split(" m=")[0] if p["kind"].startswith("cublas") else p["kind"].split("_")[1]
            by_kind[k] = round(by_kind.get(k, 0.0) + p["ms"], 4)
        rec = {"batch": b, "compile_s": round(compile_s, 1), "prefill_ms": r.prefill_ms, "decode_tok_s": r.decode_tok_s,
               "step_ms": 1e3 * b / r.decode_tok_s, "launches_per_step": dec["launches_per_step"],
               "kernels_per_layer": dec["kernels_per_layer"], "counters": dec.get("counters"),
               "per_step": dec.get("per_step"), "profile_ms_by_kind": by_kind}
        results[f"b{b}"] = rec
        print(json.dumps(rec, default=str), flush=True)
        del plan
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
