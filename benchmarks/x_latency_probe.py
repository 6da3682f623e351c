"""Does a small L2-resident load (a product's x, read after its PDL wait) wait behind the weight bytes the SM
already has in flight, and does it matter how those weights were asked for?

Each block (2 an SM, 256 threads, like the dp4a form's wave) first asks for BYTES of cold weights (DRAM: every
launch reads a fresh slice of a 2 GiB buffer), then at once loads 16 KB of x that an earlier launch left in L2, and
times (SM clock) how long x took to arrive and how long the weights took. The weights are asked for:

- none: no weights (x's latency alone, L2 idle but for x);
- ld: plain 16-byte global loads into registers (the dp4a form's way);
- cp_async: 16-byte cp.async into shared memory (the tensor-core form's way);
- bulk: one TMA bulk copy a 4 KB piece into shared memory, completing on an mbarrier (the bf16 ring's way);
- ld_drained: as ld, but x is asked for only once the weights have arrived (x's latency with nothing queued).
- l2_prefetch: one `cp.async.bulk.prefetch.L2` a 4 KB piece (nothing returns to the SM), then x, then the same
  pieces by TMA bulk copies from L2 into shared memory ("weights in" times both).

    python benchmarks/x_latency_probe.py [--bytes 16384,32768] [--launches 20]

Prints a table of medians (us, at the SM clock the run measured) over blocks and launches.
"""

from __future__ import annotations

import argparse
import statistics

SRC = r"""
#define NT 256
#define XU 4  // uint4 of x a thread: 256 x 4 x 16 = 16 KB
__device__ __forceinline__ long long clk() { long long t; asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)); return t; }
__device__ __forceinline__ void keep(unsigned v) { asm volatile("" :: "r"(v)); }
// volatile: issued in program order against the clock reads (the point is which loads are in flight first)
__device__ __forceinline__ uint4 ldg(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

extern "C" __global__ void __launch_bounds__(NT, 2) probe(const uint4* __restrict__ W, const uint4* __restrict__ X,
                                                          int mode, int units, long long* out) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) unsigned long long bar;
  const uint4* w = W + (size_t)blockIdx.x * units * NT;  // this block's cold weights: units x 4 KB
  const unsigned sbar = (unsigned)__cvta_generic_to_shared(&bar);
  if ((mode == 3 || mode == 5) && threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared.b64 [%0], 1;" :: "r"(sbar));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  uint4 r[16];
  const long long t0 = clk();
  if (mode == 1 || mode == 4) {
#pragma unroll
    for (int i = 0; i < 16; ++i) if (i < units) r[i] = ldg(w + i * NT + threadIdx.x);
  } else if (mode == 2) {
#pragma unroll
    for (int i = 0; i < 16; ++i) if (i < units) {
      const unsigned d = (unsigned)__cvta_generic_to_shared(ring + (i * NT + threadIdx.x) * 16);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(w + i * NT + threadIdx.x));
    }
    asm volatile("cp.async.commit_group;");
  } else if (mode == 3 && threadIdx.x == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" :: "r"(sbar), "r"(units * 4096));
    for (int i = 0; i < units; ++i) {
      const unsigned d = (unsigned)__cvta_generic_to_shared(ring + i * 4096);
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];"
                   :: "r"(d), "l"(w + i * NT), "r"(sbar) : "memory");
    }
  }
  if (mode == 5 && threadIdx.x == 0) {
    for (int i = 0; i < units; ++i)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], 4096;" :: "l"(w + i * NT) : "memory");
  }
  unsigned s = 0;
  if (mode == 4) {  // the weights first: x then finds nothing queued ahead of it
#pragma unroll
    for (int i = 0; i < 16; ++i) if (i < units) s ^= r[i].x ^ r[i].w;
    keep(s);
  }
  const long long t1 = clk();
  uint4 xv[XU];
#pragma unroll
  for (int j = 0; j < XU; ++j) xv[j] = ldg(X + j * NT + threadIdx.x);
#pragma unroll
  for (int j = 0; j < XU; ++j) s ^= xv[j].x ^ xv[j].y ^ xv[j].z ^ xv[j].w;
  keep(s);
  const long long t2 = clk();
  if (mode == 1) {
#pragma unroll
    for (int i = 0; i < 16; ++i) if (i < units) s ^= r[i].x ^ r[i].w;
  } else if (mode == 2) {
    asm volatile("cp.async.wait_all;" ::: "memory");
    s ^= *reinterpret_cast<const unsigned*>(ring + threadIdx.x * 16);
  } else if (mode == 3 || mode == 5) {
    if (mode == 5 && threadIdx.x == 0) {  // x is in: now the pieces, from L2 where the prefetch got them there
      asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" :: "r"(sbar), "r"(units * 4096));
      for (int i = 0; i < units; ++i) {
        const unsigned d = (unsigned)__cvta_generic_to_shared(ring + i * 4096);
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];"
                     :: "r"(d), "l"(w + i * NT), "r"(sbar) : "memory");
      }
    }
    unsigned done = 0;
    while (!done) asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                               : "=r"(done) : "r"(sbar) : "memory");
    s ^= *reinterpret_cast<const unsigned*>(ring + threadIdx.x * 16);
  }
  keep(s);
  const long long t3 = clk();
  __syncthreads();
  if (threadIdx.x == 0) {
    out[blockIdx.x * 3 + 0] = t2 - t1;  // x's latency
    out[blockIdx.x * 3 + 1] = t3 - t0;  // until the weights were in
    out[blockIdx.x * 3 + 2] = s == 0x12345678u;  // keeps s
  }
}
"""

MODES = {"none": 0, "ld": 1, "cp_async": 2, "bulk": 3, "ld_drained": 4, "l2_prefetch": 5}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="16384,32768", help="cold weight bytes a block asks for (4 KB steps, <= 64 KB)")
    ap.add_argument("--launches", type=int, default=20)
    args = ap.parse_args()
    import cupy as cp

    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    khz = dev.attributes["ClockRate"]
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    k = mod.get_function("probe")
    blocks = 2 * sms
    big = cp.zeros(2 << 30, dtype=cp.uint8)
    x = cp.ones(16384, dtype=cp.uint8)
    out = cp.zeros(blocks * 3, dtype=cp.int64)
    print(f"{blocks} blocks of 256 threads (2 an SM, {sms} SMs); SM clock attribute {khz / 1e3:.0f} MHz; "
          "x 16 KB a block from L2; medians over blocks and launches, us at that clock")
    print("| weights a block | mode | x arrived after (us) | weights in after (us) |")
    print("|---|---|---|---|")
    for nbytes in map(int, args.bytes.split(",")):
        units = nbytes // 4096
        smem = max(units, 1) * 4096
        k.max_dynamic_shared_size_bytes = smem
        per_launch = blocks * units * 4096
        for name, mode in MODES.items():
            xs, ws = [], []
            for i in range(args.launches + 2):
                off = (i * per_launch) % (big.nbytes - per_launch)  # a fresh, cold slice each launch
                off -= off % 4096
                k((blocks,), (256,), (big[off:], x, cp.int32(mode), cp.int32(units if mode else 0), out),
                  shared_mem=smem)
                cp.cuda.Device().synchronize()
                if i < 2:
                    continue
                o = out.reshape(blocks, 3).get()
                xs.extend(o[:, 0].tolist())
                ws.extend(o[:, 1].tolist())
            us = 1e3 / khz
            print(f"| {nbytes // 1024} KB | {name} | {statistics.median(xs) * us:.2f} "
                  f"(p90 {sorted(xs)[int(0.9 * len(xs))] * us:.2f}) | {statistics.median(ws) * us:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
