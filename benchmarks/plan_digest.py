"""What a plan executes, as digests: per built-in plan, its launch count, each kernel module's source
hash, each module's CUBIN hash ("code") and one hash of the launch records. Two commits whose digests
agree compile the same programs (so GPU results of one hold for the other); where only the sources
differ (a refactor of a template: a helper moved into a header, a comment), the same "code" and
"launches" still say the GPU runs the same machine code. Besides the built-in models, a 4-layer
Llama-1B-shaped Q4_K_M generation plan at batches 1 and 8 (quant_bench.py's packed weights: the dp4a
and tensor-core quantized kernels). CPU only (sm_90, NVRTC).

    python benchmarks/plan_digest.py > a.json     # then, at another commit: diff a.json b.json
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import fusec
from fusec.compiler import compile_generation


def digest(plan: Any) -> dict[str, Any]:
    m = plan.manifest
    launches = m.get("launches") or {k: v["launches"] for k, v in m.get("entries", {}).items()}
    n = len(m["launches"]) if "launches" in m else sum(len(v["launches"]) for v in m["entries"].values())
    return {"n": n, "modules": [hashlib.sha256(plan.blob(mod["source"])).hexdigest()[:12] for mod in m["modules"]],
            "code": [hashlib.sha256(plan.blob(mod["cubin"])).hexdigest()[:12] for mod in m["modules"]],
            "launches": hashlib.sha256(json.dumps(launches, sort_keys=True).encode()).hexdigest()[:16]}


def main() -> None:
    out = {}
    for name, dt in [("gpt2-small", "fp16"), ("bert-base", "fp16"), ("qwen3-0.6b", "bf16"), ("gpt2-small", "fp32")]:
        out[f"{name}:{dt}"] = digest(fusec.compile(name, dtype=dt, arch="sm_90", cuda_graph=True))
    for name in ("qwen3-tiny", "llama-tiny"):
        out[f"{name}:gen"] = digest(compile_generation(name, batch=2, max_seq_len=64, dtype="bf16", arch="sm_90"))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import quant_bench

    gm = quant_bench._model("q4_k_m", 4, "1b")
    for batch in (1, 8):  # the dp4a form at one row, the tensor-core form at 8
        plan = compile_generation(gm, batch=batch, max_seq_len=64, prefill_len=32, dtype="bf16", arch="sm_90",
                                  eos_ids=[])
        out[f"llama-1b-q4_k_m:4 layers:b{batch}"] = digest(plan)
    print(json.dumps(out, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
