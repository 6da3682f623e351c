"""A/B ledgers of the issue-5 models on the current GPU, with the three whole-plan timings.

    python benchmarks/ab_models.py OUT.json [--models gpt2-small,minilm,qwen3-0.6b] [--ab-budget S]
        [--no-cache]

For each model (shapes and dtypes of the issue: gpt2-small 8x128 fp16, minilm 32x128 fp16,
qwen3-0.6b 1x128 bf16; CUDA-graph replay) it runs ``fusec.ab.run``, prints the ledger table and
writes {"device", "models": {name: {"shapes", "dtype", "seconds", "ledger", "whole_plan"}}} to
OUT.json after every model (so a partial run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

CASES = {
    "gpt2-small": ({"input_ids": (8, 128), "attention_mask": (8, 128)}, "fp16"),
    "minilm": ({"input_ids": (32, 128), "attention_mask": (32, 128)}, "fp16"),
    "qwen3-0.6b": ({"input_ids": (1, 128), "attention_mask": (1, 128)}, "bf16"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--models", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    ap.add_argument("--ab-budget", type=float, default=None, help="per-model measuring budget in seconds")
    ap.add_argument("--no-cache", action="store_true", help="re-measure instead of using cached results")
    args = ap.parse_args()

    import fusec.ab
    from fusec import device
    from fusec.cli.ab import AbProgress

    if not device.gpu_available():
        print("ab_models: no GPU found", file=sys.stderr)
        return 1
    result: dict = {"device": device.describe(), "models": {}}
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        shapes, dtype = CASES[name]
        t0 = time.perf_counter()
        ledger = fusec.ab.run(name, shapes=shapes, dtype=dtype, cuda_graph=True, budget_s=args.ab_budget,
                              progress=AbProgress(), use_cache=not args.no_cache)
        print(f"== {name} ({dtype}, {'x'.join(map(str, shapes['input_ids']))}, cuda graph)")
        print(ledger.to_table(), flush=True)
        result["models"][name] = {"shapes": {k: list(v) for k, v in shapes.items()}, "dtype": dtype,
                                  "seconds": round(time.perf_counter() - t0, 1), "ledger": ledger.to_dict(),
                                  "whole_plan": ledger.whole_plan}
        tmp = args.out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        os.replace(tmp, args.out)
    print(json.dumps({k: v["whole_plan"] for k, v in result["models"].items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
