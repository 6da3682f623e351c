// fusec common device helpers. Self-contained on purpose: no CUDA headers, so NVRTC needs no
// include path and the kernel cache key (source, options, arch, NVRTC version) fixes the binary.
// Storage types: float, fc_half, fc_bf16, long long, int, bool. fp16/bf16 compute in fp32.
#pragma once

typedef unsigned int fc_u32;

struct __align__(2) fc_half { unsigned short x; };
struct __align__(2) fc_bf16 { unsigned short x; };

// A vector of N elements moved as one (up to 16-byte) access; the caller guarantees alignment.
template <class T, int N> struct __align__(sizeof(T) * N) fc_vec { T v[N]; };

// ---- element -> compute value ------------------------------------------------------------
__device__ __forceinline__ float fc_val(float v) { return v; }
__device__ __forceinline__ float fc_val(fc_half h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x));
  return f;
}
__device__ __forceinline__ float fc_val(fc_bf16 h) { return __uint_as_float(((fc_u32)h.x) << 16); }
__device__ __forceinline__ long long fc_val(long long v) { return v; }
// max(a, b), NaN where either is (fmaxf drops a NaN operand; max.NaN is sm_80's, fusec's oldest arch)
__device__ __forceinline__ float fc_fmax_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
__device__ __forceinline__ int fc_val(int v) { return v; }
__device__ __forceinline__ bool fc_val(bool v) { return v; }

// ---- compute value -> element (round to nearest even) ------------------------------------
__device__ __forceinline__ fc_half fc_to_half(float f) {
  fc_half h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(f));
  return h;
}
__device__ __forceinline__ fc_bf16 fc_to_bf16(float f) {
  fc_bf16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.x) : "f"(f));
  return h;
}
__device__ __forceinline__ void fc_set(float& d, float v) { d = v; }
__device__ __forceinline__ void fc_set(fc_half& d, float v) { d = fc_to_half(v); }
__device__ __forceinline__ void fc_set(fc_bf16& d, float v) { d = fc_to_bf16(v); }
__device__ __forceinline__ void fc_set(long long& d, long long v) { d = v; }
__device__ __forceinline__ void fc_set(int& d, int v) { d = v; }
__device__ __forceinline__ void fc_set(bool& d, bool v) { d = v; }

// Round an fp32 value to the precision of a storage type (what storing and reloading would do).
__device__ __forceinline__ float fc_round_f16(float f) { return fc_val(fc_to_half(f)); }
__device__ __forceinline__ float fc_round_bf16(float f) { return fc_val(fc_to_bf16(f)); }

// Round two fp32 values to bfloat16's precision at once, as two fc_round_bf16 would: one packed cvt (F2FP) instead
// of two F2F, which run on the conversion pipe.
__device__ __forceinline__ void fc_round_bf16x2(float& lo, float& hi) {
  fc_u32 p;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(hi), "f"(lo));
  lo = __uint_as_float(p << 16);
  hi = __uint_as_float(p & 0xffff0000u);
}

// NaN of a storage type (0 / false for integers and bools): the fill for out-of-range gathers.
template <class T> __device__ __forceinline__ T fc_nan();
template <> __device__ __forceinline__ float fc_nan<float>() { return __int_as_float(0x7fffffff); }
template <> __device__ __forceinline__ fc_half fc_nan<fc_half>() { fc_half h; h.x = 0x7e00; return h; }
template <> __device__ __forceinline__ fc_bf16 fc_nan<fc_bf16>() { fc_bf16 h; h.x = 0x7fc0; return h; }
template <> __device__ __forceinline__ long long fc_nan<long long>() { return 0; }
template <> __device__ __forceinline__ int fc_nan<int>() { return 0; }
template <> __device__ __forceinline__ bool fc_nan<bool>() { return false; }

// ---- numpy-compatible math ---------------------------------------------------------------
// np.maximum / np.minimum propagate NaN; fmaxf / fminf do not.
__device__ __forceinline__ float fc_max(float a, float b) { return a != a ? a : (b != b ? b : (a > b ? a : b)); }
__device__ __forceinline__ float fc_min(float a, float b) { return a != a ? a : (b != b ? b : (a < b ? a : b)); }
template <class T> __device__ __forceinline__ T fc_max(T a, T b) { return a > b ? a : b; }
template <class T> __device__ __forceinline__ T fc_min(T a, T b) { return a < b ? a : b; }
__device__ __forceinline__ float fc_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float fc_gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f)); }
// The same GELU for a half-precision result: x * Phi(x), Phi from erfc(|x| / sqrt(2)) = 2^q(t), q = t * P(t) with P of
// degree 8 (least squares on [0, 4]: erfc's relative error < 1.1e-5, against a half's 4.9e-4 rounding step, and a
// negative x keeps its relative accuracy, which 1 + erff(x) loses), erfc = 0 past t = 4 (there |GELU(x)| of a
// negative x is under 6e-8: below fp16's smallest step, and where 1 + erff rounds to 0 too). BERT-base's bias + GELU
// kernel: 26 instructions a value against 32 with erff, 16.0 us against 19.8 alone (H200; a copy of its bytes 13.8).
__device__ __forceinline__ float fc_gelu_erf16(float x) {
  const float t = fabsf(x) * 0.7071067811865476f, u = fminf(t, 4.0f);
  float p = 2.739596084e-06f;
  p = fmaf(p, u, -4.933184391e-05f);
  p = fmaf(p, u, 3.490508243e-04f);
  p = fmaf(p, u, -9.998425376e-04f);
  p = fmaf(p, u, -1.761473948e-03f);
  p = fmaf(p, u, 2.922284603e-02f);
  p = fmaf(p, u, -1.489351541e-01f);
  p = fmaf(p, u, -9.183322787e-01f);
  p = fmaf(p, u, -1.627911925e+00f);
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(p * u));  // erfc(t)
  e = t < 4.0f ? 0.5f * e : 0.0f;  // Phi(-|x|)
  return x * (x < 0.0f ? e : 1.0f - e);
}
__device__ __forceinline__ float fc_gelu_tanh(float x) {
  return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// ---- reductions --------------------------------------------------------------------------
__device__ __forceinline__ float fc_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float fc_warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ long long fc_warp_sum(long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ double fc_warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide sum / max for blockDim.x a multiple of 32 (<= 1024). `scratch` holds 32 values; the
// trailing barrier lets the caller reuse it for the next reduction.
template <class T> __device__ __forceinline__ T fc_block_sum(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = fc_warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = lane < nwarps ? scratch[lane] : T(0);
  r = fc_warp_sum(r);
  __syncthreads();
  return r;
}
__device__ __forceinline__ long long fc_warp_max(long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const long long w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}
// `lowest` is the identity of max (-inf for floats); it fills the lanes past the last warp.
template <class T> __device__ __forceinline__ T fc_block_max(T v, T* scratch, T lowest) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = fc_warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = lane < nwarps ? scratch[lane] : lowest;
  r = fc_warp_max(r);
  __syncthreads();
  return r;
}

// Block timestamps for benchmarks/block_trace.py (FUSEC_TRACE compiles with -DFC_TRACE): per block
// (linear index, at most FC_TRACE_BLOCKS), [start, at the PDL wait, after it, end, SM, phase 1, ..., 5];
// all from thread 0 but the end: the latest exit of a warp's lane 0 (atomicMax: a replay's times only
// grow). A template marks the phases of its work after the wait with FC_TRACE_PHASE(1..5).
#ifdef FC_TRACE
#define FC_TRACE_BLOCKS 8192
#define FC_TRACE_SLOTS 10
__device__ unsigned long long fc_trace[FC_TRACE_BLOCKS * FC_TRACE_SLOTS];
__device__ __forceinline__ unsigned long long fc_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned fc_block_id() {
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}
__device__ __forceinline__ void fc_trace_mark(int slot) {
  const unsigned b = fc_block_id();
  if (threadIdx.x == 0 && threadIdx.y == 0 && b < FC_TRACE_BLOCKS) fc_trace[b * FC_TRACE_SLOTS + slot] = fc_now();
}
struct FcTraceScope {
  __device__ FcTraceScope() {
    const unsigned b = fc_block_id();
    if (threadIdx.x == 0 && threadIdx.y == 0 && b < FC_TRACE_BLOCKS) {
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      fc_trace[b * FC_TRACE_SLOTS] = fc_now();
      fc_trace[b * FC_TRACE_SLOTS + 4] = sm;
    }
  }
  __device__ ~FcTraceScope() {
    const unsigned b = fc_block_id();
    if (b < FC_TRACE_BLOCKS && (threadIdx.x & 31) == 0) atomicMax(&fc_trace[b * FC_TRACE_SLOTS + 3], fc_now());
  }
};
#define FC_TRACE_SCOPE FcTraceScope fc_trace_scope_
#define FC_TRACE_AT_WAIT() fc_trace_mark(1)
#define FC_TRACE_WAITED() fc_trace_mark(2)
#define FC_TRACE_PHASE(n) fc_trace_mark(4 + (n))
#else
#define FC_TRACE_SCOPE
#define FC_TRACE_AT_WAIT()
#define FC_TRACE_WAITED()
#define FC_TRACE_PHASE(n) do { } while (0)
#endif

// ---- thread block clusters (sm_90) -------------------------------------------------------------
// The block's rank; a barrier of the whole cluster (release/acquire: shared-memory writes before it
// are seen by the cluster's blocks after it), or its two halves apart (an arrive that orders nothing,
// a wait); the address of a shared variable in block `rank`, 32/64-bit stores and 4-float loads there (a
// variable maps whole: offsets within it hold in the other block).
__device__ __forceinline__ unsigned fc_cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void fc_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}
__device__ __forceinline__ void fc_cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
}
// an arrive after which this thread's earlier accesses (loads from another block's shared memory included) are
// performed: a block that waits on it may then leave, its shared memory going to the next block
__device__ __forceinline__ void fc_cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
}
__device__ __forceinline__ void fc_cluster_wait() {
  asm volatile("barrier.cluster.wait;" ::: "memory");
}
__device__ __forceinline__ unsigned fc_cluster_addr(const void* p, unsigned rank) {
  unsigned a = (unsigned)__cvta_generic_to_shared(p), r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
__device__ __forceinline__ void fc_st_cluster(unsigned addr, unsigned v) {
  asm volatile("st.shared::cluster.u32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void fc_st_cluster2(unsigned addr, unsigned a, unsigned b) {
  asm volatile("st.shared::cluster.v2.u32 [%0], {%1, %2};" :: "r"(addr), "r"(a), "r"(b) : "memory");
}
__device__ __forceinline__ float4 fc_ld_cluster4(unsigned addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
  return v;
}

// ---- programmatic dependent launch (sm_90+; no-ops elsewhere) ---------------------------------
// A kernel launched with programmatic stream serialization may start while the kernel before it
// still runs. It loads only what no earlier kernel writes (weights, constants), calls
// fc_pdl_wait() before its first access to anything else (the wait returns once every earlier
// kernel has completed and its writes are visible), then fc_pdl_trigger(): the kernel after it may
// now be scheduled. Triggering only after the wait keeps one kernel ahead at most. Launched
// plainly, both are no-ops. The "memory" clobbers keep the compiler from moving loads or stores
// across them.
__device__ __forceinline__ void fc_pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void fc_pdl_wait() {
  FC_TRACE_AT_WAIT();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  FC_TRACE_WAITED();
}
// The wait, after the loads issued before it: ptxas schedules griddepcontrol.wait as early as it
// can, above loads it sees no dependency on (seen in the SASS: ACQBULK first, the weight loads after
// it, so nothing overlapped the previous kernel). A branch pins it: the wait runs on either side, but
// only once the branch's value is known. That value is a clock read: ptxas moves no instruction across
// it (nvdisasm, sm_90: the same loads sit before ACQBULK in every dp4a, attention and dequantizing
// kernel of the 1B Q8_0 and Q4_K_M plans, where a plain wait had Q8_0's loads after it), so the loads
// issue before the wait, which does not wait for their values: a block that starts late begins its
// work after the wait while its weights are in flight. With FC_PDL_PIN_VALUE (FUSEC_PDL_PIN=value)
// the value is `dep`, an opaque function of every load, so the wait comes once they have returned
// (1.2% slower in the 1B Q4_K_M decode step, 1.9% at 7B, 2.9% in Q8_0; H200, sixteenth session).
__device__ __forceinline__ void fc_pdl_wait_after(fc_u32 dep) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#if !defined(FC_PDL_PIN_VALUE)
  dep = (fc_u32)clock();
#endif
  asm volatile("" : "+r"(dep));
  if (dep == 0x9e3779b9u) {
    FC_TRACE_AT_WAIT();  // once the branch's value is known (FC_PDL_PIN_VALUE: the pinned loads have returned)
    asm volatile("griddepcontrol.wait;" ::: "memory");
  } else {
    FC_TRACE_AT_WAIT();
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
#endif
  FC_TRACE_WAITED();
}
