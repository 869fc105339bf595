// One row of 128 values rotated by the normalised Walsh-Hadamard butterfly and converted to a
// float dtype, with the loads and conversions it needs: shared by the native preparation
// (cpu_prepare.cpp: the drop-in's passes and its output's un-rotation) and the attention kernel
// (its epilogue, which un-rotates the drop-in's output as it writes it). One definition, so the
// two give the same bits. Every level computes the same IEEE operations in the same order
// (scalar is the reference; both sources compile with -ffp-contract=off).
//
// The SIMD functions carry their ISA as a target attribute: cpu_prepare.cpp, compiled without -m
// flags, picks a level at run time; the kernel, compiled per ISA, calls the level of its build
// (rotate_row_built below).
//
// Plain C++ and intrinsics, no torch header.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QFA_X86 1
#define T_AVX2 __attribute__((target("avx2,f16c,popcnt")))
#define T_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,popcnt")))
#endif

namespace qfa_rows {
namespace {  // internal linkage: each library (the kernel's per-ISA build, cpu_prepare) keeps its own copy

constexpr int kD = 128;  // the row: a head vector of HiF8 mode 0 (its only head dim)

inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Input element types: 0 fp32, 1 bf16, 2 fp16.
enum Dtype { F32 = 0, BF16 = 1, F16 = 2 };

// fp16 <-> fp32 by the IEEE rules (what F16C's conversions compute: exact widening; narrowing
// rounds to nearest even, overflow to Inf), NaN -> sign | 0x7E00 when narrowing (c10's rule).
inline float f32_of_f16(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  if (e == 0x1F) return u2f(sign | 0x7F800000u | (m << 13));
  if (e == 0) {
    if (m == 0) return u2f(sign);
    int shift = 0;  // a denormal: normalise the significand
    while (!(m & 0x400)) { m <<= 1; ++shift; }
    return u2f(sign | (uint32_t)(127 - 14 - shift) << 23 | (m & 0x3FF) << 13);
  }
  return u2f(sign | (e + 127 - 15) << 23 | m << 13);
}

inline uint16_t f16_of_f32(float f) {
  uint32_t u = f2u(f), sign = (u >> 16) & 0x8000, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00);
  if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);  // from 65520 (the tie above 65504) up
  if (a >= 0x38800000u) {  // a normal fp16: rebias the exponent, round off 13 mantissa bits
    uint32_t v = a - 0x38000000u;
    return (uint16_t)(sign | ((v + 0xFFFu + ((v >> 13) & 1u)) >> 13));
  }
  int e = (int)(a >> 23), shift = 126 - e;  // units of 2^-24: the significand >> shift
  if (shift > 24) return (uint16_t)sign;
  uint32_t sig = (a & 0x7FFFFFu) | 0x800000u, q = sig >> shift, rem = sig & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return (uint16_t)(sign | q);
}

inline float load_scalar(const void* p, int64_t i, int dt) {
  if (dt == F32) return static_cast<const float*>(p)[i];
  uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (dt == BF16) return u2f((uint32_t)h << 16);
  return f32_of_f16(h);
}

// fp32 -> bf16, round to nearest even (torch's rule), NaN -> 0x7FC0 (torch's scalar NaN).
inline uint16_t bf16_of(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Output conversions of rotate_rows: finite values beyond the dtype's largest finite one
// saturate there (the drop-in's saturating cast); NaN and +-Inf stay.
constexpr float kBf16Max = 3.38953139e38f;  // 0x7F7F

constexpr float kF16Max = 65504.0f;

inline float saturate(float f, float limit) {
  if (std::isfinite(f)) return std::min(std::max(f, -limit), limit);
  return f;
}

inline void store_scalar(void* p, int64_t i, int dt, float f) {
  if (dt == F32) static_cast<float*>(p)[i] = f;
  else if (dt == BF16) static_cast<uint16_t*>(p)[i] = bf16_of(saturate(f, kBf16Max));
  else static_cast<uint16_t*>(p)[i] = f16_of_f32(saturate(f, kF16Max));
}

// The Walsh-Hadamard butterfly of one row, levels h = 1, 2, ..., 64 (x[i], x[i+h] -> x[i] + x[i+h],
// x[i] - x[i+h] where bit h of i is clear), then one multiply by c = fl(1/sqrt(128)).
inline void fwht_scalar(float* x, float c) {
  for (int h = 1; h < kD; h <<= 1)
    for (int i = 0; i < kD; ++i)
      if (!(i & h)) { float a = x[i], b = x[i + h]; x[i] = a + b; x[i + h] = a - b; }
  for (int i = 0; i < kD; ++i) x[i] = x[i] * c;
}

inline int64_t esize(int dt) { return dt == F32 ? 4 : 2; }

// What one row's pass needs: the input row, the mean to subtract (or null), rotate or not.
struct RowIn {
  const void* x;
  int dt;
  const float* mu;
  bool rotate;
  float c;
};

inline void load_row_scalar(const RowIn& in, float* y) {
  for (int i = 0; i < kD; ++i) {
    float v = load_scalar(in.x, i, in.dt);
    y[i] = in.mu ? v - in.mu[i] : v;
  }
  if (in.rotate) fwht_scalar(y, in.c);
}

inline void rotate_row_scalar(const RowIn& in, void* out, int odt) {
  float y[kD];
  load_row_scalar(in, y);
  for (int i = 0; i < kD; ++i) store_scalar(out, i, odt, y[i]);
}

#ifdef QFA_X86

T_AVX2 inline __m256 load8_avx2(const void* p, int64_t i, int dt) {
  if (dt == F32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
  if (dt == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

// One row in 16 registers of 8 lanes: in-register levels h = 1, 2, 4, then across registers.
T_AVX2 inline void fwht_avx2(__m256* r, float c) {
  const __m256 s1 = _mm256_castsi256_ps(_mm256_setr_epi32(0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, INT32_MIN, INT32_MIN, 0, 0, INT32_MIN, INT32_MIN));
  const __m256 s4 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN));
  // the lane with bit h set gets partner - self = x[i] - x[i+h]; the other partner + self
  for (int j = 0; j < 16; ++j) {
    __m256 x = r[j];
    x = _mm256_add_ps(_mm256_permute_ps(x, 0xB1), _mm256_xor_ps(x, s1));
    x = _mm256_add_ps(_mm256_permute_ps(x, 0x4E), _mm256_xor_ps(x, s2));
    x = _mm256_add_ps(_mm256_permute2f128_ps(x, x, 1), _mm256_xor_ps(x, s4));
    r[j] = x;
  }
  for (int step = 1; step < 16; step <<= 1)
    for (int j = 0; j < 16; ++j)
      if (!(j & step)) { __m256 a = r[j], b = r[j + step]; r[j] = _mm256_add_ps(a, b); r[j + step] = _mm256_sub_ps(a, b); }
  const __m256 cv = _mm256_set1_ps(c);
  for (int j = 0; j < 16; ++j) r[j] = _mm256_mul_ps(r[j], cv);
}

T_AVX2 inline void load_row_avx2(const RowIn& in, __m256* r) {
  for (int j = 0; j < 16; ++j) {
    r[j] = load8_avx2(in.x, 8 * j, in.dt);
    if (in.mu) r[j] = _mm256_sub_ps(r[j], _mm256_loadu_ps(in.mu + 8 * j));
  }
  if (in.rotate) fwht_avx2(r, in.c);
}

T_AVX2 inline __m128i bf16_of_avx2(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i rnd = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  rnd = _mm256_blendv_epi8(rnd, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(rnd), _mm256_extracti128_si256(rnd, 1));
}

T_AVX2 inline __m256 saturate_avx2(__m256 v, float limit) {
  // min/max return the second operand for NaN: v second keeps NaN; +-Inf are outside the clamp
  __m256 a = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  __m256 fin = _mm256_cmp_ps(a, _mm256_set1_ps(INFINITY), _CMP_LT_OQ);
  __m256 cl = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-limit)), _mm256_set1_ps(limit));
  return _mm256_blendv_ps(v, cl, fin);
}

T_AVX2 inline __m128i f16_of_avx2(__m256 v) {
  __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // NaN as c10's scalar conversion gives it: sign | 0x7E00
  __m256i u = _mm256_castps_si256(v);
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  __m256i want = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
                                 _mm256_set1_epi32(0x7E00));
  __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
  __m128i want16 = _mm_packus_epi32(_mm256_castsi256_si128(want), _mm256_extracti128_si256(want, 1));
  return _mm_blendv_epi8(h, want16, nan16);
}

T_AVX2 inline void rotate_row_avx2(const RowIn& in, void* out, int odt) {
  __m256 r[16];
  load_row_avx2(in, r);
  for (int j = 0; j < 16; ++j) {
    if (odt == F32) { _mm256_storeu_ps(static_cast<float*>(out) + 8 * j, r[j]); continue; }
    __m128i h = odt == BF16 ? bf16_of_avx2(saturate_avx2(r[j], kBf16Max)) : f16_of_avx2(saturate_avx2(r[j], kF16Max));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + 8 * j), h);
  }
}

T_AVX512 inline __m512 load16_512(const void* p, int64_t i, int dt) {
  if (dt == F32) return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
  if (dt == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

T_AVX512 inline void fwht_512(__m512* r, float c) {
  // In-register levels: y = x * s + partner with s = -1 in the lanes whose bit h is set, +1 in
  // the others: one rounding of partner - self (= x[i] - x[i+h]) or of self + partner, the
  // butterfly's own operations (a multiply by +-1 is exact), in one instruction.
  const __m512 s1 = _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_set1_epi32(0x3F800000), 0xAAAA,
                                                              _mm512_set1_epi32((int)0xBF800000)));
  const __m512 s2 = _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_set1_epi32(0x3F800000), 0xCCCC,
                                                              _mm512_set1_epi32((int)0xBF800000)));
  const __m512 s4 = _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_set1_epi32(0x3F800000), 0xF0F0,
                                                              _mm512_set1_epi32((int)0xBF800000)));
  const __m512 s8 = _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_set1_epi32(0x3F800000), 0xFF00,
                                                              _mm512_set1_epi32((int)0xBF800000)));
  for (int j = 0; j < 8; ++j) {
    __m512 x = r[j];
    x = _mm512_fmadd_ps(x, s1, _mm512_permute_ps(x, 0xB1));
    x = _mm512_fmadd_ps(x, s2, _mm512_permute_ps(x, 0x4E));
    x = _mm512_fmadd_ps(x, s4, _mm512_shuffle_f32x4(x, x, 0xB1));
    x = _mm512_fmadd_ps(x, s8, _mm512_shuffle_f32x4(x, x, 0x4E));
    r[j] = x;
  }
  for (int step = 1; step < 8; step <<= 1)
    for (int j = 0; j < 8; ++j)
      if (!(j & step)) { __m512 a = r[j], b = r[j + step]; r[j] = _mm512_add_ps(a, b); r[j + step] = _mm512_sub_ps(a, b); }
  const __m512 cv = _mm512_set1_ps(c);
  for (int j = 0; j < 8; ++j) r[j] = _mm512_mul_ps(r[j], cv);
}

T_AVX512 inline void load_row_512(const RowIn& in, __m512* r) {
  for (int j = 0; j < 8; ++j) {
    r[j] = load16_512(in.x, 16 * j, in.dt);
    if (in.mu) r[j] = _mm512_sub_ps(r[j], _mm512_loadu_ps(in.mu + 16 * j));
  }
  if (in.rotate) fwht_512(r, in.c);
}

T_AVX512 inline __m256i bf16_of_512(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rnd = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                          _mm512_set1_epi32(0x7F800000));
  rnd = _mm512_mask_mov_epi32(rnd, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rnd);
}

T_AVX512 inline __m512 saturate_512(__m512 v, float limit) {
  __mmask16 fin = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
  __m512 cl = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-limit)), _mm512_set1_ps(limit));
  return _mm512_mask_mov_ps(v, fin, cl);
}

T_AVX512 inline __m256i f16_of_512(__m512 v) {
  __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512i u = _mm512_castps_si512(v);
  __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                          _mm512_set1_epi32(0x7F800000));
  __m512i want = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x8000)),
                                 _mm512_set1_epi32(0x7E00));
  return _mm256_mask_mov_epi16(h, nan, _mm512_cvtepi32_epi16(want));
}

T_AVX512 inline void rotate_row_512(const RowIn& in, void* out, int odt) {
  __m512 r[8];
  load_row_512(in, r);
  for (int j = 0; j < 8; ++j) {
    if (odt == F32) { _mm512_storeu_ps(static_cast<float*>(out) + 16 * j, r[j]); continue; }
    __m256i h = odt == BF16 ? bf16_of_512(saturate_512(r[j], kBf16Max)) : f16_of_512(saturate_512(r[j], kF16Max));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + 16 * j), h);
  }
}

#endif  // QFA_X86

// The level this translation unit was compiled for (the kernel's builds carry -m flags).
inline void rotate_row_built(const RowIn& in, void* out, int odt) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && defined(__F16C__)
  rotate_row_512(in, out, odt);
#elif defined(__AVX2__) && defined(__F16C__)
  rotate_row_avx2(in, out, odt);
#else
  rotate_row_scalar(in, out, odt);
#endif
}

}  // namespace
}  // namespace qfa_rows
