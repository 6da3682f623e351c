"""The SMs' clock while a decode step replays: a one-block kernel spins a fixed number of SM cycles (clock64) and
reads %globaltimer around them, launched alone and between decode steps, so cycles / ns is the clock the kernels
run at. Also nvidia-smi's reported SM clock while the steps replay.

    python benchmarks/sm_clock.py [--model qwen3-0.6b]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SRC = r"""
extern "C" __global__ void spin(long long cycles, unsigned long long* out) {
  unsigned long long t0, t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long c0 = clock64();
  while (clock64() - c0 < cycles) { }
  const long long c1 = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  out[0] = (unsigned long long)(c1 - c0);
  out[1] = t1 - t0;
}
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    args = ap.parse_args()
    import cupy as cp

    spin = cp.RawKernel(SRC, "spin")
    out = cp.zeros(2, cp.uint64)

    def ghz(cycles: int) -> float:
        spin((1,), (32,), (cp.int64(cycles), out))
        cp.cuda.runtime.deviceSynchronize()
        c, ns = (int(v) for v in out.get())
        return c / ns

    print("spin alone, GHz by length (cycles):", {n: round(ghz(n), 3) for n in (2_000, 20_000, 200_000, 2_000_000)})
    from decode_step import _engine, model

    from fusec.compiler import compile_generation

    gm = model(args.model)
    plan = compile_generation(gm, batch=1, max_seq_len=288, prefill_len=128, dtype="bf16", eos_ids=[])
    path = os.path.join(tempfile.mkdtemp(), "b1.fplan")
    plan.save(path)
    plan, eng, start = _engine(path, True, 1, warm=True)
    smi: list[str] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            r = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.applications.graphics,power.draw",
                                "--format=csv,noheader"], capture_output=True, text=True)
            smi.append(r.stdout.strip())
            stop.wait(0.2)  # not a busy loop of processes beside the steps being timed

    th = threading.Thread(target=poll)
    th.start()
    rates = []
    for i in range(60):  # 100 steps a prefill: the cache holds 160 more tokens
        start()
        for _ in range(5):
            for _ in range(20):
                eng.decode()
            spin((1,), (32,), (cp.int64(20_000), out), stream=eng.stream)
        if i % 6 == 0:
            eng.sync()
            c, ns = (int(v) for v in out.get())
            rates.append(round(c / ns, 3))
    eng.sync()
    stop.set()
    th.join()
    print("spin between decode steps, GHz:", rates)
    print("nvidia-smi while the steps replay (sm, max sm, applications, power):", smi[:3], smi[-3:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
