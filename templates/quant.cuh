// Packed quantized weights (fusec/quant.py's layout): one 32-weight chunk of one row at a time.
// The including template defines the format first:
//   QB_BITS (4, 5, 6, 8), QB_SIGNED (8-bit codes are int8), QB_GROUP (weights per scale: 16 or a
//   multiple of 32), QB_SB (weights per `scale` entry), QB_ZERO (the constant zero point, -1: per
//   group `zero` array), QB_SUB (0 none, 1 u8, 2 i8 sub-scales), QB_OFF (0 none, 1 +min, 2
//   -(dmin * mins)), QB_K (weights per row), and `qb_scale_t` (the scale storage type).
// W[n, k] = s * (q - z) + o per group; the codes of chunk c of row n are 16 bytes (4-6 bits: byte j
// holds w[j] low and w[j + 16] high) or 32 bytes (8 bits), read with 16-byte loads.
#pragma once

#define QB_NCH (QB_K / 32)
#define QB_GPC (QB_GROUP < 32 ? 2 : 1)  // groups per chunk

struct QbPtrs {
  const unsigned char* codes;
  const unsigned int* high;
  const qb_scale_t* scale;
  const unsigned char* sub;
  const unsigned char* zero;
  const qb_scale_t* minv;  // +min per group (QB_OFF 1), or dmin per super-block (QB_OFF 2)
  const unsigned char* mins;
};

// One chunk's raw packed data and its groups' scale, offset and zero (as 2**23 + z: see qb_w8).
struct QbChunk {
  uint4 q0, q1;
  unsigned int h0, h1;
  float s[QB_GPC], o[QB_GPC], zf[QB_GPC];
};

// The raw scale data of each group of one chunk (loaded, not yet decoded): one struct, not separate
// arrays (the same operations, but arrays compiled to other SASS, nvdisasm).
struct QbRaw {
  qb_scale_t s[QB_GPC], m[QB_GPC];  // scale; min (QB_OFF 1) or dmin (QB_OFF 2)
  unsigned char sub[QB_GPC], mins[QB_GPC], zero[QB_GPC];
};

// Every group's scale loads of chunk c of row n (nothing decoded: a kernel can issue them all first).
__device__ __forceinline__ void qb_scales_raw(const QbPtrs& p, long long n, int c, QbRaw& r) {
#pragma unroll
  for (int g = 0; g < QB_GPC; ++g) {
    const int k = c * 32 + g * 16;  // first weight of the group's part of this chunk
    const long long gi = n * (QB_K / QB_GROUP) + k / QB_GROUP;
    r.s[g] = p.scale[n * (QB_K / QB_SB) + k / QB_SB];
    if (QB_SUB) r.sub[g] = __ldg(p.sub + gi);
    if (QB_OFF == 1) r.m[g] = p.minv[gi];
    if (QB_OFF == 2) {
      r.m[g] = p.minv[n * (QB_K / QB_SB) + k / QB_SB];
      r.mins[g] = __ldg(p.mins + gi);
    }
    if (QB_ZERO < 0) r.zero[g] = __ldg(p.zero + gi);
  }
}

// Group g's scale s, offset o and zero point z (W = s * (q - z) + o; 8-bit signed codes: z = 0 on the int8 value).
__device__ __forceinline__ void qb_decode(const QbRaw& r, int g, float& s, float& o, int& z) {
  s = fc_val(r.s[g]);
  if (QB_SUB == 1) s *= (float)r.sub[g];
  if (QB_SUB == 2) s *= (float)(signed char)r.sub[g];
  o = 0.0f;
  if (QB_OFF == 1) o = fc_val(r.m[g]);
  if (QB_OFF == 2) o = -(fc_val(r.m[g]) * (float)r.mins[g]);
  z = QB_ZERO >= 0 ? QB_ZERO : (int)r.zero[g];
}

// Every group's scale, offset and zero (as 2**23 + z: see qb_w8) from loaded scale data.
__device__ __forceinline__ void qb_decode_all(const QbRaw& r, float (&sv)[QB_GPC], float (&ov)[QB_GPC],
                                              float (&zv)[QB_GPC]) {
#pragma unroll
  for (int g = 0; g < QB_GPC; ++g) {
    int z;
    qb_decode(r, g, sv[g], ov[g], z);
    zv[g] = 8388608.0f + (float)(z + (QB_BITS == 8 && QB_SIGNED ? 128 : 0));
  }
}

// The scale, offset and zero of each group of chunk c of row n: every group's loads, then the arithmetic.
__device__ __forceinline__ void qb_scales(const QbPtrs& p, long long n, int c, float (&sv)[QB_GPC], float (&ov)[QB_GPC],
                                          float (&zv)[QB_GPC]) {
  QbRaw r;
  qb_scales_raw(p, n, c, r);
  qb_decode_all(r, sv, ov, zv);
}

// The operands from row n on (each array holds a row's entries contiguously), so that a kernel's loads of row n and
// the rows after it are offsets by row and chunk alone.
__device__ __forceinline__ QbPtrs qb_rows(const QbPtrs& p, long long n) {
  QbPtrs r = p;
  r.codes += n * (QB_NCH * (QB_BITS == 8 ? 32 : 16));
  if (QB_BITS == 5 || QB_BITS == 6) r.high += n * QB_NCH * (QB_BITS - 4);
  r.scale += n * (QB_K / QB_SB);
  if (QB_SUB) r.sub += n * (QB_K / QB_GROUP);
  if (QB_ZERO < 0) r.zero += n * (QB_K / QB_GROUP);
  if (QB_OFF == 1) r.minv += n * (QB_K / QB_GROUP);
  if (QB_OFF == 2) {
    r.minv += n * (QB_K / QB_SB);
    r.mins += n * (QB_K / QB_GROUP);
  }
  return r;
}

// The codes of chunk c of row n (16-byte loads) and its high words.
__device__ __forceinline__ void qb_load_codes(const QbPtrs& p, long long n, int c, uint4& q0, uint4& q1, unsigned int& h0,
                                              unsigned int& h1) {
  if (QB_BITS == 8) {
    const uint4* src = reinterpret_cast<const uint4*>(p.codes + n * QB_K + (long long)c * 32);
    q0 = __ldg(src);
    q1 = __ldg(src + 1);
  } else {
    q0 = __ldg(reinterpret_cast<const uint4*>(p.codes + n * (QB_K / 2) + (long long)c * 16));
  }
  if (QB_BITS == 5 || QB_BITS == 6) {
    const long long hb = QB_BITS - 4;
    h0 = __ldg(p.high + (n * QB_NCH + c) * hb);
    h1 = QB_BITS == 6 ? __ldg(p.high + (n * QB_NCH + c) * hb + 1) : 0u;
  }
}

// All of this chunk's global loads: the codes (16-byte loads), high words, scales. Nothing here
// reads the activations, so a kernel can issue these first.
__device__ __forceinline__ void qb_load(const QbPtrs& p, long long n, int c, QbChunk& ch) {
  qb_load_codes(p, n, c, ch.q0, ch.q1, ch.h0, ch.h1);
  qb_scales(p, n, c, ch.s, ch.o, ch.zf);
}

// A chunk that dequantizes to zeros (rows past N, chunks past K: nothing is read).
__device__ __forceinline__ void qb_zero(QbChunk& ch) {
  ch.q0 = make_uint4(0u, 0u, 0u, 0u);
  ch.q1 = ch.q0;
  ch.h0 = ch.h1 = 0u;
#pragma unroll
  for (int g = 0; g < QB_GPC; ++g) {
    ch.s[g] = 0.0f;
    ch.o[g] = 0.0f;
    ch.zf[g] = 8388608.0f;
  }
}

// 2**23 + b exactly, for a byte b: the float whose mantissa holds b (one PRMT), so that
// (2**23 + b) - (2**23 + z) = b - z is exact.
__device__ __forceinline__ float qb_f(unsigned int word, int byte) {
  return __uint_as_float(__byte_perm(word, 0x4B000000u, (unsigned)byte | 0x7650u));
}

// Bits 4.. of the codes of code word i (i = 0..3, bytes 4i .. 4i+3 of a chunk's codes) under its low nibbles (upper
// false: weights 4i ..) or its high ones (weights 16 + 4i ..), at bits 4.. of each byte: one shift and one mask (the
// high words' layout: fusec/quant.py; the two shifts of `upper` fold into one under the mask, and written so the
// tensor-core form's lane, which takes both halves of a word, shares the first). Bit planes had taken a spread of
// every bit.
__device__ __forceinline__ unsigned int qb_high(unsigned int h0, unsigned int h1, int i, bool upper) {
  constexpr int hb = QB_BITS == 6 ? 2 : 1, per = 4 / hb;  // bits a weight, code words a high word
  const unsigned int h = i / per ? h1 : h0;
  const int t = hb * (i % per);
  return ((h >> t) << (upper ? 4 : 0)) & (((1u << hb) - 1u) * 0x10101010u);
}

// The 8 codes of weights 8*s .. 8*s+7 of a chunk (s = 0..3), one per byte of lo (w0..3) and hi (w4..7).
__device__ __forceinline__ void qb_codes8(const QbChunk& ch, int s, unsigned int& lo, unsigned int& hi) {
  if (QB_BITS == 8) {
    const uint4 q = s < 2 ? ch.q0 : ch.q1;
    lo = (s & 1) ? q.z : q.x;
    hi = (s & 1) ? q.w : q.y;
    if (QB_SIGNED) {  // int8 -> int8 + 128 (as a byte): the zero point absorbs the 128
      lo ^= 0x80808080u;
      hi ^= 0x80808080u;
    }
  } else {
    const unsigned int a = (s & 1) ? ch.q0.z : ch.q0.x, b = (s & 1) ? ch.q0.w : ch.q0.y;
    const int shift = s < 2 ? 0 : 4;  // sub-steps 0, 1: low nibbles (w0..15); 2, 3: high (w16..31)
    lo = (a >> shift) & 0x0F0F0F0Fu;
    hi = (b >> shift) & 0x0F0F0F0Fu;
    if (QB_BITS == 5 || QB_BITS == 6) {  // bits 4 (and 5): code words 2 (s & 1) and 2 (s & 1) + 1
      lo |= qb_high(ch.h0, ch.h1, (s & 1) * 2, s >= 2);
      hi |= qb_high(ch.h0, ch.h1, (s & 1) * 2 + 1, s >= 2);
    }
  }
}

// The 8 dequantized weights 8*s .. 8*s+7 of a chunk (s = 0..3), in fp32.
__device__ __forceinline__ void qb_w8(const QbChunk& ch, int s, float w[8]) {
  unsigned int lo, hi;
  qb_codes8(ch, s, lo, hi);
  const int g = QB_GPC == 2 ? s >> 1 : 0;
  const float sc = ch.s[g], off = ch.o[g], zf = ch.zf[g];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = QB_OFF ? fmaf(sc, qb_f(lo, i) - zf, off) : sc * (qb_f(lo, i) - zf);
    w[i + 4] = QB_OFF ? fmaf(sc, qb_f(hi, i) - zf, off) : sc * (qb_f(hi, i) - zf);
  }
}

// The same 8 weights unscaled (q - z, exact) and their group's scale and offset: w = sc * d + off,
// so a dot product over them is sc * dot(d, x) + off * sum(x) (one multiply per 8 weights, not 8).
__device__ __forceinline__ void qb_d8(const QbChunk& ch, int s, float d[8], float& sc, float& off) {
  unsigned int lo, hi;
  qb_codes8(ch, s, lo, hi);
  const int g = QB_GPC == 2 ? s >> 1 : 0;
  const float zf = ch.zf[g];
  sc = ch.s[g];
  off = ch.o[g];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    d[i] = qb_f(lo, i) - zf;
    d[i + 4] = qb_f(hi, i) - zf;
  }
}

// Code word i (i = 0..3) of a chunk as 4 bytes for dp4a: lo holds the codes of weights 4i .. 4i+3, hi those of
// 16 + 4i .. 16 + 4i + 3 (4-6 bits: unsigned, below 64; 8 bits: as stored, int8 where QB_SIGNED).
__device__ __forceinline__ void qb_words(const uint4& q0, const uint4& q1, unsigned int h0, unsigned int h1, int i,
                                         unsigned int& lo, unsigned int& hi) {
  const unsigned int a = i == 0 ? q0.x : i == 1 ? q0.y : i == 2 ? q0.z : q0.w;
  if (QB_BITS == 8) {
    lo = a;
    hi = i == 0 ? q1.x : i == 1 ? q1.y : i == 2 ? q1.z : q1.w;
  } else {
    lo = a & 0x0F0F0F0Fu;
    hi = (a >> 4) & 0x0F0F0F0Fu;
    if (QB_BITS == 5 || QB_BITS == 6) {  // bits 4 (and 5)
      lo |= qb_high(h0, h1, i, false);
      hi |= qb_high(h0, h1, i, true);
    }
  }
}
