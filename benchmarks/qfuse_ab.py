"""The packed-weight decode step as the rule compiles it (the default: the dp4a form, with the norm
prologue and gated epilogue) against the rule without the dp4a form (FUSEC_QGEMV_FORM=tc) and
without the norm prologue and gated epilogue (norm_gemm, gated_epilogue disabled), timed in turns:
the Llama-1B shape in llama.cpp's Q4_K_M mix (random blocks, untied Q6_K head), batch 1, bf16, CUDA
graphs.

    python benchmarks/qfuse_ab.py [--layers 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quant_bench as qb  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import cupy as cp
    import numpy as np

    from fusec.compiler import compile_generation
    from fusec.generation import write_sampling
    from fusec.runtime.generation import PlanEngine
    from fusec.sampling import Sampling, row_seeds

    engines = {}
    for name, form, disabled in (("default", "auto", ()), ("no dp4a", "tc", ()),
                                 ("unfused", "auto", ("norm_gemm", "gated_epilogue"))):
        os.environ["FUSEC_QGEMV_FORM"] = form  # read when the rule runs (fusec.knobs)
        plan = compile_generation(qb._model("q4_k_m", args.layers), batch=1, max_seq_len=160, prefill_len=16,
                                  dtype="bf16", eos_ids=[], disabled_fusions=disabled)
        eng = PlanEngine(plan)
        write_sampling(eng, [Sampling()], row_seeds(0, 1))
        ids = np.random.default_rng(0).integers(0, 1000, (1, 16))
        engines[name] = (eng, ids, len(plan.manifest["entries"]["decode"]["launches"]))
    times: dict[str, list[float]] = {n: [] for n in engines}
    tokens = {}
    for r in range(args.rounds):
        for name in list(engines)[r % 2:] + list(engines)[:r % 2]:
            eng, ids, _ = engines[name]
            eng.prefill(ids, np.array([16]))
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(eng.stream)
            for _ in range(127):
                eng.decode()
            b.record(eng.stream)
            b.synchronize()
            times[name].append(cp.cuda.get_elapsed_time(a, b) / 127)
            tokens[name] = eng.read_state("tokens")
    for name, (eng, _, launches) in engines.items():
        ms = statistics.median(times[name])
        print(f"{name}: {launches} decode launches, {ms:.3f} ms a step ({1e3 / ms:.0f} tok/s), all {[round(t, 3) for t in times[name]]}")
    for name in list(engines)[1:]:
        same = int((tokens["default"] == tokens[name]).sum())
        print(f"tokens equal to the default's ({name}): {same} of {tokens[name].size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
