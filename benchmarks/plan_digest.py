"""What a plan executes, as digests: per built-in plan, its launch count, each kernel module's source
hash and one hash of the launch records. Two commits whose digests agree compile the same programs
(so GPU results of one hold for the other). CPU only (sm_90, NVRTC).

    python benchmarks/plan_digest.py > a.json     # then, at another commit: diff a.json b.json
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import fusec
from fusec.compiler import compile_generation


def digest(plan: Any) -> dict[str, Any]:
    m = plan.manifest
    launches = m.get("launches") or {k: v["launches"] for k, v in m.get("entries", {}).items()}
    n = len(m["launches"]) if "launches" in m else sum(len(v["launches"]) for v in m["entries"].values())
    return {"n": n, "modules": [hashlib.sha256(plan.blob(mod["source"])).hexdigest()[:12] for mod in m["modules"]],
            "launches": hashlib.sha256(json.dumps(launches, sort_keys=True).encode()).hexdigest()[:16]}


def main() -> None:
    out = {}
    for name, dt in [("gpt2-small", "fp16"), ("bert-base", "fp16"), ("qwen3-0.6b", "bf16"), ("gpt2-small", "fp32")]:
        out[f"{name}:{dt}"] = digest(fusec.compile(name, dtype=dt, arch="sm_90", cuda_graph=True))
    for name in ("qwen3-tiny", "llama-tiny"):
        out[f"{name}:gen"] = digest(compile_generation(name, batch=2, max_seq_len=64, dtype="bf16", arch="sm_90"))
    print(json.dumps(out, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
