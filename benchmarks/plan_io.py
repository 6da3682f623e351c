"""How fast a large plan file opens: ``fusec inspect`` and ``Plan.load`` time and peak RSS.

Builds a synthetic plan (gpt2-tiny's manifest and kernels with ``--gib`` GiB of weights; runs on
a machine without a GPU) or takes ``--plan PATH`` (e.g. ``fusec compile qwen3-0.6b -o q.fplan``),
then runs each measurement in a fresh process under ``/usr/bin/time -v``:

    python benchmarks/plan_io.py --gib 1
    python benchmarks/plan_io.py --plan q.fplan
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

LOAD = """
import sys, time
from fusec.plan import Plan
t0 = time.perf_counter()
p = Plan.load(sys.argv[1], verify=sys.argv[2])
t1 = time.perf_counter()
n = len(p.blob("weights"))
t2 = time.perf_counter()
print(f"load {t1 - t0:.2f} s, then first use of the weights (checksum) {t2 - t1:.2f} s")
"""


def synthetic(path: str, gib: float) -> None:
    import numpy as np

    import fusec
    from fusec.planfile import write_plan

    plan = fusec.compile("gpt2-tiny")
    m = dict(plan.manifest)
    blobs = plan.blobs()
    n = int(gib * 2**30)
    w = np.zeros(n, np.uint8)
    old = bytes(blobs["weights"])
    w[: len(old)] = np.frombuffer(old, np.uint8)
    w[len(old):: 4096] = 7  # not all zeros
    blobs["weights"] = w
    m["memory"] = dict(m["memory"], weights_bytes=n)
    write_plan(path, m, blobs)


def timed(argv: list[str]) -> tuple[str, str, str]:
    res = subprocess.run(["/usr/bin/time", "-v", *argv], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {res.stderr[-2000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", res.stderr).group(1)  # type: ignore[union-attr]
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr).group(1))  # type: ignore[union-attr]
    return wall, f"{rss / 1024:.0f} MiB", res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", help="an existing plan file")
    ap.add_argument("--gib", type=float, default=1.0, help="weights of the synthetic plan, GiB (default 1)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = args.plan or os.path.join(d, "big.fplan")
        if not args.plan:
            synthetic(path, args.gib)
        print(f"plan {path}: {os.path.getsize(path) / 2**30:.2f} GiB")
        for name, argv in [("fusec inspect", ["fusec", "inspect", path]),
                           ("Plan.load(verify='lazy')", [sys.executable, "-c", LOAD, path, "lazy"]),
                           ("Plan.load(verify='all')", [sys.executable, "-c", LOAD, path, "all"])]:
            wall, rss, note = timed(argv)
            print(f"{name:<26} wall {wall:>8}  peak RSS {rss:>9}  {note if 'load' in note else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
