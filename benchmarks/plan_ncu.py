"""A Qwen3-0.6B generation plan's decode step (bf16, random weights, batch 1 or 8, 128-token prompt)
run for Nsight Compute to read its skinny products as the plan launches them (norm prologue, gated
epilogue, residual; the kernel selection's form), one layer's worth (a script, not a test):

    ncu --clock-control none -k regex:fc_gemv --launch-skip 20 --launch-count 4 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats python3 benchmarks/plan_ncu.py [BATCH]

The plan runs with plain launches (FUSEC_PDL=0): Nsight Compute serializes kernels anyway. Knobs
set in the environment (FUSEC_GEMV_FORM, ...) shape the plan as they would any
compile."""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    from decode_step import model

    import fusec
    from fusec.compiler import compile_generation
    from fusec.generation import write_sampling
    from fusec.runtime.generation import PlanEngine
    from fusec.sampling import Sampling, row_seeds

    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    os.environ["FUSEC_PDL"] = "0"
    plan = compile_generation(model("qwen3-0.6b"), batch=batch, max_seq_len=160, prefill_len=128, dtype="bf16",
                              eos_ids=[])
    path = os.path.join(tempfile.mkdtemp(), "q.fplan")
    plan.save(path)
    del plan
    plan = fusec.load(path)
    eng = PlanEngine(plan)
    ids = np.random.default_rng(0).integers(0, int(plan.manifest["generation"]["vocab_size"]), (batch, 128))
    write_sampling(eng, [Sampling()] * batch, row_seeds(0, batch))
    eng.prefill(ids, np.full(batch, 128, np.int64))
    for _ in range(2):
        eng.decode()
    eng.sync()
    print("decode launches:", [L["label"] for L in plan.manifest["entries"]["decode"]["launches"][:12]], flush=True)


if __name__ == "__main__":
    main()
