// The tensor-core quantized GEMV's helpers (templates/qgemv_tc.cu.jinja, which documents the form): a code word's pairs
// as MAGIC | q, which of a block's 16 rows are live and where they are, the copies of a warp's chunks of the rows into
// shared memory, the warp's parts of it, and the scale table. The including template defines its geometry first
// (M_, N_, WARPS, CPW, STAGES, CPS, RSB, SRS, TV, ZB, HB, HRS, GLU, F_, CB, QT_BATCH, MAGIC, MAGIC_HI, CODE_MASK, BIAS) and
// includes quant.cuh.
#pragma once

// lanes a row of a [16][W] copy or table takes (a power of two, 2 to 32, at least W where W <= 32): rows a round, rounds
#define QT_LP(W) ((W) > 16 ? 32 : (W) > 8 ? 16 : (W) > 4 ? 8 : (W) > 2 ? 4 : 2)
#define LPS QT_LP(CPW)  // the scale table's
#define RPS (32 / LPS)
#define UPS ((CPW + LPS - 1) / LPS)  // chunks of a row a lane scales
#define QT_PER (((16 + RPS - 1) / RPS) * UPS)  // (row, chunk) pairs a lane scales

// Two codes of a code word as a 16-bit pair: bytes 0 and 2 of `w` (their low nibbles at 4-6 bits), each MAGIC | q:
// one LOP3 (8-bit signed codes: bit 7 flipped by the same XOR, MAGIC holding it).
__device__ __forceinline__ fc_u32 qt_pair(fc_u32 w) {
  return (w & CODE_MASK) ^ MAGIC;
}
// bf16 8-bit codes: bit 7 of bytes 0 and 2 as 128 + 128 * bit (u's bit 7: signed codes' flipped by MAGIC_HI)
__device__ __forceinline__ fc_u32 qt_pair_hi(fc_u32 w) {
  return (w & 0x00800080u) ^ MAGIC_HI;
}

// Whether row r (of the block's 16) holds a weight row: r < live, or (gated) r % 8 < live.
__device__ __forceinline__ bool qt_live(int r, int live) { return GLU ? (r & 7) < live : r < live; }

// Row r's distance from the block's first row in global memory: gated rows from 8 on are F - 8 rows further on.
__host__ __device__ constexpr long long qt_grow(int r) { return GLU && r >= 8 ? (long long)r + F_ - 8 : (long long)r; }

// One U-byte copy global -> shared at constant offsets from a shared address and a global pointer (immediates in the
// instruction: computed addresses cost the prologue more than the copies did).
template <int U, int DOFF, long long SOFF>
__device__ __forceinline__ void qt_cp(unsigned d, const unsigned char* s) {
  if (U == 16) asm volatile("cp.async.cg.shared.global [%0+%2], [%1+%3], 16;\n" :: "r"(d), "l"(s), "n"(DOFF), "n"(SOFF));
  else asm volatile("cp.async.ca.shared.global [%0+%2], [%1+%3], 4;\n" :: "r"(d), "l"(s), "n"(DOFF), "n"(SOFF));
}

// Copy units u < wv of the live rows (qt_live) of a [16][W] range of U-byte units, GS bytes a row apart in global
// memory (src: row 0, unit 0; a gated block's rows from 8 on further, qt_grow), into shared memory SS bytes a row apart
// (dst). Lane (rr, jl) takes unit jl (+ LP, ...) of rows rr, rr + 32 / LP, ...: one address a lane, the rest constant
// offsets (index arithmetic had taken most of the tensor-core form's prologue, Nsight Compute's source counters). A
// whole range (every block but the last, every warp but where K runs out) is copied without a test a unit.
template <int U, int W, long long GS, int SS, bool WHOLE, int K = 0>
__device__ __forceinline__ void qt_copy_units(unsigned d, const unsigned char* s, int rr, int jl, int rows, int wv) {
  constexpr int LP = QT_LP(W), RP = 32 / LP, UP = (W + LP - 1) / LP, IT = (16 + RP - 1) / RP;
  if constexpr (K < IT * UP) {
    constexpr int it = K / UP, u = K % UP;
    // rows it * RP + rr: from 8 on (RP <= 8: when it * RP >= 8, a constant) a gated block's are F - 8 rows further on
    if (WHOLE ? (W % LP == 0 || jl + u * LP < W) : (qt_live(it * RP + rr, rows) && jl + u * LP < min(wv, W)))
      qt_cp<U, it * RP * SS + u * LP * U, qt_grow(it * RP) * GS + u * LP * U>(d, s);
    qt_copy_units<U, W, GS, SS, WHOLE, K + 1>(d, s, rr, jl, rows, wv);
  }
}
template <int U, int W, long long GS, int SS>
__device__ __forceinline__ void qt_copy_rows(unsigned char* dst, const unsigned char* src, int rows, int wv, int lane) {
  constexpr int LP = QT_LP(W);
  const int rr = lane / LP, jl = lane % LP;
  const unsigned d = fc_smem_addr(dst) + rr * SS + jl * U;
  const unsigned char* s = src + qt_grow(rr) * GS + jl * U;  // rr >= 8 only where a round is all 16 rows
  if (rows >= (GLU ? 8 : 16) && wv >= W) qt_copy_units<U, W, GS, SS, true>(d, s, rr, jl, rows, wv);
  else qt_copy_units<U, W, GS, SS, false>(d, s, rr, jl, min(rows, 16), wv);
}

// A staged run's chunks in stage st (STAGES stages of CPS chunks; cnt the run's): none past the run's end.
__device__ __forceinline__ int qt_stage_chunks(int cnt, int st) { return max(0, min(CPS, cnt - st * CPS)); }

// Wait until at most `left` of the warp's latest commit groups (stages) are in flight (cp.async.wait_group takes an
// immediate).
__device__ __forceinline__ void qt_wait_stage(int left) {
  if (left <= 0) fc_cp_async_wait<0>();
  else if (left == 1) fc_cp_async_wait<1>();
  else if (left == 2) fc_cp_async_wait<2>();
  else fc_cp_async_wait<3>();
}

extern __shared__ __align__(16) unsigned char qt_smem[];
// Warp w's part of it: the codes [16 rows][RSB bytes], the scale table [16][SRS floats], the high words [16][HRS words].
// Functions, not pointers the kernel computes once: the same operations, but such pointers compiled to other SASS
// (nvdisasm) than the form measured.
__device__ __forceinline__ unsigned char* qt_wcodes(int w) { return qt_smem + w * 16 * RSB; }
__device__ __forceinline__ float* qt_wscale(int w) {
  return reinterpret_cast<float*>(qt_smem + WARPS * 16 * RSB) + w * 16 * SRS;
}
__device__ __forceinline__ unsigned int* qt_whigh(int w) {
  return reinterpret_cast<unsigned int*>(qt_smem + WARPS * 16 * (RSB + 4 * SRS)) + w * 16 * HRS;
}

// The scale table's loads of the QT_BATCH (row, chunk) pairs from t0 of lane (rr, jl) (nothing decoded: they are all
// in flight before the first is used); pairs past the rows or the run load nothing. qt_table_store decodes those
// registers unset and selects 0 instead: zeroing them here took 16-43 more PTX instructions a kernel (forty-second
// session), for values no result reads.
__device__ __forceinline__ void qt_table_load(QbRaw (&raw)[QT_BATCH], const QbPtrs& pr, int t0, int rr, int jl,
                                              int nrem, int cnt, int ch0) {
#pragma unroll
  for (int e = 0; e < QT_BATCH; ++e) {
    const int t = t0 + e, r = (t / UPS) * RPS, j = jl + (t % UPS) * LPS;  // r: rows past the lane's first
    if (t < QT_PER && rr + r < 16 && qt_live(rr + r, nrem) && j < cnt)
      qb_scales_raw(pr, qt_grow(r), ch0 + j, raw[e]);  // r = 0 where a round is all 16 rows
  }
}

// The same pairs decoded into the warp's table: (s, o - s * (BIAS + z)) a group, or s alone (TV 1: o is 0 and z a
// constant, ZB); zeros for rows past N.
__device__ __forceinline__ void qt_table_store(const QbRaw (&raw)[QT_BATCH], int t0, int rr, int jl, int nrem, int cnt,
                                               int warp) {
#pragma unroll
  for (int e = 0; e < QT_BATCH; ++e) {
    const int t = t0 + e, r = rr + (t / UPS) * RPS, j = jl + (t % UPS) * LPS;
    if (t < QT_PER && r < 16 && j < cnt) {
      float s[QB_GPC], o[QB_GPC], zf[QB_GPC];
      qb_decode_all(raw[e], s, o, zf);
      const bool live = qt_live(r, nrem);
#pragma unroll
      for (int q = 0; q < QB_GPC; ++q) {
        if (TV == 1) {
          qt_wscale(warp)[r * SRS + j * QB_GPC + q] = live ? s[q] : 0.f;
        } else {
          float2 v;
          v.x = live ? s[q] : 0.f;
          v.y = live ? o[q] - s[q] * (BIAS + (zf[q] - 8388608.0f)) : 0.f;
          *reinterpret_cast<float2*>(qt_wscale(warp) + r * SRS + (j * QB_GPC + q) * 2) = v;
        }
      }
    }
  }
}
