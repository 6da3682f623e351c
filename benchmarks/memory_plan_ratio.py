"""Arena planned by passes/memory_plan.py against the live-bytes lower bound, for tiny HF exports.

    python benchmarks/memory_plan_ratio.py gpt_neox gpt2 phi falcon-kv1 [--shape 2x12]

Names are tests/hf_models.py families or tests/llm_families.py cases (exported with the legacy
exporter; set FUSEC_HF_EXPORT_DIR to keep the files). Prints, per storage dtype, the planned and
lower-bound bytes, their ratio, and what greedy by size alone (no repair rounds) would plan.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    import hf_models
    import llm_families

    from fusec.loader import load_graph
    from fusec.passes import memory_plan as M
    from fusec.passes.base import PassOptions
    from fusec.passes.pipeline import PIPELINE, optimize

    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+")
    ap.add_argument("--shape", default="2x12", help="batch x seq")
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split("x"))
    for name in a.names:
        if name in hf_models.FAMILIES:
            path = hf_models.export_hf(name, "legacy")[0]
        else:
            path = llm_families.export_case(name, "legacy")[0]
        g0 = load_graph(path, {"input_ids": shape, "attention_mask": shape})
        for storage in ("f32", "f16"):
            g, _ = optimize(g0, PassOptions(storage_dtype=storage), pipeline=PIPELINE[:-1])
            p = M.plan_memory(g)
            plain = M._place(copy.deepcopy(p.records), lambda r: (-r.size, r.first, r.name))
            lb = p.lower_bound_bytes
            print(f"{name:12s} {storage} planned {p.arena_bytes:8d}  bound {lb:8d}  ratio {p.arena_bytes / lb:.3f}  "
                  f"greedy-by-size alone {plain / lb:.3f}")


if __name__ == "__main__":
    main()
