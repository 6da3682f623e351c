// Tensor-core helpers for sm_80+: mma.sync m16n8k16 (fp16/bf16 in, fp32 accumulate), ldmatrix,
// cp.async. Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), g = lane >> 2,
// t = lane & 3:
//   A 16x16 row-major: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B 16x8  "col":     b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C 16x8  fp32:      c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
// Each 32-bit register holds two 16-bit values, the lower k (or column) in the low half.
#pragma once

__device__ __forceinline__ void fc_mma16816(float c[4], const fc_u32 a[4], const fc_u32 b[2], fc_half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void fc_mma16816(float c[4], const fc_u32 a[4], const fc_u32 b[2], fc_bf16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// m16n8k8 with fp16/bf16 in: A 16x8 row-major a0 = (g, 2t..2t+1), a1 = (g+8, 2t..); B 8x8 "col" b = (k 2t..2t+1, n g)
__device__ __forceinline__ void fc_mma_k8(float c[4], const fc_u32 a[2], fc_u32 b, fc_half) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(b));
}
__device__ __forceinline__ void fc_mma_k8(float c[4], const fc_u32 a[2], fc_u32 b, fc_bf16) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(b));
}

// tf32 (sm_80+): fp32 rounded to 10 mantissa bits (low 13 bits zero), and mma.sync m16n8k8 with
// fp32 accumulate. Fragments (PTX ISA, m16n8k8 .tf32), one 32-bit element per register:
//   A 16x8 row-major: a0 = (g, t), a1 = (g+8, t), a2 = (g, t+4), a3 = (g+8, t+4)
//   B 8x8 "col":      b0 = (k t, n g), b1 = (k t+4, n g);  C as for m16n8k16.
__device__ __forceinline__ fc_u32 fc_tf32(float x) {
  fc_u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void fc_mma1688(float c[4], const fc_u32 a[4], const fc_u32 b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two fp32 values -> one register of two 16-bit values (lo in the low half). cvt's first source
// goes to the upper half.
__device__ __forceinline__ fc_u32 fc_pack2(float lo, float hi, fc_half) {
  fc_u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ fc_u32 fc_pack2(float lo, float hi, fc_bf16) {
  fc_u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ fc_u32 fc_smem_addr(const void* p) {
  return (fc_u32)__cvta_generic_to_shared(p);
}

// A fragment of a 16x16 tile stored row-major in shared memory (k contiguous), `ld` elements per
// row, rows 16-byte aligned. Lanes 0-15 address rows 0-15 at k0, lanes 16-31 rows 0-15 at k0+8,
// so the four 8x8 matrices land in a0..a3 in the order above.
__device__ __forceinline__ void fc_ldsm_a(fc_u32 a[4], const unsigned short* tile, int ld, int lane) {
  const unsigned short* p = tile + (lane & 15) * ld + ((lane >> 4) << 3);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(fc_smem_addr(p)));
}

// B fragment of a 16(k) x 8(n) tile stored k-major in shared memory ([k][n], n contiguous, `ld`
// elements per k row): ldmatrix .trans hands lane (g, t) the elements (k 2t..2t+1, n g).
// Lanes 0-7 address k rows 0-7, lanes 8-15 rows 8-15 (lanes 16-31 are ignored by .x2).
__device__ __forceinline__ void fc_ldsm_b_trans(fc_u32 b[2], const unsigned short* tile, int ld, int lane) {
  const unsigned short* p = tile + (lane & 15) * ld;
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(b[0]), "=r"(b[1]) : "r"(fc_smem_addr(p)));
}

// B fragments of two 16(k) x 8(n) tiles side by side in n (n0.., n0 + 8..), stored k-major as above: one
// ldmatrix .x4 .trans. Lanes 16-31 address the second tile's k rows; b[0..1] is the first tile's, b[2..3] the second's.
__device__ __forceinline__ void fc_ldsm_b_trans2(fc_u32 b[4], const unsigned short* tile, int ld, int lane) {
  const unsigned short* p = tile + (lane & 15) * ld + ((lane >> 4) << 3);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(fc_smem_addr(p)));
}

// B fragments of two consecutive 16(k) x 8(n) tiles (k0.., k0 + 16..) stored n-major ([n][k], k contiguous, rows
// 16-byte aligned): one ldmatrix .x4 without .trans, each 8x8 matrix an n row's 8 consecutive k. Lane (g, t) gets
// (n g, k 2t..2t+1) of each: b[0..1] the first k tile's fragment, b[2..3] the second's (the pairs fc_lds_b_nk loads).
__device__ __forceinline__ void fc_ldsm_b_nk2(fc_u32 b[4], const unsigned short* tile, int ld, int lane) {
  const unsigned short* p = tile + (lane & 7) * ld + ((lane >> 3) << 3);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(fc_smem_addr(p)));
}

// B fragment of a 16(k) x 8(n) tile stored n-major ([n][k], k contiguous): two 32-bit loads.
__device__ __forceinline__ void fc_lds_b_nk(fc_u32 b[2], const unsigned short* tile, int ld, int lane) {
  const int g = lane >> 2, t = lane & 3;
  b[0] = *reinterpret_cast<const fc_u32*>(tile + g * ld + 2 * t);
  b[1] = *reinterpret_cast<const fc_u32*>(tile + g * ld + 2 * t + 8);
}

// 16-byte global -> shared copy that bypasses registers; src_bytes < 16 zero-fills the rest
// (0 = pure zero fill, used for out-of-range rows: the source address must still be valid). The copy
// and the wait are compiler memory barriers: a read of a slot stays between the wait for its copy and
// the next copy into it (a thread reusing its own slots needs no other fence).
__device__ __forceinline__ void fc_cp_async16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(fc_smem_addr(smem)), "l"(gmem), "r"(src_bytes)
               : "memory");
}
// The same with an L2 cache policy (fc_l2_evict_first): bytes read once (a decode step's weights) leave L2 before
// what is read again soon (activations, caches, code).
__device__ __forceinline__ void fc_cp_async16_l2(void* smem, const void* gmem, int src_bytes, unsigned long long pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
               :: "r"(fc_smem_addr(smem)), "l"(gmem), "r"(src_bytes), "l"(pol) : "memory");
}
// An L2 policy under which the lines a copy brings in are the first evicted (sm_80+).
__device__ __forceinline__ unsigned long long fc_l2_evict_first() {
  unsigned long long pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void fc_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void fc_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// TMA bulk copies (sm_90+): one thread copies a contiguous range global -> shared (16-byte aligned, a
// multiple of 16 bytes) and the transfer completes on an mbarrier, which the readers wait on by phase.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void fc_mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(fc_smem_addr(bar)), "r"(count) : "memory");
}
// after the inits, before any thread or copy uses the barriers (then a __syncthreads)
__device__ __forceinline__ void fc_mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
}
// the one arrival of this phase, announcing the bytes the copies will complete on it
__device__ __forceinline__ void fc_mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(fc_smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void fc_bulk_copy(void* smem, const void* gmem, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               :: "r"(fc_smem_addr(smem)), "l"(gmem), "r"(bytes), "r"(fc_smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void fc_bulk_copy_l2(void* smem, const void* gmem, unsigned bytes, unsigned long long* bar,
                                                unsigned long long pol) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n"
               :: "r"(fc_smem_addr(smem)), "l"(gmem), "r"(bytes), "r"(fc_smem_addr(bar)), "l"(pol) : "memory");
}
// until the barrier's phase `parity` (0, 1, 0, ...: its uses in order) has completed; CLUSTER: acquiring, for the
// whole cluster, what the arrivals of its blocks released (fc_mbar_arrive_cluster)
template <bool CLUSTER = false> __device__ __forceinline__ void fc_mbar_wait(unsigned long long* bar, unsigned parity) {
  unsigned done = 0;
  while (!done) {
    if (CLUSTER)
      asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                   "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(fc_smem_addr(bar)), "r"(parity) : "memory");
    else
      asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done) : "r"(fc_smem_addr(bar)), "r"(parity) : "memory");
  }
}
// an arrival on the mbarrier at cluster address `addr` (fc_cluster_addr: another block's or this one's), releasing to
// the cluster what this thread wrote before it (after a __syncthreads: what the block's threads wrote)
__device__ __forceinline__ void fc_mbar_arrive_cluster(unsigned addr) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" :: "r"(addr) : "memory");
}
#endif
