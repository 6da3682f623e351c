// Helpers of the decode-step kernels (kv_attention, cache_write, sample). Needs common.cuh.
#pragma once

struct __align__(16) fc_u32x4 { fc_u32 x, y, z, w; };

// 16-byte read-only global load (the caches and logits are not written during the kernel).
__device__ __forceinline__ fc_u32x4 fc_ldg16(const void* p) {
  fc_u32x4 r;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
// 16-byte load of a weight streamed once per step: skips L1; volatile keeps it where it is written
// (ahead of fc_pdl_wait(), so that it overlaps the previous kernel).
__device__ __forceinline__ fc_u32x4 fc_ldw16(const void* p) {
  fc_u32x4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
// 16-byte load through L2 (never a line left in L1), volatile so it stays on its side of the PDL
// wait: kv_attention's cache rows when it loads the rows older than the step before the wait and the
// rows the kernel before it wrote after the wait (two rows may share a 128-byte line).
__device__ __forceinline__ fc_u32x4 fc_ldcg16(const void* p) {
  fc_u32x4 r;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ fc_u32x4 fc_zero16() { fc_u32x4 r; r.x = r.y = r.z = r.w = 0u; return r; }
__device__ __forceinline__ fc_u32 fc_word(const fc_u32x4& r, int i) { return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w; }

// The two 16-bit values of a word (lo: its low half) as fp32.
__device__ __forceinline__ void fc_unpack2(fc_u32 w, float& lo, float& hi, fc_bf16) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ void fc_unpack2(fc_u32 w, float& lo, float& hi, fc_half) {
  fc_half l, h;
  l.x = (unsigned short)(w & 0xffffu);
  h.x = (unsigned short)(w >> 16);
  lo = fc_val(l);
  hi = fc_val(h);
}

// The 16 / sizeof(T) values of a 16-byte chunk as fp32 (call with compile-time indices only).
__device__ __forceinline__ void fc_unpack16(const fc_u32x4& r, float* out, float) {
  out[0] = __uint_as_float(r.x); out[1] = __uint_as_float(r.y);
  out[2] = __uint_as_float(r.z); out[3] = __uint_as_float(r.w);
}
__device__ __forceinline__ void fc_unpack16(const fc_u32x4& r, float* out, fc_bf16) {
#pragma unroll
  for (int i = 0; i < 4; ++i) fc_unpack2(fc_word(r, i), out[2 * i], out[2 * i + 1], fc_bf16());
}
__device__ __forceinline__ void fc_unpack16(const fc_u32x4& r, float* out, fc_half) {
#pragma unroll
  for (int i = 0; i < 4; ++i) fc_unpack2(fc_word(r, i), out[2 * i], out[2 * i + 1], fc_half());
}

// numpy.argmax order: NaN beats everything, then larger values; ties go to the lower index.
__device__ __forceinline__ bool fc_argmax_better(float a, int ia, float b, int ib) {
  const bool an = a != a, bn = b != b;
  if (an || bn) return an && (!bn || ia < ib);
  return a > b || (a == b && ia < ib);
}

// Block-wide argmax (blockDim.x a multiple of 32); every thread gets the winner (value, index).
__device__ __forceinline__ void fc_block_argmax(float& v, int& i, float* sv, int* si) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    const int j = __shfl_xor_sync(0xffffffffu, i, o);
    if (fc_argmax_better(w, j, v, i)) { v = w; i = j; }
  }
  if (lane == 0) { sv[warp] = v; si[warp] = i; }
  __syncthreads();
  v = lane < nwarps ? sv[lane] : -__int_as_float(0x7f800000);
  i = lane < nwarps ? si[lane] : 0x7fffffff;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    const int j = __shfl_xor_sync(0xffffffffu, i, o);
    if (fc_argmax_better(w, j, v, i)) { v = w; i = j; }
  }
  __syncthreads();
}

// Exclusive suffix sum over the threads of a block: sum of `x` over threads with a larger index.
__device__ __forceinline__ unsigned long long fc_block_suffix_excl(unsigned long long x, unsigned long long* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  unsigned long long s = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long y = __shfl_down_sync(0xffffffffu, s, o);
    if (lane + o < 32) s += y;
  }
  if (lane == 0) scratch[warp] = s;  // the warp's total
  __syncthreads();
  unsigned long long above = 0;
  for (int w = warp + 1; w < nwarps; ++w) above += scratch[w];
  __syncthreads();
  return s - x + above;
}

// Order-preserving map of fp32 to uint32 (larger float -> larger key); -0.0 must be made +0.0 first.
__device__ __forceinline__ fc_u32 fc_fkey(float f) {
  const fc_u32 u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// splitmix64's finalizer (fusec/sampling.py mix64).
__device__ __forceinline__ unsigned long long fc_mix64(unsigned long long x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

// ---- Op.SAMPLE (fusec/sampling.py): the row's settings and its Gumbel noise ----

// z = x / temperature in fp32, -0 made +0 (numpy compares -0 == 0; the keys must too).
__device__ __forceinline__ float fc_sample_z(float x, float temp) {
  const float z = x / temp;
  return z == 0.f ? 0.f : z;
}

// A row samples with a cut: temperature > 0 and (0 < top_k < V or top_p < 1).
__device__ __forceinline__ bool fc_sample_cut(float temp, long long k, float p, int vocab) {
  return temp != 0.f && ((k > 0 && k < (long long)vocab) || p < 1.f);
}

// The row's noise key: mix64(seed + GOLDEN * (counter + 1)) (sampling.py row_key).
__device__ __forceinline__ unsigned long long fc_sample_key(long long seed, long long counter) {
  return fc_mix64((unsigned long long)seed + 0x9E3779B97F4A7C15ull * ((unsigned long long)counter + 1ull));
}

// z + g(key, idx): g = -log(-log(u)), u = 23 random bits + 0.5 over 2^23 (exact in fp32, never 0 or 1).
__device__ __forceinline__ float fc_gumbel_score(float z, int idx, unsigned long long key) {
  const unsigned long long r = fc_mix64(key ^ ((unsigned long long)idx * 0x8CB92BA72F3D8DD7ull + 1ull));
  const float u = ((float)(unsigned)(r >> 41) + 0.5f) * (1.0f / 8388608.0f);
  return z + -logf(-logf(u));
}

