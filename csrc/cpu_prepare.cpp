// The drop-in's preparation and the HiF8 cast on CPU: see qfa/attention/backends/cpu_prepare.py for the
// contract and qfa/attention/prepare.py for how the drop-in uses it.
//
// One binary for every x86-64 CPU: nothing here is compiled with -m flags; the SIMD functions
// carry their ISA as a target attribute and are chosen at run time from the CPU's flags
// (AVX-512 F/BW/DQ/VL, else AVX2 + F16C, else scalar). Every level computes the same bits: the
// same IEEE operations in the same order (no FMA contraction: -ffp-contract=off), and an
// encoder that is exhaustively tested per level against the host's 65536-entry table.
//
// The encoder, measured on the 2-core Zen 5 EPYC, one thread, 1M bf16 values (torch's fp8
// cast: 0.54 ms): AVX-512, the rounding and the code by three 64-entry word tables looked up
// with vpermi2w (AVX512BW; 32 values a register): 0.10 ms; the same in shifts, compares and
// masks (no table): 0.25 ms. Without AVX-512: a lookup in a 65536-entry byte table, 8 packed
// into one store: 0.26 ms; the shift-and-compare rule on AVX2's 16 words: 0.51 ms (the AVX2
// machines this project meets run torch's fp8 cast no faster than this one, measured here with
// ATEN_CPU_CAPABILITY=avx2: 0.56 ms).
//
// The prepare passes split their rows into fixed chunks (run_chunks): on the calling thread for a
// few rows, else on torch's OpenMP team, each thread taking the next chunk; every chunk's result
// is the same whoever runs it, and partial statistics are combined in chunk order, so the bits
// never depend on the thread count. An OpenMP region's closing barrier waits for every thread,
// and on a loaded machine a thread can arrive a scheduler slice late (the pattern the drop-in
// had: many small parallel passes, 10x slower under load); so a region whose caller waited for a
// late thread at its end sends the passes of the next 200 ms to the library's own pool
// (item_pool.h, the attention kernel's), whose caller never waits for a thread that took nothing.

// A plain C ABI (ctypes; the GIL is released during each call) and no torch or pybind11 header
// (item_pool.h has none either):
// the first build takes about a second. The Python side (qfa/attention/backends/cpu_prepare.py) checks the
// tensors and passes their data pointers.
#include <omp.h>
#include <pthread.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <vector>

#include "item_pool.h"

#include "row_rotation.h"  // also x86's intrinsics and the T_AVX2 / T_AVX512 targets

namespace {

using namespace qfa_rows;  // kD (the row), dtypes and conversions, the rotation of a row

// ---- the format's constants (set once from qfa.cast.format / rounding: one source of truth) --
//
// The encoder works on 16-bit words: a bf16 pattern, or the upper half of an fp32 pattern (HiF8
// rounding reads nothing below it, see qfa/cast/luts.py). Word constants are the upper halves of
// the fp32 patterns of the format's thresholds.
struct Consts {
  int max_w = 0;          // MAX (2^15)
  int overflow_w = 0;     // OVERFLOW_THRESHOLD (1.25 * 2^15)
  int min_denormal_w = 0; // MIN_DENORMAL (2^-22)
  int underflow_w = 0;    // UNDERFLOW_THRESHOLD (2^-23)
  int inf_w = 0x7F80;     // +Inf (an IEEE fact, not the format's)
  int nan_code = 0;
  int inf_code = 0;
  int band[3] = {0, 0, 0};  // |E| limits of the binades keeping >= 1, 2, 3 mantissa bits
  bool set = false;
};
Consts K;

void set_constants(const int64_t* c) {
  K.max_w = (int)c[0]; K.overflow_w = (int)c[1]; K.min_denormal_w = (int)c[2]; K.underflow_w = (int)c[3];
  K.nan_code = (int)c[4]; K.inf_code = (int)c[5];
  K.band[0] = (int)c[6]; K.band[1] = (int)c[7]; K.band[2] = (int)c[8];
  K.set = true;
}

// ---- the code of a rounded magnitude ---------------------------------------------------------
//
// After rounding (see encode_word), a nonzero finite magnitude r is 2^E (1 + M / 2^m) with E in
// [-15, 15] and m = m(E) mantissa bits, or a power-of-two denormal 2^E, E in [-22, -16]. With
// a = |E|, n = [E < 0] and t = (a << 7) | (r's 7 mantissa bits), the format's layout
// (qfa/cast/format.py) gives
//   a in [8, 15] (Dot 11, m = 1):  0x60 | n << 4 | (a - 8) << 1 | M  = 0x50 + 16 n + (t >> 6)
//   a in [4, 7]  (Dot 10, m = 2):  0x40 | n << 4 | (a - 4) << 2 | M  = 0x30 + 16 n + (t >> 5)
//   a in [2, 3]  (Dot 01, m = 3):  0x20 | n << 4 | (a - 2) << 3 | M  = 0x10 + 16 n + (t >> 4)
//   a == 1       (Dot 001):        0x10 | n << 3 | M                 = 0x08 +  8 n + (t >> 4)
//   a == 0       (Dot 0001):       0x08 | M                          = 0x08        + (t >> 4)
//   denormal:                      E + 23
// so the base steps down by 0x20 per band, by 8 (16 when negative) more for a <= 1, and the
// shift is 7 - m. The band limits are the format's (15, 7, 3); the rest is its bit layout.

inline int code_of_rounded(int r) {
  int er = r >> 7, E = er - 127;
  if (E < -K.band[0]) return er - 104;  // 2^E = code (E + 23); er - 127 + 23
  int a = E < 0 ? -E : E, n = E < 0;
  int t = (a << 7) | (r & 0x7F);
  int sh = a <= K.band[2] ? 4 : a <= K.band[1] ? 5 : 6;
  int base = 0x50 + 16 * n - (a <= K.band[1] ? 0x20 : 0) - (a <= K.band[2] ? 0x20 : 0);
  if (a <= 1) base -= 8 + 8 * n;
  return base + (t >> sh);
}

// The HiF8 code of a 16-bit word w (sign, 8 exponent bits, 7 mantissa bits): round to nearest,
// ties away from zero, in the input's binade: add the first dropped bit and clear the dropped
// bits (a carry lands on 2^(E+1), always a HiF8 value); [UNDERFLOW, MIN_DENORMAL) -> MIN_DENORMAL,
// below -> 0; from MAX up (clamped first) -> MAX, or Inf in inf mode from OVERFLOW up. NaN ->
// the NaN code, +-Inf -> +-Inf, and the sign unless the code is 0 (HiF8 has no -0).
inline uint8_t encode_word(int w, bool inf_mode) {
  int a = w & 0x7FFF, sign = (w >> 8) & 0x80;
  if (a > K.inf_w) return (uint8_t)K.nan_code;
  if (a == K.inf_w || (inf_mode && a >= K.overflow_w)) return (uint8_t)(K.inf_code | sign);
  int c = std::min(a, K.max_w), code;
  if (c < K.min_denormal_w) {
    code = c >= K.underflow_w ? 1 : 0;
  } else {
    int E = (c >> 7) - 127, ae = E < 0 ? -E : E;
    int m = (ae <= K.band[0]) + (ae <= K.band[1]) + (ae <= K.band[2]);
    int half = 0x40 >> m;
    int r = (c + half) & -(half + half);
    code = code_of_rounded(r);
  }
  return (uint8_t)(code ? code | sign : 0);
}

// ---- the encoder's tables (AVX-512 level) ------------------------------------------------------
//
// The rounding and the code above, by the input's biased exponent e: idx = e - (u - 1), saturated
// at 0, with u the underflow binade's exponent (2^-23: e = 104), so idx 0 holds every smaller e,
// idx 1 the underflow binade, and the binades up to MAX (e = 142) follow. Per idx:
//   kHalf, kKeep: r = (c + half) & keep is the rounded magnitude (idx 0: 0; idx 1: MIN_DENORMAL;
//                 above: add the first dropped bit, clear the dropped bits);
//   kCode:        for a rounded r of that exponent, its code is (kCode & 0xFF) + (mantissa >>
//                 (kCode >> 8)): code_of_rounded's base and shift.
// Built from encode_word's own rule (build_tables), 64 entries each: two registers of 32 words,
// looked up with one vpermi2w (AVX512BW). Checked exhaustively against the host table like the
// other levels.
alignas(64) uint16_t kHalf[64], kKeep[64], kCode[64];

int table_offset() { return (K.underflow_w >> 7) - 1; }

void build_tables() {
  int off = table_offset();
  for (int idx = 0; idx < 64; ++idx) {
    int e = idx + off, half = 0, keep = 0, code = 0;
    if (idx == 1) {
      half = K.min_denormal_w - K.underflow_w;
      keep = 0xFFFF & ~(half - 1);
    } else if (idx > 1 && e <= (K.max_w >> 7)) {
      int E = e - 127, ae = E < 0 ? -E : E;
      int m = (ae <= K.band[0]) + (ae <= K.band[1]) + (ae <= K.band[2]);
      half = 0x40 >> m;
      keep = 0xFFFF & -(half + half);
      code = code_of_rounded(e << 7) | (7 - m) << 8;
    }
    kHalf[idx] = (uint16_t)half;
    kKeep[idx] = (uint16_t)keep;
    kCode[idx] = (uint16_t)code;
  }
}

// The word of an fp32 value: its upper half, made a NaN pattern when the value is a NaN whose
// payload lies only in the lower half (it would read as Inf).
inline int word_of_fp32(uint32_t bits) {
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) bits |= 0x7FC00000u;
  return (int)(bits >> 16);
}

// ---- the code tables (scalar and AVX2 levels) ---------------------------------------------------
//
// kLut[t][inf][w]: the code of 16-bit pattern w, built from encode_word: t = 0 for a word (a bf16
// pattern, or an fp32 value's NaN-fixed upper half), t = 1 for an fp16 pattern (through its exact
// fp32 value); inf = the overflow mode. Without AVX-512 a lookup is the fastest encode measured
// (8 lookups packed into one 8-byte store: about 2x the AVX2 arithmetic on the same core).
alignas(64) uint8_t kLut[2][2][1 << 16];

void build_luts() {
  for (int inf = 0; inf < 2; ++inf)
    for (int w = 0; w < (1 << 16); ++w) {
      kLut[0][inf][w] = encode_word(w, inf != 0);
      kLut[1][inf][w] = encode_word(word_of_fp32(f2u(f32_of_f16((uint16_t)w))), inf != 0);
    }
}

// out[i] = lut[w[i]], 8 at a time.
void lut_words(const uint16_t* w, uint8_t* out, int64_t n, const uint8_t* lut) {
  const int64_t full = n - n % 8;
  for (int64_t i = 0; i < full; i += 8) {
    uint64_t a, b;
    std::memcpy(&a, w + i, 8);
    std::memcpy(&b, w + i + 4, 8);
    uint64_t v = (uint64_t)lut[a & 0xFFFF] | (uint64_t)lut[(a >> 16) & 0xFFFF] << 8 |
                 (uint64_t)lut[(a >> 32) & 0xFFFF] << 16 | (uint64_t)lut[a >> 48] << 24 |
                 (uint64_t)lut[b & 0xFFFF] << 32 | (uint64_t)lut[(b >> 16) & 0xFFFF] << 40 |
                 (uint64_t)lut[(b >> 32) & 0xFFFF] << 48 | (uint64_t)lut[b >> 48] << 56;
    std::memcpy(out + i, &v, 8);
  }
  for (int64_t i = full; i < n; ++i) out[i] = lut[w[i]];
}

// ---- scalar level (the reference for the SIMD ones: the same operations in the same order) -----

// ---- the row plan ------------------------------------------------------------------------------
//
// A tensor is seen as (A, N, S, 128) with element strides (sA, sN, sS) and the last stride 1: BNSD
// is (B, N, S), BSND (B, N, S) by its strides, TND (1, N, T). A segment is (a, s0, valid, all):
// rows s0 .. s0 + all of batch a, the first ``valid`` of them real (the statistics and the K
// means read those; the encode writes all). The K means are (segments, N, 128) fp32.
struct Plan {
  int64_t sA, sN, sS;
  int64_t heads;
  const int64_t* segs;  // 4 per segment
  int64_t n;
  int64_t nseg() const { return n; }
  int64_t offset(int64_t g, int64_t h, int64_t s) const {
    return segs[4 * g] * sA + h * sN + (segs[4 * g + 1] + s) * sS;
  }
};

Plan make_plan(const int64_t* strides, const int64_t* segs, int64_t nseg, int64_t heads) {
  return Plan{strides[0], strides[1], strides[2], heads, segs, nseg};
}

struct Stats {
  double sumsq = 0.0;
  uint32_t max_bits = 0;  // largest |y| pattern: the amax when finite, >= Inf's pattern when not
};

void stats_row_scalar(const RowIn& in, Stats& st) {
  float y[kD];
  load_row_scalar(in, y);
  for (int i = 0; i < kD; ++i) {
    st.sumsq += (double)y[i] * (double)y[i];
    st.max_bits = std::max(st.max_bits, f2u(y[i]) & 0x7FFFFFFFu);
  }
}

inline bool saturates(float q) {
  uint32_t a = f2u(q) & 0x7FFFFFFFu;
  return a >= ((uint32_t)K.overflow_w << 16) && a < 0x7F800000u;
}

// x / scale as the encode needs it: a power-of-two scale multiplies by its reciprocal, which is
// exact and so gives the division's bits (both are the correctly rounded x * 2^-k); any other
// scale divides.
struct Divisor {
  float scale, recip;
  bool pow2;
};

Divisor divisor_of(float scale) {
  uint32_t b = f2u(scale);
  uint32_t e = (b >> 23) & 0xFF;
  // the reciprocal a normal fp32 too (a flush-to-zero mode must not see a denormal constant)
  bool pow2 = (b & 0x7FFFFFu) == 0 && e >= 2 && e <= 252;
  return Divisor{scale, pow2 ? 1.0f / scale : 0.0f, pow2};
}

void encode_rows_scalar(const RowIn& in0, int64_t rows, int64_t stride, uint8_t* out, int64_t out_stride,
                        const Divisor& dv, int64_t& sat) {
  RowIn in = in0;
  float y[kD];
  for (int64_t s = 0; s < rows; ++s) {
    in.x = static_cast<const char*>(in0.x) + s * stride * esize(in0.dt);
    load_row_scalar(in, y);
    uint16_t w[kD];
    for (int i = 0; i < kD; ++i) {
      float q = dv.pow2 ? y[i] * dv.recip : y[i] / dv.scale;
      sat += saturates(q);
      w[i] = (uint16_t)word_of_fp32(f2u(q));
    }
    lut_words(w, out + s * out_stride, kD, kLut[0][0]);
  }
}

// Words of up to kChunk values at a time, then the table: the flat cast of fp32 (and of x / scale).
constexpr int64_t kChunk = 256;

void encode_flat_scalar(const void* x, int dt, uint8_t* out, int64_t n, bool inf_mode) {
  if (dt != F32) return lut_words(static_cast<const uint16_t*>(x), out, n, kLut[dt == F16][inf_mode]);
  uint16_t w[kChunk];
  for (int64_t i = 0; i < n; i += kChunk) {
    int64_t m = std::min(kChunk, n - i);
    for (int64_t k = 0; k < m; ++k) w[k] = (uint16_t)word_of_fp32(f2u(load_scalar(x, i + k, dt)));
    lut_words(w, out + i, m, kLut[0][inf_mode]);
  }
}

int64_t quantize_flat_scalar(const void* x, int dt, uint8_t* out, int64_t n, float scale) {
  int64_t sat = 0;
  uint16_t w[kChunk];
  for (int64_t i = 0; i < n; i += kChunk) {
    int64_t m = std::min(kChunk, n - i);
    for (int64_t k = 0; k < m; ++k) {
      float q = load_scalar(x, i + k, dt) / scale;
      sat += saturates(q);
      w[k] = (uint16_t)word_of_fp32(f2u(q));
    }
    lut_words(w, out + i, m, kLut[0][0]);
  }
  return sat;
}

#ifdef QFA_X86

// Rows ahead that the SIMD passes ask the cache for: a chunk's rows are read once each, from
// memory when other work ran since the tensor was written (the bench times the drop-in after
// SDPA), and the hardware prefetcher restarts at every chunk. Measured on the Zen 5 guest (the
// drop-in's passes, fp32, S = 1024, right after SDPA): 0.95 ms instead of 1.17 (medians of six
// processes each); 4, 16 and 32 rows ahead did no better than 8.
constexpr int64_t kPrefetchRows = 8;

inline void prefetch_row(const RowIn& in0, int64_t s, int64_t stride) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(in0.x) + s * stride * esize(in0.dt);
  const uintptr_t end = first + kD * esize(in0.dt);  // an unaligned row spans one line more
  for (uintptr_t line = first & ~uintptr_t(63); line < end; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
}

// ---- AVX2 level: 16 words / 8 floats a register ---------------------------------------------------

// ``stream``: a non-temporal store (out 32-byte aligned), for outputs larger than the caches:
// it skips reading each output line before writing it.
T_AVX2 inline void store32_avx2(uint8_t* out, __m256i v, bool stream) {
  if (stream) _mm256_stream_si256(reinterpret_cast<__m256i*>(out), v);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), v);
}

T_AVX2 inline __m256i nanfix_avx2(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i a = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
  return _mm256_or_si256(bits, _mm256_and_si256(nan, _mm256_set1_epi32(0x7FC00000)));
}

// 16 floats -> their 16 words (word_of_fp32).
T_AVX2 inline __m256i words_avx2(__m256 v0, __m256 v1) {
  __m256i h0 = _mm256_srli_epi32(nanfix_avx2(v0), 16), h1 = _mm256_srli_epi32(nanfix_avx2(v1), 16);
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(h0, h1), 0xD8);
}

T_AVX2 inline int sat_count_avx2(__m256 q) {
  __m256i a = _mm256_and_si256(_mm256_castps_si256(q), _mm256_set1_epi32(0x7FFFFFFF));
  __m256i ge = _mm256_cmpgt_epi32(a, _mm256_set1_epi32((K.overflow_w << 16) - 1));
  __m256i fin = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), a);
  return _mm_popcnt_u32((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_and_si256(ge, fin))));
}

T_AVX2 void stats_rows_avx2(const RowIn& in0, int64_t rows, int64_t stride, Stats& st) {
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  __m256i mx = _mm256_setzero_si256();
  const __m256i absm = _mm256_set1_epi32(0x7FFFFFFF);
  RowIn in = in0;
  for (int64_t s = 0; s < rows; ++s) {
    in.x = static_cast<const char*>(in0.x) + s * stride * esize(in0.dt);
    if (s + kPrefetchRows < rows) prefetch_row(in0, s + kPrefetchRows, stride);
    __m256 r[16];
    load_row_avx2(in, r);
    for (int j = 0; j < 16; ++j) {
      mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_castps_si256(r[j]), absm));
      __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(r[j])), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(r[j], 1));
      acc[(2 * j) & 3] = _mm256_add_pd(acc[(2 * j) & 3], _mm256_mul_pd(lo, lo));
      acc[(2 * j + 1) & 3] = _mm256_add_pd(acc[(2 * j + 1) & 3], _mm256_mul_pd(hi, hi));
    }
  }
  alignas(32) double d[4][4];
  alignas(32) uint32_t m[8];
  for (int i = 0; i < 4; ++i) _mm256_store_pd(d[i], acc[i]);
  _mm256_store_si256(reinterpret_cast<__m256i*>(m), mx);
  for (int i = 0; i < 4; ++i) for (int l = 0; l < 4; ++l) st.sumsq += d[i][l];
  for (int l = 0; l < 8; ++l) st.max_bits = std::max(st.max_bits, m[l]);
}

T_AVX2 void encode_rows_avx2(const RowIn& in0, int64_t rows, int64_t stride, uint8_t* out, int64_t out_stride,
                             const Divisor& dv, int64_t& sat) {
  const __m256 sv = _mm256_set1_ps(dv.scale), rv = _mm256_set1_ps(dv.recip);
  RowIn in = in0;
  int64_t count = 0;
  for (int64_t s = 0; s < rows; ++s) {
    in.x = static_cast<const char*>(in0.x) + s * stride * esize(in0.dt);
    if (s + kPrefetchRows < rows) prefetch_row(in0, s + kPrefetchRows, stride);
    __m256 r[16];
    load_row_avx2(in, r);
    alignas(32) uint16_t w[kD];
    for (int j = 0; j < 16; j += 2) {
      __m256 q0 = dv.pow2 ? _mm256_mul_ps(r[j], rv) : _mm256_div_ps(r[j], sv);
      __m256 q1 = dv.pow2 ? _mm256_mul_ps(r[j + 1], rv) : _mm256_div_ps(r[j + 1], sv);
      count += sat_count_avx2(q0) + sat_count_avx2(q1);
      _mm256_store_si256(reinterpret_cast<__m256i*>(w + 8 * j), words_avx2(q0, q1));
    }
    lut_words(w, out + s * out_stride, kD, kLut[0][0]);
  }
  sat += count;
}

// 32 fp32/fp16 values from x + i -> their words.
T_AVX2 inline void words32_avx2(const void* x, int64_t i, int dt, uint16_t* w) {
  for (int k = 0; k < 32; k += 16)
    _mm256_store_si256(reinterpret_cast<__m256i*>(w + k), words_avx2(load8_avx2(x, i + k, dt), load8_avx2(x, i + k + 8, dt)));
}

T_AVX2 inline int64_t quantize32_avx2(const void* x, int64_t i, int dt, uint8_t* out, __m256 sv) {
  alignas(32) uint16_t w[32];
  int64_t sat = 0;
  for (int k = 0; k < 32; k += 16) {
    __m256 q0 = _mm256_div_ps(load8_avx2(x, i + k, dt), sv), q1 = _mm256_div_ps(load8_avx2(x, i + k + 8, dt), sv);
    sat += sat_count_avx2(q0) + sat_count_avx2(q1);
    _mm256_store_si256(reinterpret_cast<__m256i*>(w + k), words_avx2(q0, q1));
  }
  lut_words(w, out, 32, kLut[0][0]);
  return sat;
}

// ---- AVX-512 level: 32 words / 16 floats a register ----------------------------------------------

// The encoder's constants in registers, built once per span: K and the tables are globals that
// a store through the uint8_t output may alias, so read inside the loop they were reloaded and
// broadcast again after every store (seen in a profile of the encode pass; the preparation on
// one thread moved by about 2 %, within noise).
struct Enc512 {
  __m512i half_lo, half_hi, keep_lo, keep_hi, code_lo, code_hi, off, max_w, inf_w, overflow_w, inf_code, nan_code;
};

T_AVX512 inline Enc512 enc_consts_512() {
  return {_mm512_load_si512(kHalf), _mm512_load_si512(kHalf + 32), _mm512_load_si512(kKeep),
          _mm512_load_si512(kKeep + 32), _mm512_load_si512(kCode), _mm512_load_si512(kCode + 32),
          _mm512_set1_epi16((short)table_offset()), _mm512_set1_epi16((short)K.max_w),
          _mm512_set1_epi16((short)K.inf_w), _mm512_set1_epi16((short)K.overflow_w),
          _mm512_set1_epi16((short)K.inf_code), _mm512_set1_epi16((short)K.nan_code)};
}

// 32 words -> their codes (in 16-bit lanes); `saturated`: the finite words at or above the
// overflow threshold (those the non-Inf mode clamps to MAX).
T_AVX512 inline __m512i enc_words_512(__m512i w, bool inf_mode, const Enc512& E, __mmask32* saturated = nullptr) {
  __m512i a = _mm512_and_si512(w, _mm512_set1_epi16(0x7FFF));
  __m512i c = _mm512_min_epu16(a, E.max_w);
  __m512i idx = _mm512_subs_epu16(_mm512_srli_epi16(c, 7), E.off);
  __m512i r = _mm512_and_si512(_mm512_add_epi16(c, _mm512_permutex2var_epi16(E.half_lo, idx, E.half_hi)),
                               _mm512_permutex2var_epi16(E.keep_lo, idx, E.keep_hi));
  __m512i ts = _mm512_permutex2var_epi16(E.code_lo, _mm512_subs_epu16(_mm512_srli_epi16(r, 7), E.off), E.code_hi);
  __m512i code = _mm512_add_epi16(_mm512_and_si512(ts, _mm512_set1_epi16(0xFF)),
                                  _mm512_srlv_epi16(_mm512_and_si512(r, _mm512_set1_epi16(0x7F)), _mm512_srli_epi16(ts, 8)));
  __m512i sign = _mm512_and_si512(_mm512_srli_epi16(w, 8), _mm512_set1_epi16(0x80));
  code = _mm512_mask_mov_epi16(code, _mm512_test_epi16_mask(code, code), _mm512_or_si512(code, sign));
  __mmask32 big = _mm512_cmpge_epu16_mask(a, E.overflow_w);
  __mmask32 is_inf = inf_mode ? big & _mm512_cmple_epu16_mask(a, E.inf_w) : _mm512_cmpeq_epi16_mask(a, E.inf_w);
  if (saturated) *saturated = big & _mm512_cmplt_epu16_mask(a, E.inf_w);
  code = _mm512_mask_mov_epi16(code, is_inf, _mm512_or_si512(E.inf_code, sign));
  return _mm512_mask_mov_epi16(code, _mm512_cmpgt_epu16_mask(a, E.inf_w), E.nan_code);
}

T_AVX512 inline __m512i nanfix_512(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                          _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_or_epi32(bits, nan, bits, _mm512_set1_epi32(0x7FC00000));
}

// 32 floats -> their 32 words: the odd (upper) halves, in order.
T_AVX512 inline __m512i words_512(__m512 v0, __m512 v1) {
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                       31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(nanfix_512(v0), odd, nanfix_512(v1));
}

// The codes of 32 quotients and the count of those that saturate: a finite quotient at or above
// the overflow threshold has a word at or above its word, a NaN's word stays a NaN's (nanfix).
T_AVX512 inline __m256i quotient_codes_512(__m512 q0, __m512 q1, const Enc512& E, int64_t& sat) {
  __mmask32 big;
  __m256i codes = _mm512_cvtepi16_epi8(enc_words_512(words_512(q0, q1), false, E, &big));
  sat += _mm_popcnt_u32((unsigned)big);
  return codes;
}

T_AVX512 void stats_rows_512(const RowIn& in0, int64_t rows, int64_t stride, Stats& st) {
  __m512d acc[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
  __m512i mx = _mm512_setzero_si512();
  const __m512i absm = _mm512_set1_epi32(0x7FFFFFFF);
  RowIn in = in0;
  for (int64_t s = 0; s < rows; ++s) {
    in.x = static_cast<const char*>(in0.x) + s * stride * esize(in0.dt);
    if (s + kPrefetchRows < rows) prefetch_row(in0, s + kPrefetchRows, stride);
    __m512 r[8];
    load_row_512(in, r);
    for (int j = 0; j < 8; ++j) {
      mx = _mm512_max_epu32(mx, _mm512_and_si512(_mm512_castps_si512(r[j]), absm));
      __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(r[j])), hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(r[j], 1));
      // A float's square is exact in float64 (48 significant bits), so the fused multiply-add
      // rounds once, where the add of mul + add did: the bits of this level's mul + add (the
      // levels' partial sums differ anyway, see the tests), one instruction fewer.
      acc[(2 * j) & 3] = _mm512_fmadd_pd(lo, lo, acc[(2 * j) & 3]);
      acc[(2 * j + 1) & 3] = _mm512_fmadd_pd(hi, hi, acc[(2 * j + 1) & 3]);
    }
  }
  for (int i = 0; i < 4; ++i) st.sumsq += _mm512_reduce_add_pd(acc[i]);
  st.max_bits = std::max(st.max_bits, (uint32_t)_mm512_reduce_max_epu32(mx));
}

T_AVX512 void encode_rows_512(const RowIn& in0, int64_t rows, int64_t stride, uint8_t* out, int64_t out_stride,
                              const Divisor& dv, int64_t& sat) {
  const __m512 sv = _mm512_set1_ps(dv.scale), rv = _mm512_set1_ps(dv.recip);
  const Enc512 E = enc_consts_512();
  const bool pow2 = dv.pow2;
  RowIn in = in0;
  int64_t count = 0;
  for (int64_t s = 0; s < rows; ++s) {
    in.x = static_cast<const char*>(in0.x) + s * stride * esize(in0.dt);
    if (s + kPrefetchRows < rows) prefetch_row(in0, s + kPrefetchRows, stride);
    __m512 r[8];
    load_row_512(in, r);
    uint8_t* o = out + s * out_stride;
    for (int j = 0; j < 8; j += 2) {
      __m512 q0 = pow2 ? _mm512_mul_ps(r[j], rv) : _mm512_div_ps(r[j], sv);
      __m512 q1 = pow2 ? _mm512_mul_ps(r[j + 1], rv) : _mm512_div_ps(r[j + 1], sv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * j), quotient_codes_512(q0, q1, E, count));
    }
  }
  sat += count;
}

T_AVX512 inline void encode64_512(const void* x, int64_t i, int dt, uint8_t* out, bool inf_mode, bool stream,
                                  const Enc512& E) {
  for (int k = 0; k < 2; ++k) {
    __m512i w;
    if (dt == BF16) w = _mm512_loadu_si512(static_cast<const uint16_t*>(x) + i + 32 * k);
    else w = words_512(load16_512(x, i + 32 * k, dt), load16_512(x, i + 32 * k + 16, dt));
    store32_avx2(out + 32 * k, _mm512_cvtepi16_epi8(enc_words_512(w, inf_mode, E)), stream);
  }
}

T_AVX512 inline int64_t quantize32_512(const void* x, int64_t i, int dt, uint8_t* out, __m512 sv, bool stream,
                                       const Enc512& E) {
  int64_t sat = 0;
  __m256i codes = quotient_codes_512(_mm512_div_ps(load16_512(x, i, dt), sv), _mm512_div_ps(load16_512(x, i + 16, dt), sv),
                                     E, sat);
  store32_avx2(out, codes, stream);
  return sat;
}

T_AVX512 void encode_flat_512(const void* x, int dt, uint8_t* out, int64_t n, bool inf_mode, bool stream) {
  const Enc512 E = enc_consts_512();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) encode64_512(x, i, dt, out + i, inf_mode, stream, E);
  if (stream) _mm_sfence();
  if (i < n) {  // the tail through the same code, from a zero-padded copy
    alignas(64) uint8_t buf[64 * 4] = {0};
    alignas(64) uint8_t codes[64];
    std::memcpy(buf, static_cast<const char*>(x) + i * esize(dt), (n - i) * esize(dt));
    encode64_512(buf, 0, dt, codes, inf_mode, false, E);
    std::memcpy(out + i, codes, n - i);
  }
}

T_AVX512 int64_t quantize_flat_512(const void* x, int dt, uint8_t* out, int64_t n, float scale, bool stream) {
  const __m512 sv = _mm512_set1_ps(scale);
  const Enc512 E = enc_consts_512();
  int64_t i = 0, sat = 0;
  for (; i + 32 <= n; i += 32) sat += quantize32_512(x, i, dt, out + i, sv, stream, E);
  if (stream) _mm_sfence();
  if (i < n) {  // zero padding encodes as 0 and never saturates
    alignas(64) uint8_t buf[32 * 4] = {0};
    alignas(64) uint8_t codes[32];
    std::memcpy(buf, static_cast<const char*>(x) + i * esize(dt), (n - i) * esize(dt));
    sat += quantize32_512(buf, 0, dt, codes, sv, false, E);
    std::memcpy(out + i, codes, n - i);
  }
  return sat;
}

// Without AVX-512: bf16 and fp16 patterns straight through the table; fp32 values' words by SIMD.
T_AVX2 void encode_flat_avx2(const void* x, int dt, uint8_t* out, int64_t n, bool inf_mode) {
  if (dt != F32) return lut_words(static_cast<const uint16_t*>(x), out, n, kLut[dt == F16][inf_mode]);
  int64_t i = 0;
  alignas(32) uint16_t w[32];
  for (; i + 32 <= n; i += 32) {
    words32_avx2(x, i, dt, w);
    lut_words(w, out + i, 32, kLut[0][inf_mode]);
  }
  if (i < n) encode_flat_scalar(static_cast<const float*>(x) + i, dt, out + i, n - i, inf_mode);
}

T_AVX2 int64_t quantize_flat_avx2(const void* x, int dt, uint8_t* out, int64_t n, float scale) {
  const __m256 sv = _mm256_set1_ps(scale);
  int64_t i = 0, sat = 0;
  for (; i + 32 <= n; i += 32) sat += quantize32_avx2(x, i, dt, out + i, sv);
  if (i < n) sat += quantize_flat_scalar(static_cast<const char*>(x) + i * esize(dt), dt, out + i, n - i, scale);
  return sat;
}

#endif  // QFA_X86

// ---- dispatch ------------------------------------------------------------------------------------

enum Isa { SCALAR = 0, AVX2 = 1, AVX512 = 2 };

int detect_isa() {
#ifdef QFA_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("popcnt"))
    return AVX2;
#endif
  return SCALAR;
}

const int kDetected = detect_isa();

// The level to run: the best the CPU has, or a lower one a test asks for (-1: the best); -1 when
// the CPU lacks it or the constants are not set (the Python side checks both first).
int pick(int64_t isa) {
  if (!K.set || isa > kDetected) return -1;
  return isa < 0 ? kDetected : (int)isa;
}

void stats_rows(int isa, const RowIn& in, int64_t rows, int64_t stride, Stats& st) {
#ifdef QFA_X86
  if (isa == AVX512) return stats_rows_512(in, rows, stride, st);
  if (isa == AVX2) return stats_rows_avx2(in, rows, stride, st);
#endif
  RowIn r = in;
  for (int64_t s = 0; s < rows; ++s) {
    r.x = static_cast<const char*>(in.x) + s * stride * esize(in.dt);
    stats_row_scalar(r, st);
  }
}

void encode_rows(int isa, const RowIn& in, int64_t rows, int64_t stride, uint8_t* out, int64_t out_stride,
                 const Divisor& dv, int64_t& sat) {
#ifdef QFA_X86
  if (isa == AVX512) return encode_rows_512(in, rows, stride, out, out_stride, dv, sat);
  if (isa == AVX2) return encode_rows_avx2(in, rows, stride, out, out_stride, dv, sat);
#endif
  encode_rows_scalar(in, rows, stride, out, out_stride, dv, sat);
}

void rotate_row(int isa, const RowIn& in, void* out, int odt) {
#ifdef QFA_X86
  if (isa == AVX512) return rotate_row_512(in, out, odt);
  if (isa == AVX2) return rotate_row_avx2(in, out, odt);
#endif
  rotate_row_scalar(in, out, odt);
}

void encode_span(int isa, const void* x, int dt, uint8_t* out, int64_t n, bool inf_mode, bool stream) {
#ifdef QFA_X86
  if (isa == AVX512) return encode_flat_512(x, dt, out, n, inf_mode, stream);
  if (isa == AVX2) return encode_flat_avx2(x, dt, out, n, inf_mode);
#endif
  encode_flat_scalar(x, dt, out, n, inf_mode);
}

int64_t quantize_span(int isa, const void* x, int dt, uint8_t* out, int64_t n, float scale, bool stream) {
#ifdef QFA_X86
  if (isa == AVX512) return quantize_flat_512(x, dt, out, n, scale, stream);
  if (isa == AVX2) return quantize_flat_avx2(x, dt, out, n, scale);
#endif
  return quantize_flat_scalar(x, dt, out, n, scale);
}

// ---- the K means -------------------------------------------------------------------------------
//
// Per segment and head, the float64 sum of each channel over the valid rows in row order, divided
// by their count and rounded to fp32 (0 without rows). Plain loops: each channel's sum is one
// sequential chain whatever the compiler vectorises, so every level gives the same bits.
void mean_of(const char* x, int dt, int64_t rows, int64_t stride_bytes, float* mu) {
  double acc[kD] = {0.0};
  for (int64_t s = 0; s < rows; ++s) {
    const char* row = x + s * stride_bytes;
    if (dt == F32) { const float* p = reinterpret_cast<const float*>(row); for (int i = 0; i < kD; ++i) acc[i] += p[i]; }
    else if (dt == BF16) { const uint16_t* p = reinterpret_cast<const uint16_t*>(row);
      for (int i = 0; i < kD; ++i) acc[i] += (double)u2f((uint32_t)p[i] << 16); }
    else { const uint16_t* p = reinterpret_cast<const uint16_t*>(row);
      for (int i = 0; i < kD; ++i) acc[i] += (double)f32_of_f16(p[i]); }
  }
  for (int i = 0; i < kD; ++i) mu[i] = rows ? (float)(acc[i] / (double)rows) : 0.0f;
}

// ---- threads ---------------------------------------------------------------------------------------

// libgomp's thread team does not survive fork: a child's first parallel region would wait
// forever for the parent's threads. A forked process (and its descendants) runs the passes on
// the own pool (which starts afresh there) and the flat casts on its calling thread.
std::atomic<bool> g_forked{false};

void mark_forked() { g_forked.store(true); }

const int kAtfork = pthread_atfork(nullptr, nullptr, mark_forked);

// The plain cast's team: at most one thread per chunk, the calling thread alone in a forked child.
int team_size(int64_t threads, int64_t chunks) {
  return g_forked.load() ? 1 : (int)std::min(threads, chunks);
}

// Rows per chunk of a pass (8K values: tens of microseconds), and the fewest rows a pass opens a
// region for (a decode step's few rows run on the calling thread).
constexpr int64_t kChunkRows = 64;
constexpr int64_t kParallelRows = 512;
// A region whose caller waited this long for the other threads at its end (one arrived late, or
// was preempted mid-chunk: another process busy on its core, or the host's, on a shared virtual
// machine), or lost this much of its own time to a thread sharing its core, sends the next
// kPoolMs of passes to the library's own pool (item_pool.h), whose caller waits only for the
// chunks a thread has taken: a helper slow to wake takes none (one preempted in the middle of a
// chunk still holds the caller up, for that chunk's time). Measured on the shared 2-core hosts: the team took 0.7-1.0 ms for the
// drop-in's three tensors at S = 1024 where the caller alone took 1.2-1.5 ms, but one region in
// four waited 5-25 ms for a thread whose core another process held; on a quiet AVX2 EPYC guest
// (2026-12-03) regions still waited 0.7-1.8 ms at their end now and then, and the caller-alone
// fallback this replaced (for 2 s after each) left the drop-in's preparation at 5.0-5.4 ms where
// the team took 3.3.
constexpr int64_t kLateUs = 200;
constexpr int64_t kPoolMs = 200;
std::atomic<int64_t> pool_until{0};
// 0: as above; 1: always the calling thread; 2: always the OpenMP team, 3: always the own pool,
// when a pass is large enough (the tests pin each, to check that they give the same bits).
std::atomic<int> team_mode{0};
// Who ran the last pass (0 the caller alone, 1 the own pool, 2 OpenMP): for the tests.
std::atomic<int> last_team{0};

// The calling thread's CPU time (us): where it falls behind the wall clock during a region, the
// thread shared its core (both of the team's threads put on one core when another process holds
// the other), and the team is no faster than the caller alone.
inline int64_t thread_cpu_us() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

// fn(i) for every chunk i in [0, n): in order on the calling thread, or on `threads` threads of
// torch's OpenMP team or of the own pool (with the caller), each taking the next chunk. `rows`:
// the pass's size. A forked child runs on the pool: libgomp's team does not survive fork.
template <typename F>
void run_chunks(int64_t n, int64_t rows, int64_t threads, const F& fn) {
  const int mode = team_mode.load();
  if (threads <= 1 || n < 2 || rows < kParallelRows || mode == 1) {
    last_team.store(0);
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  if (g_forked.load() || mode == 3 || (mode == 0 && now_us() < pool_until.load())) {
    try {
      Pool::get().run(n, std::min(threads, n), [&fn](int64_t i) { fn(i); });
      last_team.store(1);
    } catch (...) {
      // No helper thread (the process's thread limit, memory): nothing may leave a C entry
      // point, and a chunk's result is the same whoever runs it, again: the caller runs them all.
      last_team.store(0);
      for (int64_t i = 0; i < n; ++i) fn(i);
    }
    return;
  }
  last_team.store(2);
  std::atomic<int64_t> next{0};
  const int64_t wall0 = now_us(), cpu0 = thread_cpu_us();
  int64_t wall1 = 0, cpu1 = 0;
#pragma omp parallel num_threads((int)std::min(threads, n))
  {
    for (int64_t i; (i = next.fetch_add(1)) < n;) fn(i);
    if (omp_get_thread_num() == 0) { wall1 = now_us(); cpu1 = thread_cpu_us(); }
  }
  const int64_t end = now_us();
  // waited at the end for a late thread, or shared its core while working
  if (mode == 0 && (end - wall1 > kLateUs || (wall1 - wall0) - (cpu1 - cpu0) > kLateUs))
    pool_until.store(end + kPoolMs * 1000);
}

// A pass's chunks: (segment, head, first row, rows).
struct Chunk {
  int64_t g, h, s0, rows;
};

// The rows of each (segment, head) slab, `valid` (the statistics) or all (the encode), in chunks
// of kChunkRows, or one chunk per slab (`whole`: the K means need the slab's rows together).
std::vector<Chunk> chunks_of(const Plan& p, bool valid, bool whole) {
  std::vector<Chunk> out;
  for (int64_t g = 0; g < p.nseg(); ++g) {
    int64_t rows = p.segs[4 * g + (valid ? 2 : 3)];
    for (int64_t h = 0; h < p.heads; ++h) {
      if (whole) { out.push_back({g, h, 0, rows}); continue; }
      for (int64_t s0 = 0; s0 < rows; s0 += kChunkRows) out.push_back({g, h, s0, std::min(kChunkRows, rows - s0)});
    }
  }
  return out;
}

int64_t total_rows(const std::vector<Chunk>& cs) {
  int64_t n = 0;
  for (const Chunk& c : cs) n += c.rows;
  return n;
}

// A chunk of tensor t of a batched pass.
struct TensorChunk {
  int64_t t;
  Chunk c;
};

int64_t total_rows(const std::vector<TensorChunk>& cs) {
  int64_t n = 0;
  for (const TensorChunk& c : cs) n += c.c.rows;
  return n;
}

// One tensor of a batched pass (qfa_prep_stats, qfa_prep_encode), seen as (A, N, S, 128): its
// data and dtype code, element strides (sA, sN, sS), segments (a, first row, valid rows, all
// rows; nseg of them) and N; whether it is rotated; the fp32 means (segments, N, 128) to
// subtract (null: none) and, for pass 1, whether to compute them first; for pass 2 the codes'
// tensor, its strides and the scale. cpu_prepare.py's _Tensor mirrors it field for field.
struct PrepTensor {
  const void* x;
  int64_t dt;
  const int64_t* strides;
  const int64_t* segs;
  int64_t nseg;
  int64_t heads;
  int64_t rotate;
  float* mean;
  int64_t compute_mean;
  uint8_t* out;
  const int64_t* out_strides;
  double scale;
};
static_assert(sizeof(PrepTensor) == 12 * 8 && offsetof(PrepTensor, scale) == 11 * 8,
              "PrepTensor: 12 fields of 8 bytes, as cpu_prepare.py's _Tensor (checked at load: qfa_prep_tensor_size)");

}  // namespace

// ---- entry points (C ABI) --------------------------------------------------------------------------

extern "C" {

void qfa_set_constants(const int64_t* c) {
  set_constants(c);
  build_tables();
  build_luts();
}

int64_t qfa_isa_level() { return kDetected; }

int64_t qfa_prep_tensor_size() { return (int64_t)sizeof(PrepTensor); }

void qfa_set_team(int64_t mode) { team_mode.store((int)mode); }

int64_t qfa_last_team() { return last_team.load(); }

// Pass 1 of n tensors in one parallel region (the drop-in's q, k and v: each region's hand-over
// costs tens of microseconds, and under load each is a chance to wait for a late thread): per
// tensor t, the statistics of y = H (x - mu) (each part optional) over the valid rows into
// result[3t .. 3t+2]: [float64 sum of y^2, max |y| (as fp32), 1.0 when some y is NaN or Inf else
// 0.0]; the sum is that tensor's chunks' partial sums added in chunk order, so a tensor's result
// is the same whichever tensors share its region. ``mean`` (fp32 (segments, N, 128), null: none)
// is subtracted; with ``compute_mean`` it is written first, the K means per (segment, head)
// slab, and the slab is then read a second time from cache.
int64_t qfa_prep_stats(int64_t n, const PrepTensor* ts, double c, int64_t threads, int64_t isa, double* result) {
  int level = pick(isa);
  if (level < 0) return -1;
  std::vector<Plan> plans;
  std::vector<TensorChunk> cs;
  for (int64_t t = 0; t < n; ++t) {
    plans.push_back(make_plan(ts[t].strides, ts[t].segs, ts[t].nseg, ts[t].heads));
    for (const Chunk& k : chunks_of(plans.back(), true, ts[t].compute_mean != 0)) cs.push_back({t, k});
  }
  std::vector<Stats> part(cs.size());
  run_chunks((int64_t)cs.size(), total_rows(cs), threads, [&](int64_t i) {
    const PrepTensor& x = ts[cs[i].t];
    const Plan& p = plans[cs[i].t];
    const Chunk& k = cs[i].c;
    const int d = (int)x.dt;
    const char* row0 = static_cast<const char*>(x.x) + p.offset(k.g, k.h, k.s0) * esize(d);
    float* m = x.mean ? x.mean + (k.g * x.heads + k.h) * kD : nullptr;
    if (m && x.compute_mean) mean_of(row0, d, k.rows, p.sS * esize(d), m);
    if (k.rows) stats_rows(level, RowIn{row0, d, m, x.rotate != 0, (float)c}, k.rows, p.sS, part[i]);
  });
  for (int64_t t = 0; t < n; ++t) {
    Stats st;
    for (size_t i = 0; i < cs.size(); ++i) {
      if (cs[i].t != t) continue;
      st.sumsq += part[i].sumsq;
      st.max_bits = std::max(st.max_bits, part[i].max_bits);
    }
    bool nonfinite = st.max_bits >= 0x7F800000u;
    result[3 * t] = st.sumsq;
    result[3 * t + 1] = nonfinite ? INFINITY : (double)u2f(st.max_bits);
    result[3 * t + 2] = nonfinite ? 1.0 : 0.0;
  }
  return 0;
}

// The K means alone (segments, N, 128): for a K whose scale is given.
int64_t qfa_key_means(const void* x, int64_t dt, const int64_t* strides, const int64_t* segs, int64_t nseg, int64_t heads,
                      float* mu, int64_t threads) {
  Plan p = make_plan(strides, segs, nseg, heads);
  const char* base = static_cast<const char*>(x);
  int d = (int)dt;
  std::vector<Chunk> cs = chunks_of(p, true, true);
  run_chunks((int64_t)cs.size(), total_rows(cs), threads, [&](int64_t i) {
    const Chunk& k = cs[i];
    mean_of(base + p.offset(k.g, k.h, 0) * esize(d), d, k.rows, p.sS * esize(d), mu + (k.g * heads + k.h) * kD);
  });
  return 0;
}

// Pass 2 of n tensors in one parallel region: per tensor t, the HiF8 codes of H (x - mu) / scale
// (saturating) for every row of every segment, into ``out`` (uint8, element strides
// ``out_strides`` in the same (A, N, S) roles); saturated[t]: how many finite values reached the
// overflow threshold (saturated to +-MAX).
int64_t qfa_prep_encode(int64_t n, const PrepTensor* ts, double c, int64_t threads, int64_t isa, int64_t* saturated) {
  int level = pick(isa);
  if (level < 0) return -1;
  std::vector<Plan> plans, outs;
  std::vector<Divisor> dvs;
  std::vector<TensorChunk> cs;
  for (int64_t t = 0; t < n; ++t) {
    plans.push_back(make_plan(ts[t].strides, ts[t].segs, ts[t].nseg, ts[t].heads));
    outs.push_back(make_plan(ts[t].out_strides, ts[t].segs, ts[t].nseg, ts[t].heads));
    dvs.push_back(divisor_of((float)ts[t].scale));
    for (const Chunk& k : chunks_of(plans.back(), false, false)) cs.push_back({t, k});
  }
  std::vector<int64_t> sat(cs.size(), 0);
  run_chunks((int64_t)cs.size(), total_rows(cs), threads, [&](int64_t i) {
    const PrepTensor& x = ts[cs[i].t];
    const Plan& p = plans[cs[i].t];
    const Plan& o = outs[cs[i].t];
    const Chunk& k = cs[i].c;
    const int d = (int)x.dt;
    const float* m = x.mean ? x.mean + (k.g * x.heads + k.h) * kD : nullptr;
    RowIn in{static_cast<const char*>(x.x) + p.offset(k.g, k.h, k.s0) * esize(d), d, m, x.rotate != 0, (float)c};
    encode_rows(level, in, k.rows, p.sS, x.out + o.offset(k.g, k.h, k.s0), o.sS, dvs[cs[i].t], sat[i]);
  });
  for (int64_t t = 0; t < n; ++t) saturated[t] = 0;
  for (size_t i = 0; i < cs.size(); ++i) saturated[cs[i].t] += sat[i];
  return 0;
}

// H x per row of 128 (``rows`` contiguous rows of x and of out), converted to out's dtype
// (finite values beyond a narrower dtype's range saturate).
int64_t qfa_rotate_rows(const void* x, int64_t dt, void* out, int64_t odt, int64_t rows, double c, int64_t threads,
                        int64_t isa) {
  int level = pick(isa);
  if (level < 0) return -1;
  const char* xb = static_cast<const char*>(x);
  char* ob = static_cast<char*>(out);
  int d = (int)dt, od = (int)odt;
  int64_t n = (rows + kChunkRows - 1) / kChunkRows;
  run_chunks(n, rows, threads, [&](int64_t i) {
    for (int64_t s = i * kChunkRows; s < std::min(rows, (i + 1) * kChunkRows); ++s)
      rotate_row(level, RowIn{xb + s * kD * esize(d), d, nullptr, true, (float)c}, ob + s * kD * esize(od), od);
  });
  return 0;
}

// ---- a step's token rows: its queries, and its keys and values into a paged cache -----------------

// Tokens per chunk of qfa_encode_tokens (times the heads: its rows).
constexpr int64_t kTokenChunk = 32;

// The first token whose slot is at or beyond `capacity`, or repeats an earlier token's slot
// (`repeated` says which), or -1 when every slot is in range and named once. Negative slots
// (vLLM's padding) are neither.
static int64_t bad_slot(const void* slots, bool i32, int64_t n, int64_t capacity, bool& repeated) {
  std::vector<std::pair<int64_t, int64_t>> named;
  named.reserve(n);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t s = i32 ? static_cast<const int32_t*>(slots)[t] : static_cast<const int64_t*>(slots)[t];
    if (s < 0) continue;
    if (s >= capacity) { repeated = false; return t; }
    named.push_back({s, t});
  }
  std::sort(named.begin(), named.end());
  int64_t first = -1;
  for (size_t i = 1; i < named.size(); ++i)
    if (named[i].first == named[i - 1].first && (first < 0 || named[i].second < first)) first = named[i].second;
  repeated = first >= 0;
  return first;
}

// One tensor of token rows for encode_tokens: x (tokens, heads, 128; element strides st, sh; last
// stride 1) in dtype dt, its mean mu (fp32 (heads, 128) or null), the divisor of its scale, and
// where its codes go (out; see qfa_encode_tokens).
struct TokenRows {
  const char* x;
  int64_t st, sh;
  const float* mu;
  Divisor dv;
  uint8_t* out;
};

// The tensors' codes, token by token in chunks, into out + b * s_block + h * s_head + o * s_slot
// (b, o: the token's slot's block and offset with slots, else 0 and t); slots checked already.
static void encode_token_tensors(const TokenRows* rows, int n_tensors, int dt, int64_t tokens, int64_t heads,
                                 bool rotate, float c, const void* slots, bool slots_i32, int64_t block_size,
                                 int64_t s_block, int64_t s_head, int64_t s_slot, int64_t threads, int level,
                                 int64_t* saturated) {
  const int64_t n = (tokens + kTokenChunk - 1) / kTokenChunk;
  std::vector<int64_t> sat(n, 0);
  run_chunks(n, tokens * heads * n_tensors, threads, [&](int64_t i) {
    for (int64_t t = i * kTokenChunk; t < std::min(tokens, (i + 1) * kTokenChunk); ++t) {
      int64_t b = 0, o = t;
      if (slots) {
        const int64_t s = slots_i32 ? static_cast<const int32_t*>(slots)[t] : static_cast<const int64_t*>(slots)[t];
        if (s < 0) continue;
        b = s / block_size;
        o = s % block_size;
      }
      for (int k = 0; k < n_tensors; ++k) {
        const TokenRows& r = rows[k];
        for (int64_t h = 0; h < heads; ++h) {
          RowIn in{r.x + (t * r.st + h * r.sh) * esize(dt), dt, r.mu ? r.mu + h * kD : nullptr, rotate, c};
          encode_rows(level, in, 1, 0, r.out + b * s_block + h * s_head + o * s_slot, 0, r.dv, sat[i]);
        }
      }
    }
  });
  *saturated = 0;
  for (int64_t i = 0; i < n; ++i) *saturated += sat[i];
}

// Checks the slots of a write (see qfa_encode_tokens): 0, or -2 / -3 with the token in *bad.
static int64_t check_slots(const void* slots, int64_t slots_i32, int64_t tokens, int64_t capacity, int64_t* bad) {
  bool repeated = false;
  const int64_t t = bad_slot(slots, slots_i32 != 0, tokens, capacity, repeated);
  if (t < 0) return 0;
  *bad = t;
  return repeated ? -3 : -2;
}

// The HiF8 codes of token rows x (tokens, heads, 128; element strides st, sh; last stride 1):
// per row the codes of H (x - mu) / scale (mu: fp32 (heads, 128) or null; rotated or not;
// saturating), the bits of qfa_prep_encode's. Row (t, h) goes to out + b * s_block + h * s_head
// + o * s_slot, where without slots b = 0 and o = t, and with them (int32 when slots_i32, else
// int64) b and o are slots[t]'s block and offset (block_size per block); a negative slot skips
// its token (vLLM's padding). Every slot is checked before a byte is written: one at or beyond
// blocks * block_size, or one an earlier token named, returns -2 with that token in *bad (and -3
// for a repeat), nothing written. -1: an ISA the CPU lacks. *saturated: how many finite
// prepared values reached the overflow threshold.
int64_t qfa_encode_tokens(const void* x, int64_t dt, int64_t tokens, int64_t heads, int64_t st, int64_t sh,
                          const float* mu, int64_t rotate, double c, double scale, uint8_t* out, const void* slots,
                          int64_t slots_i32, int64_t block_size, int64_t blocks, int64_t s_block, int64_t s_head,
                          int64_t s_slot, int64_t threads, int64_t isa, int64_t* saturated, int64_t* bad) {
  int level = pick(isa);
  if (level < 0) return -1;
  *saturated = 0;
  if (slots) {
    const int64_t refused = check_slots(slots, slots_i32, tokens, blocks * block_size, bad);
    if (refused) return refused;
  }
  const TokenRows rows{static_cast<const char*>(x), st, sh, mu, divisor_of((float)scale), out};
  encode_token_tensors(&rows, 1, (int)dt, tokens, heads, rotate != 0, (float)c, slots, slots_i32 != 0, block_size,
                       s_block, s_head, s_slot, threads, level, saturated);
  return 0;
}

// A step's keys k and values v (tokens, heads, 128, one dtype; strides k_st, k_sh and v_st, v_sh)
// written as qfa_encode_tokens writes each into slots, k with the means mu and k_scale into k_out,
// v with v_scale into v_out (two caches of one geometry: a paged cache's K and V halves), at the
// same slots (required: -4 without), checked once: all or nothing. *saturated counts both.
int64_t qfa_encode_kv_tokens(const void* k, const void* v, int64_t dt, int64_t tokens, int64_t heads, int64_t k_st,
                             int64_t k_sh, int64_t v_st, int64_t v_sh, const float* mu, int64_t rotate, double c,
                             double k_scale, double v_scale, uint8_t* k_out, uint8_t* v_out, const void* slots,
                             int64_t slots_i32, int64_t block_size, int64_t blocks, int64_t s_block, int64_t s_head,
                             int64_t s_slot, int64_t threads, int64_t isa, int64_t* saturated, int64_t* bad) {
  int level = pick(isa);
  if (level < 0) return -1;
  *saturated = 0;
  if (!slots) return -4;
  const int64_t refused = check_slots(slots, slots_i32, tokens, blocks * block_size, bad);
  if (refused) return refused;
  const TokenRows rows[2] = {{static_cast<const char*>(k), k_st, k_sh, mu, divisor_of((float)k_scale), k_out},
                             {static_cast<const char*>(v), v_st, v_sh, nullptr, divisor_of((float)v_scale), v_out}};
  encode_token_tensors(rows, 2, (int)dt, tokens, heads, rotate != 0, (float)c, slots, slots_i32 != 0, block_size,
                       s_block, s_head, s_slot, threads, level, saturated);
  return 0;
}

// Spans of the plain cast: one thread's share is at least this many elements (a few hundred
// microseconds of work), so small tensors never open a parallel region.
constexpr int64_t kGrain = 1 << 18;
// Outputs of at least this many codes are written with non-temporal stores (where aligned): they
// outgrow the caches with their inputs, and a normal store first reads each line it writes.
constexpr int64_t kStreamMin = 1 << 23;

// A large output is fresh memory: every 4 KiB page of it faults on its first write (1-2 us each
// in the VMs measured here, about as long as the encode itself at 64M codes). Huge pages (where
// the kernel honours madvise) take one fault per 2 MiB. Only the output this call allocated.
// The loader turns the hint off where huge pages cost more than they save: a guest whose balloon
// reports free memory hands every 2 MiB block idle for a few seconds back to its host, and a huge
// page fault on one then waits for the host to back it (80 ms for 64 MiB against 12-25 ms in 4 KiB
// pages, measured on such a guest); cpu_prepare.py decides, from the virtio devices.
static std::atomic<int> g_huge_pages{1};

void qfa_set_huge_pages(int64_t on) { g_huge_pages.store(on != 0, std::memory_order_relaxed); }
int64_t qfa_huge_pages() { return g_huge_pages.load(std::memory_order_relaxed); }

void prefer_huge_pages(uint8_t* out, int64_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (!g_huge_pages.load(std::memory_order_relaxed)) return;
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  uintptr_t lo = (reinterpret_cast<uintptr_t>(out) + kHuge - 1) & ~(kHuge - 1);
  uintptr_t hi = (reinterpret_cast<uintptr_t>(out) + (uintptr_t)n) & ~(kHuge - 1);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // a hint: failure changes nothing
#else
  (void)out;
  (void)n;
#endif
}

bool streams(const uint8_t* out, int64_t n, int isa) {
  return isa >= AVX512 && n >= kStreamMin && (reinterpret_cast<uintptr_t>(out) & 31) == 0;
}

// The HiF8 codes of n contiguous values (overflow "saturate" or, with inf_mode, "inf"), on up to
// ``threads`` OpenMP threads (libgomp: torch's own runtime).
int64_t qfa_encode_flat(const void* x, int64_t dt, uint8_t* out, int64_t n, int64_t inf_mode, int64_t threads, int64_t isa) {
  int level = pick(isa);
  if (level < 0) return -1;
  const char* xb = static_cast<const char*>(x);
  uint8_t* ob = out;
  int d = (int)dt;
  int64_t chunks = (n + kGrain - 1) / kGrain;
  bool stream = streams(ob, n, level);
  if (n >= kStreamMin) prefer_huge_pages(ob, n);
  int team = team_size(threads, chunks);
  if (team <= 1) { encode_span(level, xb, d, ob, n, inf_mode != 0, stream); return 0; }
#pragma omp parallel for num_threads(team) schedule(static)
  for (int64_t k = 0; k < chunks; ++k) {
    int64_t a = k * kGrain, b = std::min(n, a + kGrain);
    encode_span(level, xb + a * esize(d), d, ob + a, b - a, inf_mode != 0, stream);
  }
  return 0;
}

// The codes of x / scale (fp32 division, saturating) and the number of finite values that
// reached the overflow threshold.
int64_t qfa_quantize_flat(const void* x, int64_t dt, uint8_t* out, int64_t n, double scale, int64_t threads, int64_t isa) {
  int level = pick(isa);
  if (level < 0) return -1;
  const char* xb = static_cast<const char*>(x);
  uint8_t* ob = out;
  int d = (int)dt;
  float s = (float)scale;
  int64_t chunks = (n + kGrain - 1) / kGrain, total = 0;
  bool stream = streams(ob, n, level);
  if (n >= kStreamMin) prefer_huge_pages(ob, n);
  int team = team_size(threads, chunks);
  if (team <= 1) return quantize_span(level, xb, d, ob, n, s, stream);
#pragma omp parallel for num_threads(team) schedule(static) reduction(+ : total)
  for (int64_t k = 0; k < chunks; ++k) {
    int64_t a = k * kGrain, b = std::min(n, a + kGrain);
    total += quantize_span(level, xb + a * esize(d), d, ob + a, b - a, s, stream);
  }
  return total;
}

}  // extern "C"
