"""Cold compile time of built-in models, by stage: wall and CPU seconds (issue 13).

    python benchmarks/cold_compile.py OUT.json [--models qwen3-0.6b:bf16,gpt2-small:fp32] [--arch sm_90]
                                               [--repeat N] [--plan-dir DIR]

"Cold": each compile runs in a fresh process with an empty kernel cache (``FUSEC_CACHE_DIR`` set to
a new temporary directory), so no kernel or import is reused from an earlier compile. Stages come
from ``fusec.compile``'s progress callback: build (model and weights), each pass, kernels (lowering:
rendering, NVRTC, weight packing), then the plan write. Also records the kernel compiler's counters
(``fusec.codegen.compile.STATS``) and the plan file's sha256 (the plan must not change with speed
work). Writes JSON to OUT.json and prints one line per run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, os, sys, time
t0w, t0c = time.perf_counter(), time.process_time()
marks = []
def mark(stage, item):
    marks.append((stage, item, time.perf_counter() - t0w, time.process_time() - t0c))
import fusec
from fusec.codegen import compile as cc
model, dtype, arch, out = sys.argv[1:5]
mark("import", "fusec")
plan = fusec.compile(model, dtype=dtype, arch=arch, progress=mark)
mark("write", out)
plan.save(out)
mark("end", "")
print(json.dumps({"marks": marks, "stats": dict(cc.STATS), "launches": len(plan.manifest.get("launches", [])),
                  "modules": len(plan.manifest["modules"])}))
"""


def _phases(marks: list[list]) -> dict[str, dict[str, float]]:
    """Seconds (wall, cpu) from each mark to the next, summed by stage ("pass:<name>" for passes)."""
    out: dict[str, dict[str, float]] = {}
    prev = ("startup", "", 0.0, 0.0)
    for m in marks:
        stage = prev[0] if prev[0] != "pass" else f"pass:{prev[1]}"
        acc = out.setdefault(stage, {"wall": 0.0, "cpu": 0.0})
        acc["wall"] += m[2] - prev[2]
        acc["cpu"] += m[3] - prev[3]
        prev = m
    return {k: {"wall": round(v["wall"], 3), "cpu": round(v["cpu"], 3)} for k, v in out.items()}


def run_one(model: str, dtype: str, arch: str, plan_path: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="fusec-cold-") as cache:
        env = dict(os.environ, FUSEC_CACHE_DIR=cache)
        t0 = time.perf_counter()
        r0 = os.times()
        proc = subprocess.run([sys.executable, "-c", _CHILD, model, dtype, arch, plan_path], env=env,
                              capture_output=True, text=True)
        r1 = os.times()
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{model} {dtype}: compile failed:\n{proc.stderr[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    h = hashlib.sha256()
    with open(plan_path, "rb") as f:
        for chunk in iter(lambda: f.read(64 << 20), b""):
            h.update(chunk)
    return {"model": model, "dtype": dtype, "arch": arch, "wall_s": round(wall, 3),
            "cpu_s": round((r1.children_user - r0.children_user) + (r1.children_system - r0.children_system), 3),
            "phases": _phases(res["marks"]), "kernel_stats": res["stats"], "launches": res["launches"],
            "modules": res["modules"], "plan_sha256": h.hexdigest()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--models", default="qwen3-0.6b:bf16,gpt2-small:fp32,gpt2-small:fp16,bert-base:fp16,minilm:fp16")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--plan-dir", default=None, help="where the plans are written (default: a temporary dir)")
    args = ap.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="fusec-plans-") as tmp:
        pdir = args.plan_dir or tmp
        for item in args.models.split(","):
            model, _, dtype = item.partition(":")
            for i in range(args.repeat):
                path = os.path.join(pdir, f"{model}-{dtype or 'fp16'}.fplan")
                r = run_one(model, dtype or "fp16", args.arch, path)
                r["repeat"] = i
                runs.append(r)
                top = sorted(r["phases"].items(), key=lambda kv: -kv[1]["wall"])[:5]
                print(f"{model} {dtype}: wall {r['wall_s']:.1f}s cpu {r['cpu_s']:.1f}s  modules {r['modules']} "
                      f"launches {r['launches']}  nvrtc {r['kernel_stats'].get('compiled')}  sha {r['plan_sha256'][:12]}  "
                      + "  ".join(f"{k} {v['wall']:.1f}/{v['cpu']:.1f}" for k, v in top), flush=True)
    with open(args.out, "w") as f:
        json.dump({"cpu_count": os.cpu_count(), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
