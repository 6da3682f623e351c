"""What a join step costs on the GPU beside a plain decode step, and where its time goes.

    python benchmarks/join_cost.py OUT_DIR [--batch 32] [--prompt-len 128] [--joins 1,4]

For each J of --joins, a Qwen3-0.6B-shaped generation plan (random weights, bf16) with a join entry
of J prompts a step (models/join.py): the decode step and the join step (every slot in use)
replayed as CUDA graphs, each timed over 50 replays between two CUDA events in the same process,
the host time of a join call (its inputs staged, the graph launched); then the join entry's
per-launch profile summed by kernel.
Writes OUT_DIR/join_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from admit_profile import by_kind, print_kinds  # noqa: E402 - the sibling script's summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--joins", default="1,4", help="prompts a join step takes (one plan each)")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    import cupy

    from fusec.compiler import compile_generation
    from fusec.generation import join_feeds, sampling_states
    from fusec.genmodel import load_generation_model
    from fusec.runtime.generation import PlanEngine
    from fusec.sampling import Sampling

    gm = load_generation_model("qwen3-0.6b")
    b, s = args.batch, args.prompt_len
    rng = np.random.default_rng(0)
    ids = rng.integers(1, gm.config.vocab_size, (b, s)).astype(np.int64)
    a, z = cupy.cuda.Event(), cupy.cuda.Event()
    doc: dict = {"args": vars(args), "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(), "joins": {}}
    for slots in (int(x) for x in args.joins.split(",")):
        plan = compile_generation(gm, batch=b, max_seq_len=s + args.max_tokens, prefill_len=s, dtype="bf16",
                                  eos_ids=(), join=slots)
        eng = PlanEngine(plan)
        eng.write_states(sampling_states([Sampling()] * b, np.arange(b, dtype=np.int64)))
        eng.prefill(ids, np.full(b, s // 2, np.int64), timed=False)
        feeds = join_feeds([(3 + j, ids[j, :s].tolist()) for j in range(slots)], s, slots)  # every slot in use
        host: list[float] = []

        def timed(fn) -> float:
            for _ in range(5):
                fn()
            a.record(eng.stream)
            for _ in range(args.reps):
                fn()
            z.record(eng.stream)
            z.synchronize()
            return float(cupy.cuda.get_elapsed_time(a, z)) / args.reps

        def join() -> None:
            t0 = time.perf_counter()
            eng.join(feeds)
            host.append((time.perf_counter() - t0) * 1e3)

        r: dict = {}
        for _ in range(2):  # alternate, twice: both see the same clocks
            r["decode_ms"] = timed(eng.decode)
            host.clear()
            r["join_ms"] = timed(join)
            r["prefill_ms"] = timed(lambda: eng.prefill(ids, np.full(b, s, np.int64), timed=False))
        r["join_host_ms_median"] = float(np.median(host))
        r["extra_ms_per_prompt"] = (r["join_ms"] - r["decode_ms"]) / slots
        r["launches"] = {e: len(plan.manifest["entries"][e]["launches"]) for e in ("decode", "join", "prefill")}
        r["join_profile"] = by_kind(plan._exec("join").profile(feeds))
        print(f"J={slots}: decode {r['decode_ms']:.3f} ms, join {r['join_ms']:.3f} ms (+{r['join_ms'] - r['decode_ms']:.3f}, "
              f"{r['extra_ms_per_prompt']:.3f} a prompt; host {r['join_host_ms_median']:.3f} ms a call), whole-batch "
              f"prefill {r['prefill_ms']:.3f} ms; launches {r['launches']}")
        print_kinds(r["join_profile"], 12)
        doc["joins"][str(slots)] = r
        eng = plan = None  # the next plan gets the device memory
    with open(os.path.join(args.out_dir, "join_cost.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
