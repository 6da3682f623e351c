"""Where an admission's GPU time goes: the per-launch profile of a generation plan's whole-batch
prefill and of its admit entry (Qwen3-0.6B shape, random weights, bf16), summed by kernel.

    python benchmarks/admit_profile.py OUT_DIR [--batch 32] [--admit 8] [--prompt-len 128]

Each launch is timed alone (``Executor.profile``: CUDA events around it, median of 5), so the sums
are upper bounds of the entries' graph replays. Writes OUT_DIR/admit_profile.json and prints the
top kernels of each entry.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np


def by_kind(records: list[dict]) -> list[dict]:
    """``Executor.profile`` records summed per kernel (cuBLAS products per shape), slowest first."""
    by: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for r in records:
        key = r["kind"].split(" algo")[0]
        by[key][0] += r["ms"]
        by[key][1] += 1
    return [{"kind": k, "ms": ms, "launches": n} for k, (ms, n) in sorted(by.items(), key=lambda kv: -kv[1][0])]


def print_kinds(kinds: list[dict], top: int) -> None:
    for k in kinds[:top]:
        print(f"  {k['ms']:8.3f} ms  {k['launches']:4d} x  {k['kind']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--admit", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    from fusec.compiler import compile_generation
    from fusec.generation import admit_feeds
    from fusec.genmodel import load_generation_model

    gm = load_generation_model("qwen3-0.6b")
    b, s = args.batch, args.prompt_len
    plan = compile_generation(gm, batch=b, max_seq_len=s + args.max_tokens, prefill_len=s, dtype="bf16", eos_ids=(),
                              admit_batch=args.admit, cuda_graph=False)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, gm.config.vocab_size, (b, s)).astype(np.int64)
    lengths = np.full(b, s, np.int64)
    some = np.zeros(b, np.int64)
    some[:args.admit] = s
    feeds = {"prefill": {"input_ids": ids, "lengths": lengths}, "admit": admit_feeds(ids, some, args.admit)[0]}
    doc: dict = {"args": vars(args), "entries": {}}
    for entry, inputs in feeds.items():
        recs = plan._exec(entry).profile(inputs)
        kinds = by_kind(recs)
        total = sum(r["ms"] for r in recs)
        doc["entries"][entry] = {"launches": len(recs), "sum_ms": total, "records": recs, "by_kind": kinds}
        print(f"\n{entry}: {len(recs)} launches, {total:.3f} ms summed")
        print_kinds(kinds, args.top)
    with open(os.path.join(args.out_dir, "admit_profile.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
