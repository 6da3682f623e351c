"""Per-launch GPU time of a compiled plan, grouped by kernel kind (GPU only).

    python benchmarks/profile_plan.py MODEL DTYPE [B S]     e.g.  gpt2-small fp16 8 128
"""

from __future__ import annotations

import sys
from collections import defaultdict

import fusec
from fusec.inputs import random_inputs_for


def main() -> None:
    model, dtype = sys.argv[1], sys.argv[2]
    shapes = None
    if len(sys.argv) > 4:
        b, s = int(sys.argv[3]), int(sys.argv[4])
        shapes = {"input_ids": (b, s), "attention_mask": (b, s)}
    plan = fusec.compile(model, shapes=shapes, dtype=dtype)
    inputs = random_inputs_for(plan.manifest["inputs"], 0)
    prof = plan.profile(inputs, repeats=7)
    total = sum(p["ms"] for p in prof)
    groups: dict[str, list[float]] = defaultdict(list)
    for p in prof:
        label = p["label"].split(" ", 1)[1] if " " in p["label"] else p["label"]  # drop the "#N" node index
        key = p["kind"] if p["kind"].startswith("cublas") else p["kind"].split("_")[1] + " " + label[:50]
        groups[key].append(p["ms"])
    print(f"{model} {dtype}: {len(prof)} launches, sum of per-launch times {total:.3f} ms")
    for key, ms in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:14]:
        print(f"  {sum(ms):8.3f} ms  {100 * sum(ms) / total:5.1f}%  x{len(ms):<3}  {key}")


if __name__ == "__main__":
    main()
