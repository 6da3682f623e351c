"""How fast the SMs read a buffer that stays in L2 against one that does not: a grid-stride kernel of 16-byte loads
(8 blocks of 256 threads an SM) reads a buffer again and again; GB/s by buffer size, CUDA events over 50 launches
after 5 warm-ups, each launch reading the buffer enough times to read >= 512 MB. After the first launch a buffer
smaller than the L2 (the H200's 50 MB, two partitions) is read from L2; 4 GB are read from HBM. Tells how much faster
an L2-resident weight can arrive (benchmarks/l2_bound.py's hot variant). CUDA only.

    python benchmarks/l2_rate.py [--sizes-mb 8,16,24,32,48,4096]
"""

from __future__ import annotations

import argparse
import json

SRC = r"""
extern "C" __global__ void rd(const ulonglong2* __restrict__ p, long long n, int reps, unsigned long long* out) {
  unsigned long long acc = 0;
  for (int r = 0; r < reps; ++r)
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const ulonglong2 v = __ldcg(p + i);
    acc ^= v.x ^ v.y;
  }
  if (acc == 0x1234567ull) out[0] = acc;  // a use of every load (random data: practically never stored)
}
"""


def main() -> int:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="8,16,24,32,48,4096")
    args = ap.parse_args()
    k = cp.RawKernel(SRC, "rd")
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    out = cp.zeros(1, cp.uint64)
    for mb in map(int, args.sizes_mb.split(",")):
        n = mb * (1 << 20) // 16
        buf = cp.random.default_rng(1).integers(0, 2**31, n * 4, dtype=cp.uint32).view(cp.uint64).reshape(-1, 2)
        grid, block = (sms * 8,), (256,)
        reps = max(1, 512 // mb)  # each launch reads at least 512 MB: its launch and ramp are a small share
        for _ in range(5):
            k(grid, block, (buf, cp.int64(n), cp.int32(reps), out))
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(50):
            k(grid, block, (buf, cp.int64(n), cp.int32(reps), out))
        b.record()
        b.synchronize()
        us = cp.cuda.get_elapsed_time(a, b) * 1e3 / 50
        print(json.dumps({"mb": mb, "reps": reps, "us": round(us, 2), "GB/s": round(reps * n * 16 / us / 1e3, 1)}),
              flush=True)
        del buf
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
