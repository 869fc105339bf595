// HiF8 rounding of P (E4M3's too, for quant_modes 1 and 6) and the softmax's row helpers: the bit rule of qfa/cast/rounding.py on fp32
// bit patterns (scalar, 8 and 16 lanes, 32 high halves: every width the same bits), the row maximum with torch's
// NaN propagation, the vectorised exp, and the bf16 conversions of the kernel's values (exact
// values, HiF8 codes' and rounded P's, to bf16 for the dot products; the output's O / l rounded
// ties away). These are the numerics every path shares: the tiles and the walk only call them.
//
// Only cpu_attention.cpp includes this header: the kernel is one translation unit, and the
// anonymous namespace gives everything here the internal linkage it had when the kernel was one
// file (nothing exported beside the entry points, the optimiser free to inline and drop as before).

#pragma once

#include "kernel_config.h"


#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// ---- HiF8 rounding of P (the bit rule of qfa/cast/rounding.py; constants passed in) ----------

struct RoundConsts {
  int32_t band[3];        // |e| limits for 1, 2, 3 kept mantissa bits
  int32_t min_denormal;   // bit patterns
  int32_t underflow;
  int32_t max_bits;
  int32_t nan_bits;
  // RoundWords' tables, by min(|e|, 31): the high halves of half = 2^22 >> m and of -(2 half)
  alignas(64) int16_t half_w[32];
  alignas(64) int16_t mask_w[32];
};

RoundConsts round_consts_of(const std::vector<int64_t>& v) {
  QFA_CHECK(v.size() == 7, "round_consts: 7 values");
  RoundConsts c{{int32_t(v[0]), int32_t(v[1]), int32_t(v[2])}, int32_t(v[3]), int32_t(v[4]), int32_t(v[5]),
                int32_t(v[6]), {}, {}};
  for (int32_t t : {c.min_denormal, c.underflow, c.max_bits, c.nan_bits})
    QFA_CHECK((t & 0xFFFF) == 0, "round_consts: the thresholds' low halves must be zero (the rule reads the top 16 bits)");
  // The tables stop at |e| = 31: every band and the smallest kept binade must lie within them.
  const int32_t e_min = std::abs((c.min_denormal >> 23) - 127);
  QFA_CHECK(c.band[0] < 31 && c.band[1] < 31 && c.band[2] < 31 && e_min <= 31,
            "round_consts: bands and min_denormal's binade must lie within |e| <= 31");
  for (int e = 0; e < 32; ++e) {
    const int m = (e <= c.band[0]) + (e <= c.band[1]) + (e <= c.band[2]);
    const int32_t h = (1 << 22) >> m;  // a multiple of 2^16: m <= 3
    c.half_w[e] = static_cast<int16_t>(h >> 16);
    c.mask_w[e] = static_cast<int16_t>(-(2 * h) >> 16);
  }
  return c;
}

inline int32_t round_hif8_bits(int32_t bits, const RoundConsts& c) {
  const int32_t a = bits & 0x7FFF0000;
  const int32_t cl = a < c.max_bits ? a : c.max_bits;
  int32_t e = (cl >> 23) - 127;
  e = e < 0 ? -e : e;
  const int32_t m = (e <= c.band[0]) + (e <= c.band[1]) + (e <= c.band[2]);
  const int32_t half = (1 << 22) >> m;
  int32_t r = (cl + half) & -(half + half);
  const int32_t below = cl >= c.underflow ? c.min_denormal : 0;
  r = cl < c.min_denormal ? below : r;
  r = a == 0x7F800000 ? a : r;
  r = r == 0 ? r : (r | (bits & static_cast<int32_t>(0x80000000u)));
  return a > 0x7F800000 ? c.nan_bits : r;
}

inline void round_row_scalar(float* p, int64_t n, const RoundConsts& c) {
  int32_t* b = reinterpret_cast<int32_t*>(p);
  for (int64_t j = 0; j < n; ++j) b[j] = round_hif8_bits(b[j], c);
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// round_hif8_bits on 8 lanes, step for step (signed compares are safe: every operand is a
// non-negative magnitude below 2^31).
struct RoundVec {
  __m256i band_p1[3], min_denormal, underflow_m1, max_bits, nan_bits, inf_bits, mag_mask, sign_mask;
  explicit RoundVec(const RoundConsts& c) {
    for (int i = 0; i < 3; ++i) band_p1[i] = _mm256_set1_epi32(c.band[i] + 1);
    min_denormal = _mm256_set1_epi32(c.min_denormal);
    underflow_m1 = _mm256_set1_epi32(c.underflow - 1);
    max_bits = _mm256_set1_epi32(c.max_bits);
    nan_bits = _mm256_set1_epi32(c.nan_bits);
    inf_bits = _mm256_set1_epi32(0x7F800000);
    mag_mask = _mm256_set1_epi32(0x7FFF0000);
    sign_mask = _mm256_set1_epi32(static_cast<int32_t>(0x80000000u));
  }
  inline __m256 operator()(__m256 x) const {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i a = _mm256_and_si256(bits, mag_mask);
    const __m256i cl = _mm256_min_epi32(a, max_bits);
    const __m256i e = _mm256_abs_epi32(_mm256_sub_epi32(_mm256_srli_epi32(cl, 23), _mm256_set1_epi32(127)));
    // m = number of bands with e <= band[i]: each true compare is -1.
    const __m256i neg_m = _mm256_add_epi32(_mm256_add_epi32(_mm256_cmpgt_epi32(band_p1[0], e),
                                                            _mm256_cmpgt_epi32(band_p1[1], e)),
                                           _mm256_cmpgt_epi32(band_p1[2], e));
    const __m256i m = _mm256_sub_epi32(_mm256_setzero_si256(), neg_m);
    const __m256i half = _mm256_srlv_epi32(_mm256_set1_epi32(1 << 22), m);
    __m256i r = _mm256_and_si256(_mm256_add_epi32(cl, half),
                                 _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_add_epi32(half, half)));
    const __m256i below = _mm256_and_si256(_mm256_cmpgt_epi32(cl, underflow_m1), min_denormal);
    r = _mm256_blendv_epi8(r, below, _mm256_cmpgt_epi32(min_denormal, cl));
    r = _mm256_blendv_epi8(r, a, _mm256_cmpeq_epi32(a, inf_bits));
    const __m256i nonzero = _mm256_xor_si256(_mm256_cmpeq_epi32(r, _mm256_setzero_si256()), _mm256_set1_epi32(-1));
    r = _mm256_or_si256(r, _mm256_and_si256(nonzero, _mm256_and_si256(bits, sign_mask)));
    r = _mm256_blendv_epi8(r, nan_bits, _mm256_cmpgt_epi32(a, inf_bits));
    return _mm256_castsi256_ps(r);
  }
};
#endif

#if defined(CPU_CAPABILITY_AVX512)
// The same steps on 16 lanes, with mask registers for the compares and blends.
struct RoundVec16 {
  __m512i band_p1[3], min_denormal, underflow_m1, max_bits, nan_bits, inf_bits, mag_mask, sign_mask;
  explicit RoundVec16(const RoundConsts& c) {
    for (int i = 0; i < 3; ++i) band_p1[i] = _mm512_set1_epi32(c.band[i] + 1);
    min_denormal = _mm512_set1_epi32(c.min_denormal);
    underflow_m1 = _mm512_set1_epi32(c.underflow - 1);
    max_bits = _mm512_set1_epi32(c.max_bits);
    nan_bits = _mm512_set1_epi32(c.nan_bits);
    inf_bits = _mm512_set1_epi32(0x7F800000);
    mag_mask = _mm512_set1_epi32(0x7FFF0000);
    sign_mask = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  }
  inline __m512i operator()(__m512i bits) const {
    const __m512i a = _mm512_and_si512(bits, mag_mask);
    const __m512i cl = _mm512_min_epi32(a, max_bits);
    const __m512i e = _mm512_abs_epi32(_mm512_sub_epi32(_mm512_srli_epi32(cl, 23), _mm512_set1_epi32(127)));
    const __m512i one = _mm512_set1_epi32(1);
    __m512i m = _mm512_maskz_mov_epi32(_mm512_cmpgt_epi32_mask(band_p1[0], e), one);
    m = _mm512_mask_add_epi32(m, _mm512_cmpgt_epi32_mask(band_p1[1], e), m, one);
    m = _mm512_mask_add_epi32(m, _mm512_cmpgt_epi32_mask(band_p1[2], e), m, one);
    const __m512i half = _mm512_srlv_epi32(_mm512_set1_epi32(1 << 22), m);
    __m512i r = _mm512_and_si512(_mm512_add_epi32(cl, half),
                                 _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_add_epi32(half, half)));
    const __m512i below = _mm512_maskz_mov_epi32(_mm512_cmpgt_epi32_mask(cl, underflow_m1), min_denormal);
    r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(min_denormal, cl), below);
    r = _mm512_mask_mov_epi32(r, _mm512_cmpeq_epi32_mask(a, inf_bits), a);
    r = _mm512_mask_or_epi32(r, _mm512_test_epi32_mask(r, r), r, _mm512_and_si512(bits, sign_mask));
    return _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(a, inf_bits), nan_bits);
  }
};
#endif

#if defined(CPU_CAPABILITY_AVX512)
// The same rule on 32 lanes of 16-bit words, the high halves of the fp32 patterns: the rule reads
// only bits & 0x7FFF0000 and its constants' low halves are zero (checked), so every step (the
// clamp, |e|, half and its mask, the compares) is the 32-bit step shifted down by 16, and the
// result's low half is zero. |e| past 31 only occurs below min_denormal, where `below` decides, so
// half and the mask come from two 32-entry word tables (vpermw; RoundConsts builds them and
// checks the constants) indexed by min(|e|, 31). Twice RoundVec16's values per instruction, and
// two lookups for its three band compares: the rounding was a tenth of a prefill call on the
// Zen 4 EPYC.
struct RoundWords {
  __m512i half_tab, mask_tab, max_hi, min_denormal, underflow_m1, nan_hi, inf_hi;
  explicit RoundWords(const RoundConsts& c) {
    half_tab = _mm512_loadu_si512(c.half_w);
    mask_tab = _mm512_loadu_si512(c.mask_w);
    max_hi = _mm512_set1_epi16(static_cast<int16_t>(c.max_bits >> 16));
    min_denormal = _mm512_set1_epi16(static_cast<int16_t>(c.min_denormal >> 16));
    underflow_m1 = _mm512_set1_epi16(static_cast<int16_t>((c.underflow >> 16) - 1));
    nan_hi = _mm512_set1_epi16(static_cast<int16_t>(c.nan_bits >> 16));
    inf_hi = _mm512_set1_epi16(0x7F80);
  }
  // w: 32 high halves; the rounded values' high halves (signed compares: magnitudes below 2^15)
  inline __m512i operator()(__m512i w) const {
    const __m512i a = _mm512_and_si512(w, _mm512_set1_epi16(0x7FFF));
    const __m512i cl = _mm512_min_epi16(a, max_hi);
    const __m512i e = _mm512_abs_epi16(_mm512_sub_epi16(_mm512_srli_epi16(cl, 7), _mm512_set1_epi16(127)));
    const __m512i idx = _mm512_min_epi16(e, _mm512_set1_epi16(31));
    __m512i r = _mm512_and_si512(_mm512_add_epi16(cl, _mm512_permutexvar_epi16(idx, half_tab)),
                                 _mm512_permutexvar_epi16(idx, mask_tab));
    const __m512i below = _mm512_maskz_mov_epi16(_mm512_cmpgt_epi16_mask(cl, underflow_m1), min_denormal);
    r = _mm512_mask_mov_epi16(r, _mm512_cmpgt_epi16_mask(min_denormal, cl), below);
    r = _mm512_mask_mov_epi16(r, _mm512_cmpeq_epi16_mask(a, inf_hi), a);
    const __m512i sign = _mm512_and_si512(w, _mm512_set1_epi16(static_cast<int16_t>(0x8000)));
    r = _mm512_mask_mov_epi16(r, _mm512_test_epi16_mask(r, r), _mm512_or_si512(r, sign));
    return _mm512_mask_mov_epi16(r, _mm512_cmpgt_epi16_mask(a, inf_hi), nan_hi);
  }
};

// The high halves of 32 fp32 patterns (x0's 16, then x1's) as one register of words, and back.
inline __m512i high_words(__m512i x0, __m512i x1) {
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25,
                                       23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(x0, odd, x1);
}
inline __m512i widen_lo(__m512i w) { return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16); }
inline __m512i widen_hi(__m512i w) { return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16); }
#endif

// HiF8 rounding of a row of P in place: 32 words, then 16 lanes, at a time where the build has
// AVX-512, 8 lanes where it has AVX2, the same bit rule in scalar code for the tail (and
// everywhere else).
inline void round_row(float* p, int64_t n, const RoundConsts& c, bool simd = true) {
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#if defined(CPU_CAPABILITY_AVX512)
  int32_t* b = reinterpret_cast<int32_t*>(p);
  if (simd && n >= 32) {
    const RoundWords rw(c);
    for (; j + 32 <= n; j += 32) {
      const __m512i r = rw(high_words(_mm512_loadu_si512(b + j), _mm512_loadu_si512(b + j + 16)));
      _mm512_storeu_si512(b + j, widen_lo(r));
      _mm512_storeu_si512(b + j + 16, widen_hi(r));
    }
  }
  if (simd && n - j >= 16) {
    const RoundVec16 rv(c);
    for (; j + 16 <= n; j += 16) _mm512_storeu_si512(b + j, rv(_mm512_loadu_si512(b + j)));
  }
#endif
  if (simd && n - j >= 8) {
    const RoundVec rv(c);
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(p + j, rv(_mm256_loadu_ps(p + j)));
  }
#else
  (void)simd;
#endif
  round_row_scalar(p + j, n - j, c);
}

// ---- E4M3 rounding of P (quant_modes 1 and 6): qfa.cast.fp8.on_e4m3_grid step for step ---------
// Clamp to +-448 (NaN passes: min/max return their second operand when either is NaN), the
// binade read from the exponent field and clamped to [-6, 8] (subnormals share 2^-6's quantum
// 2^-9), then round(y * 2^(3 - e)) * 2^(e - 3), half to even: both scalings are exact, so every
// width gives the same bits as the torch path's rounding.

inline float round_e4m3(float y) {
  if (std::isnan(y)) return y;
  y = y > 448.f ? 448.f : (y < -448.f ? -448.f : y);
  int32_t bits;
  std::memcpy(&bits, &y, 4);
  const int32_t e = std::min(std::max((bits >> 23) & 0xFF, 121), 135);  // biased, binades -6 .. 8
  const int32_t up_bits = (257 - e) << 23, down_bits = (e - 3) << 23;
  float up, down;
  std::memcpy(&up, &up_bits, 4);
  std::memcpy(&down, &down_bits, 4);
  return std::nearbyint(y * up) * down;
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
inline __m256 round_e4m3_8(__m256 y) {
  y = _mm256_max_ps(_mm256_set1_ps(-448.f), _mm256_min_ps(_mm256_set1_ps(448.f), y));
  __m256i e = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(y), 23), _mm256_set1_epi32(0xFF));
  e = _mm256_min_epi32(_mm256_max_epi32(e, _mm256_set1_epi32(121)), _mm256_set1_epi32(135));
  const __m256 up = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(257), e), 23));
  const __m256 down = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(3)), 23));
  return _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(y, up), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), down);
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
inline __m512 round_e4m3_16(__m512 y) {
  y = _mm512_max_ps(_mm512_set1_ps(-448.f), _mm512_min_ps(_mm512_set1_ps(448.f), y));
  __m512i e = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(y), 23), _mm512_set1_epi32(0xFF));
  e = _mm512_min_epi32(_mm512_max_epi32(e, _mm512_set1_epi32(121)), _mm512_set1_epi32(135));
  const __m512 up = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(257), e), 23));
  const __m512 down = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(3)), 23));
  return _mm512_mul_ps(_mm512_roundscale_ps(_mm512_mul_ps(y, up), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                       down);
}
#endif

// E4M3 rounding of a row of P in place (16, 8 lanes, the scalar rule for the tail).
inline void round_row_e4m3(float* p, int64_t n, bool simd = true) {
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if (simd)
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(p + j, round_e4m3_16(_mm512_loadu_ps(p + j)));
#endif
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if (simd)
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(p + j, round_e4m3_8(_mm256_loadu_ps(p + j)));
#else
  (void)simd;
#endif
  for (; j < n; ++j) p[j] = round_e4m3(p[j]);
}

// IEEE maximum (NaN propagates), as torch.maximum / amax.
inline float max_nan(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return a > b ? a : b;
}

inline float row_max(const float* s, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  // 16 lanes, the tail by a masked load; NaN tracked apart (maxps does not propagate it), the
  // lanes reduced by a tree: the same value (only the sign of a zero maximum may differ, which
  // no later step can see: exp(x - 0) and m + ln l are the same bits for either zero).
  __m512 acc = _mm512_set1_ps(kNegInf);
  __mmask16 nan = 0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_loadu_ps(s + j);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    acc = _mm512_max_ps(acc, x);
  }
  if (j < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), m, s + j);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    acc = _mm512_max_ps(acc, x);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(acc);
#else
  int64_t j = 0;
  float mx = kNegInf;
  if (n >= Vec::size()) {
    Vec acc(kNegInf);
    for (; j + Vec::size() <= n; j += Vec::size()) acc = maximum(acc, Vec::loadu(s + j));
    alignas(64) float tmp[Vec::size()];
    acc.store(tmp);
    for (int i = 0; i < Vec::size(); ++i) mx = max_nan(mx, tmp[i]);
  }
  for (; j < n; ++j) mx = max_nan(mx, s[j]);
  return mx;
#endif
}

// exp over a contiguous array with the vectorised exp inductor uses (Sleef u10), tail included.
inline void exp_inplace(float* x, int64_t n) {
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) Vec::loadu(x + j).exp().store(x + j);
  if (j < n) Vec::loadu(x + j, n - j).exp().store(x + j, n - j);
}

#ifdef QFA_BF16_DOT
// n fp32 values whose low halves are zero (HiF8 values, rounded P) to bf16, by their high halves.
inline void to_bf16(const float* x, int64_t n, uint16_t* dst) {
  const int32_t* b = reinterpret_cast<const int32_t*>(x);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_loadu_si512(b + j), 16)));
  if (j < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1);
    _mm512_mask_cvtepi32_storeu_epi16(dst + j, m, _mm512_srli_epi32(_mm512_maskz_loadu_epi32(m, b + j), 16));
  }
}

#endif

#ifdef QFA_BF16_DOT
// P's rounding of 32 values (p0's 16, then p1's) as their bf16 words: HiF8 on the words (rw), or
// E4M3 on 16 lanes, whose values are bf16 values (4 significant bits, binades -9 .. 8).
template <bool E4M3>
inline __m512i round_p32(__m512 p0, __m512 p1, const RoundWords& rw) {
  if constexpr (E4M3) {
    (void)rw;
    return high_words(_mm512_castps_si512(round_e4m3_16(p0)), _mm512_castps_si512(round_e4m3_16(p1)));
  } else {
    return rw(high_words(_mm512_castps_si512(p0), _mm512_castps_si512(p1)));
  }
}

// The second of the softmax's passes over a row of n values of p (exp's, unrounded) for the
// bf16 dot products: their sum (returned: 16 lanes, then the lanes in order, then the tail in
// order) and p rounded (HiF8 with c, or E4M3) as bf16 into dst, zeros from n to n_pad (a
// multiple of 2). With keep, the rounded fp32 p (zeros to n_pad) goes back into p as well: the
// fp32 fallback's P. Whole registers of 32 values, one 64-byte store of words each; the masked
// loads and stores only in the last, partial one.
template <bool E4M3>
inline float round_sum_to_bf16(float* p, int64_t n, int64_t n_pad, const RoundConsts& c, uint16_t* dst, bool keep) {
  const RoundWords rw(c);
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 p0 = _mm512_loadu_ps(p + j), p1 = _mm512_loadu_ps(p + j + 16);
    acc = _mm512_add_ps(acc, p0);
    acc = _mm512_add_ps(acc, p1);
    const __m512i r = round_p32<E4M3>(p0, p1, rw);
    _mm512_storeu_si512(dst + j, r);
    if (keep) {
      _mm512_storeu_si512(p + j, widen_lo(r));
      _mm512_storeu_si512(p + j + 16, widen_hi(r));
    }
  }
  const int64_t whole = n & ~int64_t(15);  // the values summed in lanes
  if (j < whole) acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + j));
  float sum = 0.f;
  {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, acc);
    for (int i = 0; i < 16; ++i) sum += tmp[i];
  }
  for (int64_t t = whole; t < n; ++t) sum += p[t];
  const auto bits = [](int64_t k) { return static_cast<__mmask16>(k <= 0 ? 0 : k >= 16 ? 0xFFFF : (1u << k) - 1); };
  for (; j < n_pad; j += 32) {  // the last values (fewer than 32), then zeros to n_pad
    const int64_t left = n - j, out = std::min<int64_t>(32, n_pad - j);
    const __m512 p0 = _mm512_maskz_loadu_ps(bits(left), p + j), p1 = _mm512_maskz_loadu_ps(bits(left - 16), p + j + 16);
    const __m512i r = round_p32<E4M3>(p0, p1, rw);  // (a zero rounds to zero)
    _mm512_mask_storeu_epi16(dst + j, static_cast<__mmask32>((uint64_t(1) << out) - 1), r);
    if (keep) {
      _mm512_mask_storeu_epi32(p + j, bits(out), widen_lo(r));
      _mm512_mask_storeu_epi32(p + j + 16, bits(out - 16), widen_hi(r));
    }
  }
  return sum;
}

// The softmax's passes over a row of n visible scores for the bf16 dot products: p = exp(s *
// dscale - m) into s (the walk's exponent, Vec::exp as the torch path), then round_sum_to_bf16.
// Two loops, not one: exp is a call, around which every vector register is the caller's to save,
// so the first loop keeps nothing live across it (the sum, the rounding's tables: the second).
template <bool E4M3>
inline float exp_round_to_bf16(float* s, int64_t n, int64_t n_pad, float dscale, float m, const RoundConsts& c,
                               uint16_t* dst, bool keep) {
  static_assert(Vec::size() == 16, "the bf16 build's vectors are 16 lanes");
  const Vec vd(dscale), vm(m);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) (Vec::loadu(s + j) * vd - vm).exp().store(s + j);
  if (j < n) (Vec::loadu(s + j, n - j) * vd - vm).exp().store(s + j, n - j);
  return round_sum_to_bf16<E4M3>(s, n, n_pad, c, dst, keep);
}
#endif

// O / l to the output's bf16: ties away from zero, NaN as 0x7FC0.
inline int16_t bf16_half_away(float x) {
  if (std::isnan(x)) return static_cast<int16_t>(0x7FC0);
  int32_t bits;
  std::memcpy(&bits, &x, 4);
  return static_cast<int16_t>((bits + 0x8000) >> 16);
}

}  // namespace
