// quant_flash_attn's torch backend on CPU in one parallel region: see qfa/attention/cpu_kernel.py
// for the numerics and the contract. Built per CPU capability (the flags come from Python).
//
// Work items are (batch, kv head, query tile[, key chunk]). A worker runs its item alone: its
// GEMMs single-threaded (at::mm_out inside the parallel region), and one fused pass per
// 256-key block for max, exp, row sum, HiF8 rounding and alpha. Items are handed out by an
// atomic counter, costliest first, so a thread slowed by another process simply takes fewer
// items (on the own pool; on the OpenMP team the closing barrier still waits for it: see
// run_items). Nothing a thread computes depends on which thread runs it or how many there are.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

// The AVX512_BF16 build (-mavx512bf16, chosen by qfa/attention/cpu_kernel.py from the CPU's
// flags): the many-row blocks' two GEMMs run as bf16 dot products (see "bf16 dot products").
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define QFA_BF16_DOT 1
#endif

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- HiF8 rounding of P (the bit rule of qfa/cast/rounding.py; constants passed in) ----------

struct RoundConsts {
  int32_t band[3];        // |e| limits for 1, 2, 3 kept mantissa bits
  int32_t min_denormal;   // bit patterns
  int32_t underflow;
  int32_t max_bits;
  int32_t nan_bits;
};

RoundConsts round_consts_of(const std::vector<int64_t>& v) {
  TORCH_CHECK(v.size() == 7, "round_consts: 7 values");
  return RoundConsts{{int32_t(v[0]), int32_t(v[1]), int32_t(v[2])}, int32_t(v[3]), int32_t(v[4]), int32_t(v[5]),
                     int32_t(v[6])};
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

// HiF8 rounding of a row of P in place: 16 lanes at a time where the build has AVX-512, 8 where
// it has AVX2, the same bit rule in scalar code for the tail (and everywhere else).
inline void round_row(float* p, int64_t n, const RoundConsts& c, bool simd = true) {
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#if defined(CPU_CAPABILITY_AVX512)
  if (simd && n >= 16) {
    const RoundVec16 rv(c);
    int32_t* b = reinterpret_cast<int32_t*>(p);
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
    for (; j + Vec::size() <= n; j += Vec::size()) acc = at::vec::maximum(acc, Vec::loadu(s + j));
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

// ---- aligned scratch --------------------------------------------------------------------------

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float, FreeDeleter>;

Buffer alloc(int64_t n) {
  const size_t bytes = ((static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float) + 63) / 64) * 64;
  float* p = static_cast<float*>(std::aligned_alloc(64, bytes));
  TORCH_CHECK(p != nullptr, "qfa native attention: out of memory allocating ", bytes, " bytes of scratch");
  return Buffer(p);
}

// ---- HiF8 decode ------------------------------------------------------------------------------
// The fp32 value of a code is a bf16 pattern (low 16 bits zero) whose sign is the code's bit 7.
// Its 15 magnitude bits are an affine function of the code's low 3 bits within each group of 8
// magnitudes (H = magnitude >> 3: the dot field and the exponent's leading bits): for a positive
// exponent the low bits are the exponent's tail then the mantissa, both in place; for a
// negative one the tail counts down, which an xor of the tail bits turns into counting up. So
//   bf16 magnitude = 2 * (M[H] * ((m & 7) ^ X[H]) + 64 * B[H])
// with 16-entry byte tables (vpshufb lookups by H) and one vpmaddubsw for both products. The
// tables are fitted to the 256-entry decode table at init, and the fit is checked on every
// magnitude but two, so the rule is the table's, not a second statement of the format. Those two
// are zero (B cleared; its group must not xor) and 0x6F: the codes 0x80 (NaN) and +-0x6F (Inf)
// are flagged from the codes, and a range holding one is decoded again by table lookups. A
// table without that structure (none today) falls back to scalar lookups. Measured on the AVX2
// EPYC: 0.13 ns a code in L1, against 0.25 for the previous vpshufb chain over 8 segments.

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define QFA_SIMD 1
#endif

struct Decoder {
  float table[256];
  bool simd = false;
#ifdef QFA_SIMD
  __m256i xor_t, mul_t, base_t;  // X, M and B by H, repeated in both 128-bit lanes
#endif

  // Codes the affine rule leaves to the table.
  static bool special(int m) { return m == 0 || m == 0x6F; }
  static bool nonfinite(int code) { return code == 0x80 || (code & 0x7F) == 0x6F; }

  void init(const float* t) {
    std::memcpy(table, t, sizeof(table));
    uint32_t bits[256];
    std::memcpy(bits, t, sizeof(bits));
    bool ok = bits[0] == 0;
    for (int x = 0; x < 256; ++x) {
      ok = ok && (bits[x] & 0xFFFFu) == 0;
      ok = ok && std::isfinite(t[x]) == !nonfinite(x);
    }
    for (int x = 1; x < 128; ++x) ok = ok && bits[x | 0x80] == (bits[x] | 0x80000000u);
#ifdef QFA_SIMD
    alignas(32) uint8_t xs[32], ms[32], bs[32];
    for (int h = 0; h < 16 && ok; ++h) {
      bool found = false;
      // Code 0 is left out of the fit and decodes as 2 * M * (0 ^ X) once B is cleared: its group
      // must not xor.
      for (int x = 0; x < (h == 0 ? 1 : 8) && !found; ++x) {
        for (int k = 1; k < 8 && !found; ++k) {  // M = 2^(k-1): a power of two below 128
          int64_t base = -1;
          bool fits = true;
          for (int lo = 0; lo < 8 && fits; ++lo) {
            const int m = 8 * h + lo;
            if (special(m)) continue;
            const int64_t b = int64_t(bits[m] >> 16) - (int64_t(lo ^ x) << k);
            if (base < 0) base = b;
            fits = b == base;
          }
          if (!fits || base < 0 || base % 128 != 0 || base / 128 > 255) continue;
          xs[h] = xs[h + 16] = static_cast<uint8_t>(x);
          ms[h] = ms[h + 16] = static_cast<uint8_t>(1 << (k - 1));
          bs[h] = bs[h + 16] = static_cast<uint8_t>(base / 128);
          found = true;
        }
      }
      ok = found;
    }
    simd = ok;
    if (!simd) return;
    xor_t = _mm256_load_si256(reinterpret_cast<const __m256i*>(xs));
    mul_t = _mm256_load_si256(reinterpret_cast<const __m256i*>(ms));
    base_t = _mm256_load_si256(reinterpret_cast<const __m256i*>(bs));
#else
    (void)ok;
#endif
  }

#ifdef QFA_SIMD
  // 32 contiguous codes to their bf16 patterns: w0 holds codes 0-7 (low lane) and 16-23 (high
  // lane), w1 codes 8-15 and 24-31. Returns a mask, nonzero where a code is not finite (whose
  // value here is wrong: the caller decodes such a range again with the table).
  inline __m256i words32(const uint8_t* p, __m256i& w0, __m256i& w1) const {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i z = _mm256_setzero_si256();
    const __m256i m = _mm256_and_si256(c, _mm256_set1_epi8(0x7F));
    const __m256i h = _mm256_and_si256(_mm256_srli_epi16(m, 3), _mm256_set1_epi8(0x0F));
    const __m256i lx = _mm256_xor_si256(_mm256_and_si256(m, _mm256_set1_epi8(7)), _mm256_shuffle_epi8(xor_t, h));
    const __m256i mul = _mm256_shuffle_epi8(mul_t, h);
    const __m256i base = _mm256_andnot_si256(_mm256_cmpeq_epi8(m, z), _mm256_shuffle_epi8(base_t, h));
    // vpmaddubsw: (M, B) unsigned times (lx, 64) signed, pairwise: M * lx + 64 * B per 16-bit lane.
    const __m256i s64 = _mm256_set1_epi8(64);
    const __m256i sign = _mm256_and_si256(c, _mm256_set1_epi8(static_cast<char>(0x80)));
    w0 = _mm256_or_si256(
        _mm256_slli_epi16(_mm256_maddubs_epi16(_mm256_unpacklo_epi8(mul, base), _mm256_unpacklo_epi8(lx, s64)), 1),
        _mm256_unpacklo_epi8(z, sign));
    w1 = _mm256_or_si256(
        _mm256_slli_epi16(_mm256_maddubs_epi16(_mm256_unpackhi_epi8(mul, base), _mm256_unpackhi_epi8(lx, s64)), 1),
        _mm256_unpackhi_epi8(z, sign));
    return _mm256_or_si256(_mm256_cmpeq_epi8(c, _mm256_set1_epi8(static_cast<char>(0x80))),
                           _mm256_cmpeq_epi8(m, _mm256_set1_epi8(0x6F)));
  }

  // 32 contiguous codes to fp32 (the bf16 patterns widened); the mask as words32's.
  inline __m256i decode32(const uint8_t* p, float* d) const {
    __m256i w0, w1;
    const __m256i bad = words32(p, w0, w1);
    const __m256i z = _mm256_setzero_si256();
    const __m256i f0 = _mm256_unpacklo_epi16(z, w0), f1 = _mm256_unpackhi_epi16(z, w0);
    const __m256i f2 = _mm256_unpacklo_epi16(z, w1), f3 = _mm256_unpackhi_epi16(z, w1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), _mm256_permute2x128_si256(f0, f1, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 8), _mm256_permute2x128_si256(f2, f3, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 16), _mm256_permute2x128_si256(f0, f1, 0x31));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 24), _mm256_permute2x128_si256(f2, f3, 0x31));
    return bad;
  }

  // 32 contiguous codes to bf16; the mask as words32's.
  inline __m256i decode32_bf16(const uint8_t* p, uint16_t* d) const {
    __m256i w0, w1;
    const __m256i bad = words32(p, w0, w1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), _mm256_permute2x128_si256(w0, w1, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 16), _mm256_permute2x128_si256(w0, w1, 0x31));
    return bad;
  }
#endif

  // The bf16 pattern of a code: its fp32 value's high half (init checked the low half is zero).
  inline uint16_t bf16_of(uint8_t code) const {
    uint32_t bits;
    std::memcpy(&bits, &table[code], 4);
    return static_cast<uint16_t>(bits >> 16);
  }

  // n codes at stride st to bf16; returns whether every value is finite. Only for tables whose
  // values are all bf16 patterns (init's check; simd is false otherwise, and callers need simd).
  inline bool decode_bf16(const uint8_t* p, int64_t st, uint16_t* d, int64_t n) const {
    int64_t x = 0;
    bool finite = true;
#ifdef QFA_SIMD
    if (st == 1 && simd) {
      __m256i bad = _mm256_setzero_si256();
      for (; x + 32 <= n; x += 32) bad = _mm256_or_si256(bad, decode32_bf16(p + x, d + x));
      if (!_mm256_testz_si256(bad, bad)) {
        for (int64_t i = 0; i < x; ++i) d[i] = bf16_of(p[i]);
        finite = false;
      }
    }
#endif
    for (; x < n; ++x) { d[x] = bf16_of(p[x * st]); finite = finite && std::isfinite(table[p[x * st]]); }
    return finite;
  }

  // n codes at stride st to fp32; returns whether every value is finite.
  inline bool decode(const uint8_t* p, int64_t st, float* d, int64_t n) const {
    int64_t x = 0;
    bool finite = true;
    if (st == 1) {
#ifdef QFA_SIMD
      if (simd) {
        __m256i bad = _mm256_setzero_si256();
        for (; x + 32 <= n; x += 32) bad = _mm256_or_si256(bad, decode32(p + x, d + x));
        if (!_mm256_testz_si256(bad, bad)) {  // NaN or Inf (rare): the table's values
          for (int64_t i = 0; i < x; ++i) d[i] = table[p[i]];
          finite = false;
        }
      }
#endif
      for (; x < n; ++x) { d[x] = table[p[x]]; finite = finite && std::isfinite(d[x]); }
      return finite;
    }
    for (; x < n; ++x) { d[x] = table[p[x * st]]; finite = finite && std::isfinite(d[x]); }
    return finite;
  }
};

// ---- the call -------------------------------------------------------------------------------

// Where K or V codes lie: (batch, head, position, dim) strides, or paged (block_table given):
// key j of batch b at block table[b][j / block_size], position j % block_size, with the strides
// (block, head, position in block, dim). Read in place either way.
struct KvSrc {
  const uint8_t* base = nullptr;
  int64_t st[4] = {0, 0, 0, 0};
  const int32_t* table = nullptr;  // nullptr: contiguous
  int64_t table_stride = 0, block_size = 0;

  // Codes of key j (the sequence's own index; start: its first position in the tensor).
  inline const uint8_t* row(int64_t b, int64_t h, int64_t start, int64_t j) const {
    if (!table) return base + b * st[0] + h * st[1] + (start + j) * st[2];
    const int64_t blk = table[b * table_stride + j / block_size];
    return base + blk * st[0] + h * st[1] + (j % block_size) * st[2];
  }
  // Keys after j that lie at a constant stride from it (the rest of its block, if paged).
  inline int64_t run_after(int64_t j) const { return table ? block_size - 1 - j % block_size : INT64_MAX; }
};

struct Call {
  const uint8_t* q;
  KvSrc k, v;
  int64_t sq[4];  // element strides (batch, head, position, dim)
  int16_t* out;    // bf16 bits, or
  float* out_f32;  // O / l unrounded (the tests' view of the fp32 result), when out is fp32
  int64_t so[4];
  float* lse;  // nullptr when not returned
  int64_t sl[3];  // (batch, head, position) strides of lse
  int64_t heads_kv, group, dim, block_n;
  std::vector<int64_t> q_starts, kv_starts, q_lens, kv_lens;
  bool causal;
  float dscale, ln_p, v_descale;
  Decoder dec;
  // Per batch, per (kv head, block): whether the pre-decoded V block is finite.
  std::vector<std::vector<uint8_t>> v_finite;
  RoundConsts rc;
  // Pre-decoded fp32 K and V, per batch, or empty (decode on the fly): V (heads_kv, kv_len, dim);
  // K the same, or with panel GEMMs as (heads_kv, blocks) of block_n x dim panels (see to_panels).
  std::vector<float*> k_dec, v_dec;
  // The same in bf16 (bf16 mode): K as (heads_kv, blocks) of bf16 panels, V as slices (see to_bpanels).
  std::vector<uint16_t*> kb_dec, vb_dec;
  bool panel_gemm = false;  // many-row blocks run the register-tiled GEMMs (AVX2 builds, D = 128)
  bool bf16 = false;        // ... as bf16 dot products (AVX512_BF16 builds, when asked)
};

struct Item {
  int64_t b, h, t0, t1;  // query positions [t0, t1) of batch b, kv head h
  int64_t c0, c1;        // key blocks [c0, c1)
  int64_t slot;          // partial-state slot of a split item, -1 if not split
  int64_t first;         // index of its item's first chunk in the split list (split items)
  double cost;
};

// A thread's scratch, kept for the thread's life and grown on demand: allocated afresh for each
// region, its megabyte of buffers was mapped and page-faulted in on every call (with the heap
// trimmed between calls, ~600 faults and a fifth more CPU time per decode call at B = 8).
struct Scratch {
  int64_t rows = 0, dim = 0, bn = 0;  // capacity
  Buffer q, k, kp, v, vs, s, pv, o, m, l, alpha, prod, rsum;
  Buffer qb, kb, vb, pb;  // bf16 (2 per float): Q, a block's K (rows, then panels in kp), V, P
  void ensure(int64_t r, int64_t d, int64_t b) {
    if (r <= rows && d <= dim && b <= bn) return;
    const int64_t R = std::max(r, rows), D = std::max(d, dim), N = std::max(b, bn);
    rows = dim = bn = 0;  // claimed once every buffer is there: alloc throws when one fails
    q = alloc(R * D); s = alloc(R * N); pv = alloc(R * D); o = alloc(R * D);
    m = alloc(R); l = alloc(R); alpha = alloc(R); prod = alloc(R); rsum = alloc(R);
    k = alloc(N * D); kp = alloc(N * D); v = alloc(N * D); vs = alloc(N * D);
    qb = alloc(R * D / 2 + 16); kb = alloc(N * D / 2 + 16); vb = alloc(N * D / 2 + 16); pb = alloc(R * N / 2 + 16);
    rows = R; dim = D; bn = N;
  }
  uint16_t* half(const Buffer& x) { return reinterpret_cast<uint16_t*>(x.get()); }
};

inline Scratch& thread_scratch() {
  thread_local Scratch sc;
  return sc;
}

inline at::Tensor wrap(float* p, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(p, {rows, cols}, {ld, 1}, at::TensorOptions().dtype(at::kFloat));
}

constexpr int64_t kAhead = 8;  // keys decode_rows prefetches ahead

// Decode keys [j0, j1) of kv head h of batch b into dst (rows x dim), fp32 or bf16 (T);
// returns whether every value is finite.
template <typename T>
inline bool decode_rows(const Decoder& dc, int64_t dim, const KvSrc& src, int64_t b, int64_t h, int64_t start,
                        int64_t j0, int64_t j1, T* dst) {
  bool finite = true;
  for (int64_t j = j0; j < j1;) {
    const uint8_t* p = src.row(b, h, start, j);
    // Keys [j, run_end) lie at a constant stride (the rest of a page, if paged), up to kAhead past j1.
    const int64_t run_end = j + 1 + std::min<int64_t>(src.run_after(j), j1 + kAhead - j - 1);
    const int64_t end = std::min(j1, run_end);
    for (; j < end; ++j, p += src.st[2]) {
#ifdef QFA_SIMD
      // The codes kAhead keys on, in this run of keys (past j1 too: the caller's next group;
      // a prefetch never faults): decode streams them from memory, a key's codes are one or two
      // cache lines and the work per key is short.
      if (j + kAhead < run_end && src.st[3] == 1) {
        const char* ahead = reinterpret_cast<const char*>(p + kAhead * src.st[2]);
        for (int64_t x = 0; x < dim; x += 64) _mm_prefetch(ahead + x, _MM_HINT_T0);
      }
#endif
      if constexpr (std::is_same<T, float>::value) {
        finite = dc.decode(p, src.st[3], dst + (j - j0) * dim, dim) && finite;
      } else {
        finite = dc.decode_bf16(p, src.st[3], dst + (j - j0) * dim, dim) && finite;
      }
    }
  }
  return finite;
}

// Q tile rows in (position, group) order: row (i - t0) * G + g holds q head h * G + g.
void load_q_rows(const Call& c, const Item& it, float* dst) {
  const int64_t G = c.group;
  for (int64_t i = it.t0; i < it.t1; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* p = c.q + it.b * c.sq[0] + (it.h * G + g) * c.sq[1] + (c.q_starts[it.b] + i) * c.sq[2];
      float* d = dst + ((i - it.t0) * G + g) * c.dim;
      c.dec.decode(p, c.sq[3], d, c.dim);
    }
  }
}

inline int64_t offset_of(const Call& c, int64_t b) { return c.kv_lens[b] - c.q_lens[b]; }

// Keys the tile's last row sees (causal), or all of them.
inline int64_t key_end(const Call& c, int64_t b, int64_t t1) {
  return c.causal ? std::min(c.kv_lens[b], t1 + offset_of(c, b)) : c.kv_lens[b];
}


// Columns of a block of nk keys at j0 that any row of the item sees: the tile's last row sees
// up to key t1 - 1 + offset; scores past that are never computed (their P is 0 either way).
inline int64_t columns(const Call& c, const Item& it, int64_t j0, int64_t nk) {
  if (!c.causal) return nk;
  return std::max<int64_t>(0, std::min(nk, it.t1 + offset_of(c, it.b) - j0));
}

// ---- few-row blocks (decode): fused decode + dot products ----------------------------------------
// With a handful of rows (new tokens x the GQA group), a GEMM call per block is mostly overhead
// and the decode of K and V dominates. These kernels decode 8 keys at a time into an L1 buffer
// and run the dot products from there, in a fixed order (lanes of 8 dims, then a fixed add
// tree; keys in ascending order for P @ V). Whether a block takes this path depends only on
// the item's shape, so the bits never depend on the thread count.
constexpr int64_t kFusedRows = 16;
constexpr int64_t kGroup = 8;  // keys per decoded group
constexpr int64_t kFusedDim = 128;  // HEAD_DIM: constant offsets keep the row pointers in registers

inline bool fused(const Call& c, int64_t rows) {
#ifdef QFA_SIMD
  return rows <= kFusedRows && c.dim == kFusedDim;
#else
  (void)c; (void)rows;
  return false;
#endif
}

// Rows of keys [g0, g0 + n) of the item's block at j0: pre-decoded (pre), or decoded into buf.
inline const float* key_rows(const Call& c, const Item& it, const KvSrc& src, const float* pre, int64_t j0,
                             int64_t g0, int64_t n, float* buf) {
  if (pre) return pre + g0 * c.dim;
  decode_rows(c.dec, c.dim, src, it.b, it.h, c.kv_starts[it.b], j0 + g0, j0 + g0 + n, buf);
  return buf;
}

#ifdef QFA_SIMD
// A load the compiler keeps in a register: where one value feeds two FMAs, GCC otherwise folds
// the load into both (two loads per value), and the few-row loops become load-bound.
inline __m256 load_once(const float* p) {
  __m256 v = _mm256_loadu_ps(p);
  asm("" : "+x"(v));
  return v;
}

// [sum(a0), ..., sum(a7)]
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// S = Q K^T for rows [lo, R) and columns [0, nc) of the block at j0 (K pre-decoded or codes).
void qk_fused(const Call& c, const Item& it, const float* kpre, int64_t j0, int64_t lo, int64_t R, int64_t nc,
              Scratch& sc, float* dst) {
  constexpr int64_t D = kFusedDim;
  const int64_t BN = c.block_n;
  float* buf = sc.k.get();
  for (int64_t g0 = 0; g0 < nc; g0 += kGroup) {
    const int64_t n = std::min(kGroup, nc - g0);
    const float* kr = key_rows(c, it, c.k, kpre, j0, g0, n, buf);
    if (n < kGroup) {  // a short last group: pad with zero keys (their scores are not stored)
      if (kr != buf) { std::memcpy(buf, kr, sizeof(float) * n * D); kr = buf; }
      std::memset(buf + n * D, 0, sizeof(float) * (kGroup - n) * D);
    }
    // Two rows x four keys per pass (6 loads per 8 FMAs). Each dot product is its own lane-wise
    // chain over the dims and the same add tree, whichever pass computes it.
    int64_t r = lo;
    for (; r + 2 <= R; r += 2) {
      const float* q0 = sc.q.get() + r * D;
      const float* q1 = q0 + D;
      for (int64_t h = 0; h < kGroup; h += 4) {
        const float* k = kr + h * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t x = 0; x < D; x += 8) {
          const __m256 u = _mm256_loadu_ps(q0 + x), w = _mm256_loadu_ps(q1 + x);
          __m256 kv = load_once(k + x);
          a0 = _mm256_fmadd_ps(u, kv, a0); b0 = _mm256_fmadd_ps(w, kv, b0);
          kv = load_once(k + D + x);
          a1 = _mm256_fmadd_ps(u, kv, a1); b1 = _mm256_fmadd_ps(w, kv, b1);
          kv = load_once(k + 2 * D + x);
          a2 = _mm256_fmadd_ps(u, kv, a2); b2 = _mm256_fmadd_ps(w, kv, b2);
          kv = load_once(k + 3 * D + x);
          a3 = _mm256_fmadd_ps(u, kv, a3); b3 = _mm256_fmadd_ps(w, kv, b3);
        }
        alignas(32) float s[8];
        _mm256_store_ps(s, hsum8(a0, a1, a2, a3, b0, b1, b2, b3));
        const int64_t m = std::min<int64_t>(4, n - h);
        for (int64_t j = 0; j < m; ++j) {
          dst[(r - lo) * BN + g0 + h + j] = s[j];
          dst[(r + 1 - lo) * BN + g0 + h + j] = s[4 + j];
        }
      }
    }
    for (; r < R; ++r) {
      const float* q = sc.q.get() + r * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int64_t x = 0; x < D; x += 8) {
        const __m256 qv = _mm256_loadu_ps(q + x);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + x), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + D + x), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 2 * D + x), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 3 * D + x), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 4 * D + x), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 5 * D + x), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 6 * D + x), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + 7 * D + x), a7);
      }
      alignas(32) float s[8];
      _mm256_store_ps(s, hsum8(a0, a1, a2, a3, a4, a5, a6, a7));
      std::memcpy(dst + (r - lo) * BN + g0, s, sizeof(float) * n);
    }
  }
}
#endif

#ifdef QFA_SIMD
// ---- many-row blocks (prefill): register-tiled GEMMs --------------------------------------------
// Tiles of 6 rows x 16 columns (12 accumulator registers, 2 loads and 6 broadcasts per 12 FMAs);
// every output element is one FMA chain over the summed index in ascending order. For P @ V that
// is exactly the few-row kernel's order (pv_fused: a zero P adds nothing to a finite value), so
// a block's bits do not depend on which of the two ran it. MKL's sgemm, called per block, spent a
// tenth of the time packing its operands and scaling C; these read K in the panel layout it is
// decoded into, and Q, P and V as they lie.
constexpr int64_t kPanel = 16;     // keys per K panel, dims per P @ V slice
constexpr int64_t kTileRows = 6;
constexpr int64_t kPanelFloats = kPanel * kFusedDim;

inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// nk decoded keys (rows of 128 floats) into panels of 16 keys, dims major: key 16 p + j, dim d at
// panels[p * 2048 + d * 16 + j]; the last panel's missing keys are zero.
void to_panels(const float* rows, int64_t nk, float* panels) {
  constexpr int64_t D = kFusedDim;
  for (int64_t p = 0; p * kPanel < nk; ++p) {
    float* dst = panels + p * kPanelFloats;
    for (int64_t j0 = 0; j0 < kPanel; j0 += 8) {
      for (int64_t d0 = 0; d0 < D; d0 += 8) {
        __m256 r[8];
        for (int64_t i = 0; i < 8; ++i) {
          const int64_t key = p * kPanel + j0 + i;
          r[i] = key < nk ? _mm256_loadu_ps(rows + key * D + d0) : _mm256_setzero_ps();
        }
        transpose8(r);
        for (int64_t i = 0; i < 8; ++i) _mm256_store_ps(dst + (d0 + i) * kPanel + j0, r[i]);
      }
    }
  }
}

// dst[r][0:16] = q_r . keys of one panel, rows r < ROWS (q ld 128, dst ld ld).
template <int ROWS>
inline void qk_tile(const float* q, const float* panel, float* dst, int64_t ld) {
  __m256 c0[ROWS], c1[ROWS];
  for (int r = 0; r < ROWS; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < kFusedDim; ++d) {
    const __m256 b0 = _mm256_load_ps(panel + d * kPanel), b1 = _mm256_load_ps(panel + d * kPanel + 8);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 a = _mm256_broadcast_ss(q + r * kFusedDim + d);
      c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) { _mm256_storeu_ps(dst + r * ld, c0[r]); _mm256_storeu_ps(dst + r * ld + 8, c1[r]); }
}

// V of a block as 8 slices of 16 dims, keys major: key j, dim 16 s + x at slices[s * stride + j * 16 + x]
// (a slice's keys are contiguous: read by every row tile, it stays in L1, where rows of 512 bytes
// would fall into 8 of L1's 64 sets).
void to_slices(const float* rows, int64_t nk, float* slices, int64_t stride) {
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t s = 0; s < kFusedDim / kPanel; ++s)
      std::memcpy(slices + s * stride + j * kPanel, rows + j * kFusedDim + s * kPanel, sizeof(float) * kPanel);
}

// dst[r][0:16] = sum over keys j < nk of p[r][j] v[j][0:16] (one slice), rows r < ROWS.
template <int ROWS>
inline void pv_tile(const float* p, int64_t ldp, const float* v, int64_t nk, float* dst) {
  __m256 c0[ROWS], c1[ROWS];
  for (int r = 0; r < ROWS; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < nk; ++j) {
    const __m256 b0 = _mm256_load_ps(v + j * kPanel), b1 = _mm256_load_ps(v + j * kPanel + 8);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 a = _mm256_broadcast_ss(p + r * ldp + j);
      c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm256_storeu_ps(dst + r * kFusedDim, c0[r]);
    _mm256_storeu_ps(dst + r * kFusedDim + 8, c1[r]);
  }
}

// Runs tile<ROWS> over rows [0, R) in tiles of 6 and a tail.
template <template <int> class Tile, typename... Args>
inline void over_rows(int64_t R, int64_t step_in, int64_t step_out, const float* in, float* out, Args... args) {
  int64_t r = 0;
  for (; r + kTileRows <= R; r += kTileRows) Tile<6>::run(in + r * step_in, out + r * step_out, args...);
  switch (R - r) {
    case 5: Tile<5>::run(in + r * step_in, out + r * step_out, args...); break;
    case 4: Tile<4>::run(in + r * step_in, out + r * step_out, args...); break;
    case 3: Tile<3>::run(in + r * step_in, out + r * step_out, args...); break;
    case 2: Tile<2>::run(in + r * step_in, out + r * step_out, args...); break;
    case 1: Tile<1>::run(in + r * step_in, out + r * step_out, args...); break;
    default: break;
  }
}

template <int ROWS>
struct QkTile {
  static void run(const float* q, float* dst, const float* panel, int64_t ld) { qk_tile<ROWS>(q, panel, dst, ld); }
};
template <int ROWS>
struct PvTile {
  static void run(const float* p, float* dst, int64_t ldp, const float* v, int64_t nk) {
    pv_tile<ROWS>(p, ldp, v, nk, dst);
  }
};

// S = Q K^T for R rows and the first nc keys of a block in panels (dst ld ld; columns up to the
// next multiple of 16 are written, with scores of the panel's other keys).
void qk_panels(const float* q, int64_t R, const float* panels, int64_t nc, float* dst, int64_t ld) {
  for (int64_t p = 0; p * kPanel < nc; ++p)
    over_rows<QkTile>(R, kFusedDim, ld, q, dst + p * kPanel, panels + p * kPanelFloats, ld);
}

// pv = P V for R rows (P ld ldp) over the block's first nk keys (V in slices of the given stride).
void pv_panels(const float* p, int64_t R, int64_t ldp, const float* slices, int64_t stride, int64_t nk, float* pv) {
  for (int64_t s = 0; s < kFusedDim / kPanel; ++s)
    over_rows<PvTile>(R, ldp, kFusedDim, p, pv + s * kPanel, ldp, slices + s * stride, nk);
}
#endif

#ifdef QFA_BF16_DOT
// ---- many-row blocks as bf16 dot products (AVX512_BF16) ------------------------------------------
// vdpbf16ps adds, per fp32 lane, the products of one pair of bf16 values to the accumulator:
// acc + a[2i] b[2i] + a[2i+1] b[2i+1]. Why it computes the fp32 kernels' numbers up to fp32
// summation order: HiF8 values and HiF8-rounded P have at most 4 significant bits and exponents
// inside bf16's normal range, so they are bf16 exactly (the decoder builds bf16 patterns anyway,
// and P's fp32 bits have a zero low half); the product of two has at most 16 significant bits,
// so it is exact in fp32. HiF8 values are multiples of 2^-22, so every product and every
// accumulator value (a sum of products, rounded to a power-of-two step) is a multiple of 2^-44:
// none is denormal, and the instruction's flushing of denormals (DAZ / FTZ) changes nothing.
//
// Summation order: each output element is one chain over pairs of the summed index in
// ascending order (dims 2d, 2d + 1 of Q K^T; keys 2j, 2j + 1 of P V), each step adding the pair's
// two exact products to the accumulator. The SDM states it as two adds in turn (the odd index's
// product first), each rounded; the tests' bound allows two roundings per step in any order, so
// it holds for an implementation that sums the pair first. n summed terms: n roundings at most,
// as in the fp32 kernels' FMA chains. With the dot order fixed per block shape, the bits do not
// depend on the thread count; they differ from the fp32 kernels' by summation order only.
//
// Layouts: K in panels of 32 keys, one register pair per dim pair (the 32 keys' (2d, 2d + 1));
// V in 4 slices of 32 dims, one register pair per key pair; Q and P as bf16 rows, whose dword
// of a pair is broadcast. Tiles of 12 rows x 32 columns: 24 accumulators, 2 loads and 12
// broadcasts per 24 dot products.
constexpr int64_t kBPanel = 32;                       // keys per K panel, dims per V slice
constexpr int64_t kBPanelHalves = kBPanel * kFusedDim;  // bf16 values in one panel
constexpr int kBTileRows = 12;

inline void transpose16(__m512i* r) {  // 16 x 16 dwords: row i becomes column i
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]); r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]); r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// nk bf16 rows of 128 (keys) into panels of 32 keys: key 32 p + j, dims 2 d + {0, 1} at
// panels[p * 4096 + d * 64 + 2 j + {0, 1}]; the last panel's missing keys are zero.
void to_bpanels(const uint16_t* rows, int64_t nk, uint16_t* panels) {
  constexpr int64_t D = kFusedDim;
  for (int64_t p = 0; p * kBPanel < nk; ++p) {
    uint16_t* dst = panels + p * kBPanelHalves;
    for (int64_t j0 = 0; j0 < kBPanel; j0 += 16) {
      for (int64_t d0 = 0; d0 < D / 2; d0 += 16) {  // dim pairs
        __m512i r[16];
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t key = p * kBPanel + j0 + i;
          r[i] = key < nk ? _mm512_loadu_si512(rows + key * D + 2 * d0) : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (d0 + i) * 2 * kBPanel + 2 * j0, r[i]);
      }
    }
  }
}

// V of a block (nk bf16 rows of 128) as 4 slices of 32 dims in key pairs: keys 2 j + {0, 1},
// dim 32 s + x at slices[s * stride + j * 64 + 2 x + {0, 1}]; the last pair's missing key is zero.
void to_bslices(const uint16_t* rows, int64_t nk, uint16_t* slices, int64_t stride) {
  constexpr int64_t D = kFusedDim;
  alignas(64) uint16_t lo[32], hi[32];
  for (int x = 0; x < 16; ++x) {
    lo[2 * x] = static_cast<uint16_t>(x); lo[2 * x + 1] = static_cast<uint16_t>(32 + x);
    hi[2 * x] = static_cast<uint16_t>(16 + x); hi[2 * x + 1] = static_cast<uint16_t>(48 + x);
  }
  const __m512i lo_idx = _mm512_load_si512(lo), hi_idx = _mm512_load_si512(hi);
  for (int64_t j = 0; 2 * j < nk; ++j) {
    const uint16_t* a = rows + 2 * j * D;
    const bool two = 2 * j + 1 < nk;
    for (int64_t sl = 0; sl < D / kBPanel; ++sl) {
      const __m512i x = _mm512_loadu_si512(a + sl * kBPanel);
      const __m512i y = two ? _mm512_loadu_si512(a + D + sl * kBPanel) : _mm512_setzero_si512();
      uint16_t* dst = slices + sl * stride + j * 2 * kBPanel;
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(x, lo_idx, y));
      _mm512_storeu_si512(dst + kBPanel, _mm512_permutex2var_epi16(x, hi_idx, y));
    }
  }
}

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

// P's HiF8 rounding of n values in place, zeros from n to n_pad (a multiple of 2), and the
// rounded row as bf16 into dst: one pass for round_row, the zero fill and to_bf16.
inline void round_to_bf16(float* p, int64_t n, int64_t n_pad, const RoundConsts& c, uint16_t* dst) {
  const RoundVec16 rv(c);
  int32_t* b = reinterpret_cast<int32_t*>(p);
  for (int64_t j = 0; j < n_pad; j += 16) {
    const int64_t left = std::min<int64_t>(16, n - j);
    const __mmask16 live = left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
    const __mmask16 out = static_cast<__mmask16>((1u << std::min<int64_t>(16, n_pad - j)) - 1);
    const __m512i r = _mm512_maskz_mov_epi32(live, rv(_mm512_maskz_loadu_epi32(live, b + j)));
    _mm512_mask_storeu_epi32(b + j, out, r);
    _mm512_mask_cvtepi32_storeu_epi16(dst + j, out, _mm512_srli_epi32(r, 16));
  }
}

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

inline __m512bh pair_of(const uint16_t* p) {  // the bf16 pair at p, in every lane
  int32_t w;
  std::memcpy(&w, p, 4);
  return as_bh(_mm512_set1_epi32(w));
}

// dst[r][0:32] = q_r . keys of one panel, rows r < ROWS (q bf16 ld 128, dst ld ld).
template <int ROWS>
struct QkBTile {
  static void run(const uint16_t* q, float* dst, const uint16_t* panel, int64_t ld) {
    __m512 c0[ROWS], c1[ROWS];
    for (int r = 0; r < ROWS; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < kFusedDim / 2; ++d) {
      const __m512bh b0 = as_bh(_mm512_loadu_si512(panel + d * 2 * kBPanel));
      const __m512bh b1 = as_bh(_mm512_loadu_si512(panel + d * 2 * kBPanel + kBPanel));
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh a = pair_of(q + r * kFusedDim + 2 * d);
        c0[r] = _mm512_dpbf16_ps(c0[r], a, b0);
        c1[r] = _mm512_dpbf16_ps(c1[r], a, b1);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      _mm512_storeu_ps(dst + r * ld, c0[r]);
      _mm512_storeu_ps(dst + r * ld + 16, c1[r]);
    }
  }
};

// dst[r][0:32] = sum over key pairs j < np of p[r][2j:2j+2] . v[2j:2j+2][0:32] (one slice).
template <int ROWS>
struct PvBTile {
  static void run(const uint16_t* p, float* dst, int64_t ldp, const uint16_t* v, int64_t np) {
    __m512 c0[ROWS], c1[ROWS];
    for (int r = 0; r < ROWS; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < np; ++j) {
      const __m512bh b0 = as_bh(_mm512_loadu_si512(v + j * 2 * kBPanel));
      const __m512bh b1 = as_bh(_mm512_loadu_si512(v + j * 2 * kBPanel + kBPanel));
      for (int r = 0; r < ROWS; ++r) {
        const __m512bh a = pair_of(p + r * ldp + 2 * j);
        c0[r] = _mm512_dpbf16_ps(c0[r], a, b0);
        c1[r] = _mm512_dpbf16_ps(c1[r], a, b1);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      _mm512_storeu_ps(dst + r * kFusedDim, c0[r]);
      _mm512_storeu_ps(dst + r * kFusedDim + 16, c1[r]);
    }
  }
};

// Tile<n>::run for a row tail 0 < n <= N.
template <template <int> class Tile, int N, typename... Args>
inline void tail_tile(int64_t n, Args... args) {
  if constexpr (N > 0) {
    if (n == N) {
      Tile<N>::run(args...);
    } else {
      tail_tile<Tile, N - 1>(n, args...);
    }
  }
}

template <template <int> class Tile, typename... Args>
inline void over_brows(int64_t R, int64_t step_in, int64_t step_out, const uint16_t* in, float* out, Args... args) {
  int64_t r = 0;
  for (; r + kBTileRows <= R; r += kBTileRows) Tile<kBTileRows>::run(in + r * step_in, out + r * step_out, args...);
  if (r < R) tail_tile<Tile, kBTileRows - 1>(R - r, in + r * step_in, out + r * step_out, args...);
}

// S = Q K^T for R rows (bf16 Q) and the first nc keys of a block in bf16 panels (dst ld ld;
// columns up to the next multiple of 32 are written).
void qk_bpanels(const uint16_t* q, int64_t R, const uint16_t* panels, int64_t nc, float* dst, int64_t ld) {
  for (int64_t p = 0; p * kBPanel < nc; ++p)
    over_brows<QkBTile>(R, kFusedDim, ld, q, dst + p * kBPanel, panels + p * kBPanelHalves, ld);
}

// pv = P V for R rows (bf16 P, ld ldp, zero past the keys) over np key pairs (V in bf16 slices).
void pv_bpanels(const uint16_t* p, int64_t R, int64_t ldp, const uint16_t* slices, int64_t stride, int64_t np,
                float* pv) {
  for (int64_t s = 0; s < kFusedDim / kBPanel; ++s)
    over_brows<PvBTile>(R, ldp, kFusedDim, p, pv + s * kBPanel, ldp, slices + s * stride, np);
}
#endif

// The item's Q tile into sc.q, and as bf16 into sc.qb where its many-row blocks take bf16 dot
// products (values exact in bf16).
void load_q(const Call& c, const Item& it, Scratch& sc) {
  load_q_rows(c, it, sc.q.get());
#ifdef QFA_BF16_DOT
  const int64_t R = (it.t1 - it.t0) * c.group;
  if (c.bf16 && !fused(c, R)) to_bf16(sc.q.get(), R * c.dim, sc.half(sc.qb));
#endif
}

// Which kernels the last call's blocks ran (bits; the bench names them per row, the tests check
// the bf16 path really ran): bf16 dot products, the AVX2 tiles or fused kernels, MKL / scalar.
constexpr int kPathBf16 = 1, kPathAvx2 = 2, kPathScalar = 4;
std::atomic<int> last_paths{0};
inline void ran(int bit) {
  if (!(last_paths.load(std::memory_order_relaxed) & bit)) last_paths.fetch_or(bit, std::memory_order_relaxed);
}

// Scores of block blk for the rows [lo, R) of the item: row r at dst + (r - lo) * block_n.
// Sets vblk to the block's fp32 V where it is pre-decoded, else to nullptr. Returns nk.
int64_t scores(const Call& c, const Item& it, int64_t blk, int64_t lo, Scratch& sc, float* dst, const float*& vblk) {
  const int64_t b = it.b, h = it.h, D = c.dim, BN = c.block_n;
  const int64_t R = (it.t1 - it.t0) * c.group;
  const int64_t j0 = blk * BN, j1 = std::min(j0 + BN, c.kv_lens[b]);
  const int64_t nk = j1 - j0;
  const int64_t nc = columns(c, it, j0, nk);
  const float* kpre = nullptr;
  vblk = nullptr;  // decoded by the caller when needed
  if (!c.k_dec.empty() && c.k_dec[b]) {
    kpre = c.k_dec[b] + (h * c.kv_lens[b] + j0) * D;
    if (!c.panel_gemm) vblk = c.v_dec[b] + (h * c.kv_lens[b] + j0) * D;  // (panel builds: V in slices)
  }
#ifdef QFA_SIMD
  if (fused(c, R - lo)) {  // (with panel GEMMs the pre-decoded K is in panels: decode the codes)
    qk_fused(c, it, c.panel_gemm ? nullptr : kpre, j0, lo, R, nc, sc, dst);
    ran(kPathAvx2);
    return nk;
  }
#ifdef QFA_BF16_DOT
  if (c.bf16) {
    const uint16_t* panels;
    if (!c.kb_dec.empty() && c.kb_dec[b]) {
      panels = c.kb_dec[b] + (h * ((c.kv_lens[b] + BN - 1) / BN) + blk) * BN * D;
    } else {
      decode_rows(c.dec, D, c.k, b, h, c.kv_starts[b], j0, j0 + nc, sc.half(sc.kb));
      to_bpanels(sc.half(sc.kb), nc, sc.half(sc.kp));
      panels = sc.half(sc.kp);
    }
    qk_bpanels(sc.half(sc.qb) + lo * D, R - lo, panels, nc, dst, BN);
    ran(kPathBf16);
    return nk;
  }
#endif
  if (c.panel_gemm) {
    if (kpre) {
      kpre = c.k_dec[b] + (h * ((c.kv_lens[b] + BN - 1) / BN) + blk) * BN * D;
    } else {
      decode_rows(c.dec, D, c.k, b, h, c.kv_starts[b], j0, j0 + nc, sc.k.get());
      to_panels(sc.k.get(), nc, sc.kp.get());
      kpre = sc.kp.get();
    }
    qk_panels(sc.q.get() + lo * D, R - lo, kpre, nc, dst, BN);
    ran(kPathAvx2);
    return nk;
  }
#endif
  ran(kPathScalar);
  const float* kblk = kpre;
  if (!kblk) {
    decode_rows(c.dec, D, c.k, b, h, c.kv_starts[b], j0, j1, sc.k.get());
    kblk = sc.k.get();
  }
  auto S = wrap(dst, R - lo, nc, BN);
  at::mm_out(S, wrap(sc.q.get() + lo * D, R - lo, D, D), wrap(const_cast<float*>(kblk), nc, D, D).t());
  return nk;
}

// Visible columns of row r in block blk (causal rows that cross the diagonal see a prefix).
inline int64_t visible(const Call& c, const Item& it, int64_t r, int64_t j0, int64_t nk) {
  if (!c.causal) return nk;
  const int64_t pos = it.t0 + r / c.group;
  return std::min(nk, pos + offset_of(c, it.b) - j0 + 1);
}

// First row of the item that sees any key of the block at j0 (causal rows skip earlier blocks).
inline int64_t first_row(const Call& c, const Item& it, int64_t j0) {
  if (!c.causal) return 0;
  const int64_t r0 = std::max(it.t0, j0 - offset_of(c, it.b));
  return std::min(r0, it.t1) - it.t0;
}

#ifdef QFA_SIMD
// pv = P V for rows [lo, R) of the block at j0 (nk keys): row r sums its visible keys alone, in
// ascending order, so a non-finite value reaches only the rows that see its key.
void pv_fused(const Call& c, const Item& it, const float* vpre, int64_t j0, int64_t nk, int64_t lo, int64_t R,
              const float* p, Scratch& sc, float* pv) {
  constexpr int64_t D = kFusedDim;
  const int64_t BN = c.block_n;
  std::memset(pv, 0, sizeof(float) * (R - lo) * D);
  float* buf = sc.v.get();
  // Each row's visible keys, once per block (visible() divides by the group).
  int64_t vis_small[kFusedRows];
  std::vector<int64_t> vis_big;
  if (R - lo > kFusedRows) vis_big.resize(R - lo);
  int64_t* vis = R - lo > kFusedRows ? vis_big.data() : vis_small;
  int64_t vis_max = 0;
  for (int64_t r = lo; r < R; ++r) {
    vis[r - lo] = visible(c, it, r, j0, nk);
    vis_max = std::max(vis_max, vis[r - lo]);
  }
  for (int64_t g0 = 0; g0 < vis_max; g0 += kGroup) {
    const int64_t n = std::min(kGroup, vis_max - g0);
    const float* vr = key_rows(c, it, c.v, vpre, j0, g0, n, buf);
    // Two rows x 32 dims per pass (6 loads per 8 FMAs); each element is its row's chain over
    // the keys in ascending order, whichever pass computes it.
    int64_t r = lo;
    for (; r < R; r += 2) {
      const bool pair = r + 1 < R;
      const int64_t n0 = std::max<int64_t>(0, std::min(n, vis[r - lo] - g0));
      const int64_t n1 = pair ? std::max<int64_t>(0, std::min(n, vis[r + 1 - lo] - g0)) : 0;
      const int64_t both = std::min(n0, n1);
      const float* p0 = p + (r - lo) * BN + g0;
      const float* p1 = p0 + BN;
      float* o0 = pv + (r - lo) * D;
      float* o1 = o0 + D;
      for (int64_t x = 0; x < D; x += 32) {
        __m256 a0 = _mm256_loadu_ps(o0 + x), a1 = _mm256_loadu_ps(o0 + x + 8), a2 = _mm256_loadu_ps(o0 + x + 16),
               a3 = _mm256_loadu_ps(o0 + x + 24);
        __m256 b0 = _mm256_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
        if (pair) {
          b0 = _mm256_loadu_ps(o1 + x); b1 = _mm256_loadu_ps(o1 + x + 8); b2 = _mm256_loadu_ps(o1 + x + 16);
          b3 = _mm256_loadu_ps(o1 + x + 24);
        }
        int64_t j = 0;
        for (; j < both; ++j) {
          const __m256 u = _mm256_broadcast_ss(p0 + j), w = _mm256_broadcast_ss(p1 + j);
          const float* v = vr + j * D + x;
          __m256 vv = load_once(v);
          a0 = _mm256_fmadd_ps(u, vv, a0); b0 = _mm256_fmadd_ps(w, vv, b0);
          vv = load_once(v + 8);
          a1 = _mm256_fmadd_ps(u, vv, a1); b1 = _mm256_fmadd_ps(w, vv, b1);
          vv = load_once(v + 16);
          a2 = _mm256_fmadd_ps(u, vv, a2); b2 = _mm256_fmadd_ps(w, vv, b2);
          vv = load_once(v + 24);
          a3 = _mm256_fmadd_ps(u, vv, a3); b3 = _mm256_fmadd_ps(w, vv, b3);
        }
        for (int64_t jj = j; jj < n0; ++jj) {
          const __m256 u = _mm256_broadcast_ss(p0 + jj);
          const float* v = vr + jj * D + x;
          a0 = _mm256_fmadd_ps(u, _mm256_loadu_ps(v), a0); a1 = _mm256_fmadd_ps(u, _mm256_loadu_ps(v + 8), a1);
          a2 = _mm256_fmadd_ps(u, _mm256_loadu_ps(v + 16), a2); a3 = _mm256_fmadd_ps(u, _mm256_loadu_ps(v + 24), a3);
        }
        for (int64_t jj = j; jj < n1; ++jj) {
          const __m256 w = _mm256_broadcast_ss(p1 + jj);
          const float* v = vr + jj * D + x;
          b0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), b0); b1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), b1);
          b2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), b2); b3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), b3);
        }
        _mm256_storeu_ps(o0 + x, a0); _mm256_storeu_ps(o0 + x + 8, a1); _mm256_storeu_ps(o0 + x + 16, a2);
        _mm256_storeu_ps(o0 + x + 24, a3);
        if (pair) {
          _mm256_storeu_ps(o1 + x, b0); _mm256_storeu_ps(o1 + x + 8, b1); _mm256_storeu_ps(o1 + x + 16, b2);
          _mm256_storeu_ps(o1 + x + 24, b3);
        }
      }
    }
  }
}
#endif

// Pass 1 of a split item: the running max its blocks contribute, per row, into mx (R floats).
// With a store (R x block_n floats per block of the chunk), the scores are kept for pass 2.
void chunk_max(const Call& c, const Item& it, Scratch& sc, float* mx, float* store) {
  const int64_t R = (it.t1 - it.t0) * c.group;
  for (int64_t r = 0; r < R; ++r) mx[r] = kNegInf;
  for (int64_t blk = it.c0; blk < it.c1; ++blk) {
    const int64_t j0 = blk * c.block_n;
    const int64_t lo = first_row(c, it, j0) * c.group;
    if (lo >= R) continue;
    const float* vblk;
    float* dst = store ? store + (blk - it.c0) * R * c.block_n : sc.s.get();
    const int64_t nk = scores(c, it, blk, lo, sc, dst, vblk);
    for (int64_t r = lo; r < R; ++r) {
      const int64_t nv = visible(c, it, r, j0, nk);
      const float rm = row_max(dst + (r - lo) * c.block_n, nv);
      mx[r] = max_nan(mx[r], rm * c.dscale - c.ln_p);
    }
  }
}

// The online-softmax walk of the item's blocks from running max m (R floats, updated), with l, O
// and the product of its alphas (prod, for the merge of split items) from l = 0, O = 0, prod = 1.
// ``store``: the scores pass 1 kept (then K is not read again), or nullptr.
void walk(const Call& c, const Item& it, Scratch& sc, float* store) {
  const int64_t D = c.dim, BN = c.block_n;
  const int64_t R = (it.t1 - it.t0) * c.group;
  float* m = sc.m.get();
  float* l = sc.l.get();
  float* o = sc.o.get();
  float* prod = sc.prod.get();
  float* alpha = sc.alpha.get();
  float* rsum = sc.rsum.get();
  for (int64_t r = 0; r < R; ++r) { l[r] = 0.f; prod[r] = 1.f; }
  std::memset(o, 0, sizeof(float) * R * D);
  for (int64_t blk = it.c0; blk < it.c1; ++blk) {
    const int64_t j0 = blk * BN;
    const int64_t lo = first_row(c, it, j0) * c.group;
    if (lo >= R) continue;
    const float* vblk = nullptr;
    float* sblk = sc.s.get();
    int64_t nk;
    if (store) {
      sblk = store + (blk - it.c0) * R * BN;
      nk = std::min(j0 + BN, c.kv_lens[it.b]) - j0;
      if (!c.panel_gemm && !c.v_dec.empty() && c.v_dec[it.b])
        vblk = c.v_dec[it.b] + (it.h * c.kv_lens[it.b] + j0) * D;
    } else {
      nk = scores(c, it, blk, lo, sc, sblk, vblk);
    }
    const int64_t nc = columns(c, it, j0, nk);
#ifdef QFA_BF16_DOT
    const bool bf16_block = c.bf16 && !fused(c, R - lo);
    const int64_t ncp = (nc + 1) & ~int64_t(1);  // P V sums key pairs: an odd count ends with a zero P
#endif
    for (int64_t r = lo; r < R; ++r) {
      float* s = sblk + (r - lo) * BN;
      const int64_t nv = visible(c, it, r, j0, nk);
      const float rm = row_max(s, nv);
      const float m_new = max_nan(m[r], rm * c.dscale - c.ln_p);
      // Rows that have seen no key keep m = -inf; subtract 0 there so exp gives 0, not NaN.
      const float m_safe = m_new == kNegInf ? 0.f : m_new;
      // One pass: exponent (S * dScale - m, rounded twice as in the torch path), exp, row sum.
      const Vec vd(c.dscale), vm(m_safe);
      Vec acc(0.f);
      int64_t j = 0;
      for (; j + Vec::size() <= nv; j += Vec::size()) {
        const Vec p = (Vec::loadu(s + j) * vd - vm).exp();
        p.store(s + j);
        acc = acc + p;
      }
      float sum = 0.f;
      {
        alignas(64) float tmp[Vec::size()];
        acc.store(tmp);
        for (int i = 0; i < Vec::size(); ++i) sum += tmp[i];
      }
      if (j < nv) {
        (Vec::loadu(s + j, nv - j) * vd - vm).exp().store(s + j, nv - j);
        for (; j < nv; ++j) sum += s[j];
      }
#ifdef QFA_BF16_DOT
      if (bf16_block) {
        round_to_bf16(s, nv, ncp, c.rc, sc.half(sc.pb) + (r - lo) * BN);
      } else
#endif
      {
        round_row(s, nv, c.rc);
        for (int64_t jj = nv; jj < nc; ++jj) s[jj] = 0.f;
      }
      alpha[r] = m[r] - m_safe;
      rsum[r] = sum;
      m[r] = m_new;
    }
    exp_inplace(alpha + lo, R - lo);
    for (int64_t r = lo; r < R; ++r) l[r] = alpha[r] * l[r] + rsum[r];
    bool done = false;
#ifdef QFA_SIMD
    if (fused(c, R - lo)) {
      pv_fused(c, it, vblk, j0, nk, lo, R, sblk, sc, sc.pv.get());
      done = true;
#ifdef QFA_BF16_DOT
    } else if (bf16_block) {
      // As the fp32 tiles: a block holding a value that is not finite runs pv_fused (fp32 P,
      // each row over its visible keys), which decodes the codes itself.
      const uint16_t* slices = nullptr;
      bool finite;
      if (!c.vb_dec.empty() && c.vb_dec[it.b]) {
        const int64_t at_ = it.h * ((c.kv_lens[it.b] + BN - 1) / BN) + blk;
        slices = c.vb_dec[it.b] + at_ * BN * D;
        finite = c.v_finite[it.b][at_] != 0;
      } else {
        finite = decode_rows(c.dec, D, c.v, it.b, it.h, c.kv_starts[it.b], j0, j0 + nc, sc.half(sc.vb));
        if (finite) {
          to_bslices(sc.half(sc.vb), nc, sc.half(sc.vs), BN * kBPanel);
          slices = sc.half(sc.vs);
        }
      }
      if (finite) {
        pv_bpanels(sc.half(sc.pb), R - lo, BN, slices, BN * kBPanel, ncp / 2, sc.pv.get());
      } else {
        pv_fused(c, it, nullptr, j0, nk, lo, R, sblk, sc, sc.pv.get());
        ran(kPathAvx2);
      }
      done = true;
#endif
    } else if (c.panel_gemm) {
      // A value that is not finite must reach only the rows that see its key (0 * NaN is NaN):
      // such a block (rare) runs pv_fused, which sums each row's visible keys; same bits otherwise.
      const float* slices = nullptr;
      bool finite;
      if (!c.v_dec.empty() && c.v_dec[it.b]) {
        const int64_t at_ = it.h * ((c.kv_lens[it.b] + BN - 1) / BN) + blk;
        slices = c.v_dec[it.b] + at_ * BN * D;
        finite = c.v_finite[it.b][at_] != 0;
        vblk = nullptr;  // pv_fused decodes the codes
      } else {
        finite = decode_rows(c.dec, D, c.v, it.b, it.h, c.kv_starts[it.b], j0, j0 + nc, sc.v.get());
        vblk = sc.v.get();
        if (finite) {
          to_slices(vblk, nc, sc.vs.get(), BN * kPanel);
          slices = sc.vs.get();
        }
      }
      if (finite) {
        pv_panels(sblk, R - lo, BN, slices, BN * kPanel, nc, sc.pv.get());
      } else {
        pv_fused(c, it, vblk, j0, nk, lo, R, sblk, sc, sc.pv.get());
      }
      done = true;
    }
#endif
    if (!done) {
      // A value that is not finite (Inf/NaN codes) must reach only the rows that see its key:
      // in a GEMM, P = 0 times NaN is NaN. Such a block (rare) sums each row's visible keys alone.
      bool finite;
      if (!vblk) {
        finite = decode_rows(c.dec, D, c.v, it.b, it.h, c.kv_starts[it.b], j0, j0 + nk, sc.v.get());
        vblk = sc.v.get();
      } else {
        finite = c.v_finite[it.b][it.h * ((c.kv_lens[it.b] + BN - 1) / BN) + blk] != 0;
      }
      if (finite) {
        auto PV = wrap(sc.pv.get(), R - lo, D, D);
        at::mm_out(PV, wrap(sblk, R - lo, nc, BN), wrap(const_cast<float*>(vblk), nc, D, D));
      } else {
        for (int64_t r = lo; r < R; ++r) {
          float* acc = sc.pv.get() + (r - lo) * D;
          std::fill(acc, acc + D, 0.f);
          const float* prow = sblk + (r - lo) * BN;
          for (int64_t j = 0; j < visible(c, it, r, j0, nk); ++j)
            for (int64_t x = 0; x < D; ++x) acc[x] += prow[j] * vblk[j * D + x];
        }
      }
    }
    const Vec vds(c.v_descale);
    for (int64_t r = lo; r < R; ++r) {
      const Vec a(alpha[r]);
      float* orow = o + r * D;
      const float* prow = sc.pv.get() + (r - lo) * D;
      for (int64_t x = 0; x < D; x += Vec::size())
        (Vec::loadu(orow + x) * a + Vec::loadu(prow + x) * vds).store(orow + x);
      prod[r] = prod[r] * alpha[r];
    }
  }
}


inline int16_t bf16_half_away(float x) {
  if (std::isnan(x)) return static_cast<int16_t>(0x7FC0);
  int32_t bits;
  std::memcpy(&bits, &x, 4);
  return static_cast<int16_t>((bits + 0x8000) >> 16);
}

// Out and lse of the item's rows from the final (m, l, O): O / l as bf16 (ties away) and
// m + ln l. Whether a row sees a key is structural (lengths, causal edge), never read from l:
// rows that see none get 0 and +inf; a row whose visible scores are all -inf has l = 0 and
// gets 0 / 0 = NaN (lse -inf), as the exact softmax and the torch path do.
void finish(const Call& c, const Item& it, const float* m, const float* l, const float* o, float* logl) {
  const int64_t G = c.group, D = c.dim;
  const int64_t R = (it.t1 - it.t0) * G;
  std::memcpy(logl, l, sizeof(float) * R);
  int64_t j = 0;
  for (; j + Vec::size() <= R; j += Vec::size()) Vec::loadu(logl + j).log().store(logl + j);
  if (j < R) Vec::loadu(logl + j, R - j).log().store(logl + j, R - j);
  const int64_t qs = c.q_starts[it.b];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = it.t0 + r / G, n = it.h * G + r % G;
    const int64_t at = it.b * c.so[0] + n * c.so[1] + (qs + i) * c.so[2];
    const bool seen = c.kv_lens[it.b] > 0 && (!c.causal || i + offset_of(c, it.b) >= 0);
    const float* orow = o + r * D;
    if (c.out_f32) {
      for (int64_t x = 0; x < D; ++x) c.out_f32[at + x * c.so[3]] = seen ? orow[x] / l[r] : 0.f;
    } else {
      for (int64_t x = 0; x < D; ++x) c.out[at + x * c.so[3]] = seen ? bf16_half_away(orow[x] / l[r]) : int16_t(0);
    }
    if (c.lse) c.lse[it.b * c.sl[0] + n * c.sl[1] + (qs + i) * c.sl[2]] = seen ? m[r] + logl[r] : kInf;
  }
}

// torch enables nested OpenMP (max-active-levels), so a GEMM called inside the region would
// open a team of its own on every call: on 2 cores, 4 spinning threads, and under load each
// call waits for its slowest one. A worker's GEMMs run on the worker's thread alone: OpenMP's
// setting, and MKL's own (torch sets MKL's thread count, which MKL reads instead of OpenMP's,
// so the OpenMP setting alone leaves every GEMM in a worker a nested team of torch's size).
// MKL's per-thread setting (its C entry point; the lower-case symbol is the Fortran one, by
// pointer) is looked up at run time: torch builds without MKL have none.
// Restored on exit: the calling thread runs a share of the region (or all of it, inline), and
// its OpenMP setting is torch.get_num_threads() for the rest of the process.
using MklSetLocal = int (*)(int);
MklSetLocal mkl_set_local() {
  static const MklSetLocal f = [] {
    void* self = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    void* sym = self ? dlsym(self, "MKL_Set_Num_Threads_Local") : nullptr;
    if (!sym) sym = dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local");
    return reinterpret_cast<MklSetLocal>(sym);
  }();
  return f;
}

struct SingleThreadedBlas {
  int saved = omp_get_max_threads();
  int saved_mkl = 0;
  SingleThreadedBlas() {
    omp_set_num_threads(1);
    if (MklSetLocal f = mkl_set_local()) saved_mkl = f(1);
  }
  ~SingleThreadedBlas() {
    omp_set_num_threads(saved);
    if (MklSetLocal f = mkl_set_local()) f(saved_mkl);
  }
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// ---- the workers ------------------------------------------------------------------------------
// A region of n items, handed out by an atomic counter to the threads that run it (torch's
// OpenMP team, or the caller and the kernel's own pool: see run_items). On the pool the caller
// waits only for items that some thread has taken: a pool thread that is slow to wake (the core
// is busy with another process) finds the counter spent and takes nothing, where an OpenMP
// region waits at its closing barrier for every thread of the team. Items are the unit of work;
// which thread runs one never changes what it computes.
struct Region {
  std::function<void(int64_t, Scratch&)> fn;
  int64_t n = 0;
  int64_t helpers = 0;  // pool threads that may join (min(threads, n) - 1)
  std::atomic<int64_t> next{0}, done{0}, joined{0};
  std::mutex m;
  std::condition_variable cv;
  std::exception_ptr error;

  void drain(Scratch& sc) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      try {
        fn(i, sc);
      } catch (...) {
        std::lock_guard<std::mutex> lk(m);
        if (!error) error = std::current_exception();
      }
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lk(m);
        cv.notify_all();
      }
    }
  }
};

class Pool {
 public:
  static Pool& get() {
    static std::once_flag registered;
    std::call_once(registered, [] { pthread_atfork(nullptr, nullptr, [] { instance() = nullptr; }); });
    Pool*& p = instance();
    if (!p) p = new Pool();  // never destroyed: its threads sleep until the process exits
    return *p;
  }

  // Runs fn on every item with up to threads - 1 pool threads beside the caller.
  template <typename F>
  void run(int64_t n, int64_t threads, const F& fn) {
    if (n <= 0) return;
    auto r = std::make_shared<Region>();
    r->fn = fn;
    r->n = n;
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    // A second concurrent call (another Python thread) runs alone on its own thread.
    r->helpers = busy.owns_lock() ? std::min<int64_t>(threads, n) - 1 : 0;
    if (r->helpers > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      while (static_cast<int64_t>(threads_.size()) < r->helpers) {
        threads_.emplace_back([this] { work(); });
        steered_for_ = -1;
      }
      steer();
      region_ = r;
      ++generation_;
    }
    if (r->helpers > 0) cv_.notify_all();
    {
      SingleThreadedBlas one;
      r->drain(thread_scratch());
    }
    {
      std::unique_lock<std::mutex> lk(r->m);
      r->cv.wait(lk, [&] { return r->done.load() == r->n; });
    }
    if (r->helpers > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      region_.reset();
    }
    if (r->error) std::rethrow_exception(r->error);
  }

 private:
  static Pool*& instance() {
    static Pool* p = nullptr;
    return p;
  }

  // The pool's threads may run on any of the caller's CPUs but the one it is on. The caller wakes
  // them, and when no CPU is idle (torch's OpenMP worker spins for milliseconds after each of
  // torch's own parallel ops, so in a model there is none) the scheduler places a woken thread
  // on the waker's CPU: the caller and its helper then share one core while the other spins
  // (measured on the 2-core EPYC: 9 calls in 10, and a decode call took 1.2 ms instead of 0.6).
  // Set again only when the caller has moved. Under mu_.
  void steer() {
    const int cpu = sched_getcpu();
    if (cpu < 0 || cpu == steered_for_) return;
    // The caller's CPUs now, not when the pool was made: a restriction since (taskset -a, a
    // launcher pinning every thread, a cpuset change) is kept.
    cpu_set_t others;
    CPU_ZERO(&others);
    if (sched_getaffinity(0, sizeof(others), &others) != 0 || !CPU_ISSET(cpu, &others) || CPU_COUNT(&others) < 2)
      return;
    CPU_CLR(cpu, &others);
    for (auto& t : threads_) pthread_setaffinity_np(t.native_handle(), sizeof(others), &others);
    steered_for_ = cpu;
  }

  void work() {
    SingleThreadedBlas one;  // for the thread's life
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Region> r;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
        r = region_;
      }
      if (!r || r->joined.fetch_add(1) >= r->helpers) continue;
      r->drain(thread_scratch());
    }
  }

  std::mutex busy_;  // held by the call whose region the pool runs
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
  std::shared_ptr<Region> region_;
  uint64_t generation_ = 0;
  int steered_for_ = -1;    // the caller CPU the threads' affinity excludes, -1 for none yet
};

// Which threads run a region. Torch's own OpenMP team by default: after each of torch's parallel
// ops its worker spins for about 10 ms (measured here), so in a model, where torch ops surround
// every attention call, a thread of the kernel's own would share a core with that spinning worker
// (a B = 8 decode call took 1.3-1.5x its time alone), while the spinning worker itself takes
// items within microseconds. But an OpenMP region ends in a barrier that waits for every thread
// of the team to arrive, and with another process busy on a core a worker is often a scheduler
// slice late (1-5 ms in a quarter of the calls here; a 4 ms call took 3x its quiet time). So a
// region whose worker arrived late sends the calls of the next kOwnPoolMs to the kernel's own
// pool, whose caller waits only for items a thread has taken, then OpenMP is tried again.
// QFA_POOL=omp or own pins the choice (the tests run both). Never a difference in the bits.
enum class Team { automatic, own, omp };
constexpr int64_t kLateUs = 500;
constexpr int64_t kOwnPoolMs = 200;

// libgomp's team does not survive fork (a child's first parallel region hangs, torch's own ops
// included); the kernel's pool starts afresh there, so a forked child always runs on it.
std::atomic<bool> forked_child{false};
const int fork_watch = pthread_atfork(nullptr, nullptr, [] { forked_child.store(true); });

Team team_setting() {
  static const Team t = [] {
    const char* e = std::getenv("QFA_POOL");
    const std::string v = e ? e : "";
    return v == "own" ? Team::own : v == "omp" ? Team::omp : Team::automatic;
  }();
  return forked_child.load() ? Team::own : t;
}

// The last region's team (0 the caller alone, 1 the own pool, 2 OpenMP) and, for OpenMP, how
// many threads entered it: for the tests.
std::atomic<int> last_team{0}, last_entered{0};

inline int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Runs fn on items [0, n) on torch's OpenMP team of `threads`; returns how late (us) the latest of
// its other threads arrived.
template <typename F>
int64_t run_on_openmp(int64_t n, int64_t threads, const F& fn) {
  Region r;
  r.fn = fn;
  r.n = n;
  const int64_t t0 = now_us();
  std::atomic<int64_t> late{0};
  last_entered.store(0);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t) {
    last_entered.fetch_add(1);
    if (first > 0) {
      const int64_t us = now_us() - t0;
      for (int64_t cur = late.load(); us > cur && !late.compare_exchange_weak(cur, us);) {}
    }
    SingleThreadedBlas one;
    r.drain(thread_scratch());
    // Wait for the items others have taken asleep once past a short spin: a thread spinning in
    // the closing barrier holds its core, and a straggler on a busy core could not move there.
    for (int spins = 0; r.done.load() != r.n && spins < 2000; ++spins) cpu_relax();
    std::unique_lock<std::mutex> lk(r.m);
    r.cv.wait(lk, [&] { return r.done.load() == r.n; });
  });
  if (r.error) std::rethrow_exception(r.error);
  return late.load();
}

// Hands items out costliest first to whichever thread asks next; one region.
// us: every region runs on the own pool until then. One for all regions (a static local of
// run_items would be one per lambda type: prefill's predecode region would keep its own).
std::atomic<int64_t> own_until{0};

// Regions the current call has run (one per call: see forward), for the tests.
std::atomic<int> regions{0};

template <typename F>
void run_items(int64_t n, const F& fn) {
  regions.fetch_add(1);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  const Team team = team_setting();
  if (threads <= 1 || team == Team::own || (team == Team::automatic && now_us() < own_until.load())) {
    last_team.store(threads <= 1 ? 0 : 1);
    Pool::get().run(n, threads, fn);
    return;
  }
  last_team.store(2);
  // The whole team, not `threads` of it: torch's region starts every thread and its closing
  // barrier waits for each, so each one's lateness must count (those past n take no item).
  const int64_t late = run_on_openmp(n, at::get_num_threads(), fn);
  if (team == Team::automatic && late > kLateUs) own_until.store(now_us() + kOwnPoolMs * 1000);
}

std::vector<int64_t> by_cost(const std::vector<Item>& items) {
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return items[a].cost > items[b].cost; });
  return order;
}


struct Partial {
  std::vector<float> m, l, prod, o;
};

}  // namespace

// See qfa/attention/cpu_kernel.py for the arguments.
void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::vector<int64_t> strides,
             at::Tensor& out, std::vector<int64_t> out_strides, at::Tensor& lse, std::vector<int64_t> lse_strides,
             int64_t heads_kv, int64_t group, int64_t dim, int64_t block_n, std::vector<int64_t> q_starts,
             std::vector<int64_t> kv_starts, std::vector<int64_t> q_lens, std::vector<int64_t> kv_lens, bool causal,
             double dscale, double ln_p, double v_descale, const at::Tensor& decode_table,
             std::vector<int64_t> round_consts, int64_t tile_rows, int64_t split_rows, int64_t chunk_blocks, int64_t predecode_bytes,
             int64_t store_bytes, const at::Tensor& block_table, int64_t block_size, bool bf16, bool fill) {
  TORCH_CHECK(q.dtype() == at::kByte && k.dtype() == at::kByte && v.dtype() == at::kByte, "codes must be uint8");
  TORCH_CHECK(out.dtype() == at::kBFloat16 || out.dtype() == at::kFloat, "out must be bf16 (or fp32)");
  TORCH_CHECK(dim % Vec::size() == 0, "head_dim must be a multiple of the vector width");
  TORCH_CHECK(decode_table.dtype() == at::kFloat && decode_table.numel() == 256 && decode_table.is_contiguous());
  TORCH_CHECK(round_consts.size() == 7 && strides.size() == 12 && out_strides.size() == 4 && lse_strides.size() == 3);
#ifndef QFA_BF16_DOT
  TORCH_CHECK(!bf16, "bf16 dot products need the AVX512_BF16 build of the kernel");
#endif
  last_paths.store(0);
  regions.store(0);
  if (fill) {
    // A fresh out / lse: 0 and +inf for the rows no batch owns, set here on the calling thread. A
    // torch fill just before the call runs on torch's OpenMP team, whose worker then spins for
    // milliseconds on the core this call's pool thread needs (a fifth of a B = 8 decode call).
    TORCH_CHECK(out.is_contiguous() && lse.is_contiguous(), "fill: out and lse must be contiguous");
    if (out.numel()) std::memset(out.data_ptr(), 0, out.numel() * out.element_size());
    if (lse.numel()) std::fill(lse.data_ptr<float>(), lse.data_ptr<float>() + lse.numel(), kInf);
  }
  Call c;
  c.q = q.data_ptr<uint8_t>();
  c.k.base = k.data_ptr<uint8_t>(); c.v.base = v.data_ptr<uint8_t>();
  for (int i = 0; i < 4; ++i) { c.sq[i] = strides[i]; c.k.st[i] = strides[4 + i]; c.v.st[i] = strides[8 + i]; c.so[i] = out_strides[i]; }
  if (block_table.numel()) {  // paged K/V, read in place (the planner checked the table's values)
    TORCH_CHECK(block_table.dtype() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1 &&
                block_size > 0, "block_table: int32 (B, blocks) with unit stride along a row, and block_size > 0");
    for (KvSrc* src : {&c.k, &c.v}) {
      src->table = block_table.data_ptr<int32_t>();
      src->table_stride = block_table.stride(0);
      src->block_size = block_size;
    }
  }
  c.out = out.dtype() == at::kBFloat16 ? reinterpret_cast<int16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  c.out_f32 = out.dtype() == at::kFloat ? out.data_ptr<float>() : nullptr;
  c.lse = lse.numel() ? lse.data_ptr<float>() : nullptr;
  for (int i = 0; i < 3; ++i) c.sl[i] = lse_strides[i];
  c.heads_kv = heads_kv; c.group = group; c.dim = dim; c.block_n = block_n;
  c.q_starts = q_starts; c.kv_starts = kv_starts; c.q_lens = q_lens; c.kv_lens = kv_lens;
  c.causal = causal;
  c.dscale = static_cast<float>(dscale); c.ln_p = static_cast<float>(ln_p); c.v_descale = static_cast<float>(v_descale);
  c.dec.init(decode_table.data_ptr<float>());
  c.rc = round_consts_of(round_consts);
#ifdef QFA_SIMD
  c.panel_gemm = dim == kFusedDim && block_n % kPanel == 0;
#endif
#ifdef QFA_BF16_DOT
  c.bf16 = bf16 && c.panel_gemm && c.dec.simd && block_n % kBPanel == 0;
#endif
  const int64_t B = static_cast<int64_t>(q_lens.size());
  const int64_t T = std::max<int64_t>(1, tile_rows / group);  // query positions per tile

  // Work items: (batch, kv head, query tile); tiles that see no key still write their rows.
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    if (q_lens[b] == 0) continue;  // (kv_len 0: items without blocks, which write 0 / +inf)
    for (int64_t h = 0; h < heads_kv; ++h) {
      for (int64_t t0 = 0; t0 < q_lens[b]; t0 += T) {
        const int64_t t1 = std::min(q_lens[b], t0 + T);
        const int64_t ke = key_end(c, b, t1);
        const int64_t nb = ke > 0 ? (ke + block_n - 1) / block_n : 0;
        items.push_back(Item{b, h, t0, t1, 0, nb, -1, -1, double((t1 - t0) * group) * double(std::max<int64_t>(nb, 1))});
      }
    }
  }

  // K and V decoded once for batches that several tiles read (prefill), within a budget: fp32
  // (rows, or panels and slices), or bf16 panels and slices. The blocks are the region's first
  // items; an item of such a batch waits until its kv head's blocks are done (pre_left).
  std::vector<at::Tensor> keep;
  c.k_dec.assign(B, nullptr); c.v_dec.assign(B, nullptr); c.v_finite.assign(B, {});
  c.kb_dec.assign(B, nullptr); c.vb_dec.assign(B, nullptr);
  std::vector<int64_t> blocks;  // (b, h, block start) flattened
  std::vector<uint8_t> predecoded(B, 0);
  {
    int64_t bytes = 0;
    for (int64_t b = 0; b < B; ++b) {
      if (q_lens[b] <= T || kv_lens[b] == 0) continue;
      const int64_t nblk_b = (kv_lens[b] + block_n - 1) / block_n;
      const int64_t per_head = (c.panel_gemm ? nblk_b * block_n : kv_lens[b]) * dim;  // panels: whole blocks
      const int64_t k_values = heads_kv * per_head;
      const int64_t elem = c.bf16 ? 2 : 4;
      const int64_t need = 2 * k_values * elem;
      if (bytes + need > predecode_bytes) continue;
      bytes += need;
      keep.push_back(at::empty({need}, at::kByte));
      if (c.bf16) {
        c.kb_dec[b] = reinterpret_cast<uint16_t*>(keep.back().data_ptr<uint8_t>());
        c.vb_dec[b] = c.kb_dec[b] + k_values;
      } else {
        c.k_dec[b] = reinterpret_cast<float*>(keep.back().data_ptr<uint8_t>());
        c.v_dec[b] = c.k_dec[b] + k_values;
      }
      predecoded[b] = 1;
      c.v_finite[b].assign(heads_kv * nblk_b, 0);
      for (int64_t h = 0; h < heads_kv; ++h)
        for (int64_t j0 = 0; j0 < kv_lens[b]; j0 += block_n) blocks.insert(blocks.end(), {b, h, j0});
    }
  }
  const int64_t n_pre = static_cast<int64_t>(blocks.size()) / 3;
  std::unique_ptr<std::atomic<int64_t>[]> pre_left(new std::atomic<int64_t>[std::max<int64_t>(B * heads_kv, 1)]);
  for (int64_t x = 0; x < B * heads_kv; ++x)
    pre_left[x].store(predecoded[x / heads_kv] ? (kv_lens[x / heads_kv] + block_n - 1) / block_n : 0,
                      std::memory_order_relaxed);
  std::atomic<bool> pre_failed{false};
  auto predecode = [&](int64_t i, Scratch& sc) {
    const int64_t b = blocks[3 * i], h = blocks[3 * i + 1], j0 = blocks[3 * i + 2];
    // Counted down on every exit (flagged first if it threw): the items waiting for it go on.
    struct Done {
      std::atomic<int64_t>& left;
      std::atomic<bool>& failed;
      bool ok = false;
      ~Done() {
        if (!ok) failed.store(true);
        left.fetch_sub(1, std::memory_order_release);
      }
    } done{pre_left[b * heads_kv + h], pre_failed};
    const int64_t j1 = std::min(j0 + block_n, kv_lens[b]);
    const int64_t nblk_b = (kv_lens[b] + block_n - 1) / block_n;
    const int64_t off = (h * kv_lens[b] + j0) * dim;
    uint8_t& finite = c.v_finite[b][h * nblk_b + j0 / block_n];
    sc.ensure(1, dim, block_n);
#ifdef QFA_BF16_DOT
    if (c.bf16) {
      const int64_t at_ = (h * nblk_b + j0 / block_n) * block_n * dim;
      decode_rows(c.dec, dim, c.k, b, h, kv_starts[b], j0, j1, sc.half(sc.kb));
      to_bpanels(sc.half(sc.kb), j1 - j0, c.kb_dec[b] + at_);
      finite = decode_rows(c.dec, dim, c.v, b, h, kv_starts[b], j0, j1, sc.half(sc.vb));
      to_bslices(sc.half(sc.vb), j1 - j0, c.vb_dec[b] + at_, block_n * kBPanel);
      done.ok = true;
      return;
    }
#endif
#ifdef QFA_SIMD
    if (c.panel_gemm) {
      const int64_t at_ = (h * nblk_b + j0 / block_n) * block_n * dim;
      decode_rows(c.dec, dim, c.k, b, h, kv_starts[b], j0, j1, sc.k.get());
      to_panels(sc.k.get(), j1 - j0, c.k_dec[b] + at_);
      finite = decode_rows(c.dec, dim, c.v, b, h, kv_starts[b], j0, j1, sc.v.get());
      to_slices(sc.v.get(), j1 - j0, c.v_dec[b] + at_, block_n * kPanel);
      done.ok = true;
      return;
    }
#endif
    decode_rows(c.dec, dim, c.k, b, h, kv_starts[b], j0, j1, c.k_dec[b] + off);
    finite = decode_rows(c.dec, dim, c.v, b, h, kv_starts[b], j0, j1, c.v_dec[b] + off);
    done.ok = true;
  };
  // Before an item reads its batch's decoded K / V: every block of its kv head done. The blocks
  // are handed out before any other item, so this waits only for blocks already being decoded.
  auto wait_predecoded = [&](const Item& it) {
    if (!predecoded[it.b]) return;
    const std::atomic<int64_t>& left = pre_left[it.b * heads_kv + it.h];
    for (int spins = 0; left.load(std::memory_order_acquire) > 0; ++spins) {
      if (spins < 64) {
        cpu_relax();
      } else {
        std::this_thread::yield();
      }
    }
    TORCH_CHECK(!pre_failed.load(), "qfa native attention: decoding K / V for the call failed");
  };

  // Items of few rows (decode: a few new tokens x the GQA group) split their keys into chunks
  // of whole blocks. The split depends only on the item's own shape: never on the thread count,
  // nor on the other batches of the call (a batch gives the same bits alone or with others).
  std::vector<Item> whole, chunks;
  std::vector<int64_t> chunk_begin;  // per split item: its first chunk; chunks of an item are contiguous
  std::vector<Item> split_items;
  for (const Item& it : items) {
    const int64_t nb = it.c1 - it.c0;
    const int64_t rows = (it.t1 - it.t0) * group;
    const int64_t n = rows <= split_rows && chunk_blocks > 0 ? (nb + chunk_blocks - 1) / chunk_blocks : 1;
    if (n <= 1) { whole.push_back(it); continue; }
    chunk_begin.push_back(static_cast<int64_t>(chunks.size()));
    split_items.push_back(it);
    for (int64_t x = 0; x < n; ++x) {
      Item ch = it;
      ch.c0 = it.c0 + nb * x / n;
      ch.c1 = it.c0 + nb * (x + 1) / n;
      ch.slot = static_cast<int64_t>(chunks.size());
      ch.first = chunk_begin.back();
      ch.cost = double((it.t1 - it.t0) * group) * double(ch.c1 - ch.c0);
      chunks.push_back(ch);
    }
  }

  // Split items, pass 1: each chunk's contribution to the running max.
  std::vector<std::vector<float>> cmax(chunks.size());
  // Pass 1's scores are kept for pass 2 when they fit the budget (decode: a few rows per item).
  int64_t store_floats = 0;
  for (const Item& ch : chunks) store_floats += (ch.t1 - ch.t0) * group * (ch.c1 - ch.c0) * block_n;
  std::vector<int64_t> store_at(chunks.size(), -1);
  float* store = nullptr;
  if (!chunks.empty() && store_floats * 4 <= store_bytes) {
    // Decode calls come one per generated token: the calling thread keeps the store (at most the
    // budget) for the next call rather than mapping (and faulting in) fresh pages each time.
    thread_local Buffer kept;
    thread_local int64_t kept_floats = 0;
    if (store_floats > kept_floats) { kept = alloc(store_floats); kept_floats = store_floats; }
    store = kept.get();
    int64_t at_ = 0;
    for (size_t x = 0; x < chunks.size(); ++x) {
      store_at[x] = at_;
      at_ += (chunks[x].t1 - chunks[x].t0) * group * (chunks[x].c1 - chunks[x].c0) * block_n;
    }
  }
  auto store_of = [&](const Item& it) -> float* {
    return it.slot >= 0 && store_at[it.slot] >= 0 ? store + store_at[it.slot] : nullptr;
  };
  // One region for the call: the blocks to decode first, then the items, each split item's
  // chunks' pass 1 before their pass 2 (see work below), so whatever an item waits for (its
  // decoded blocks, its own or earlier chunks' pass 1) is handed out before it and already
  // running on another thread (never an item not yet taken: no deadlock, and one thread runs
  // them in order). Prefill tiles, decode chunks and the blocks they wait for share one counter:
  // a mixed batch (chunked prefill beside decodes) is balanced over the threads as one piece of
  // work. A chunk starts from the running max the sequential walk has before its first block:
  // the max of the earlier chunks' maxima.
  std::unique_ptr<std::atomic<int>[]> max_done(new std::atomic<int>[chunks.size() + 1]);
  for (size_t x = 0; x < chunks.size(); ++x) max_done[x].store(0, std::memory_order_relaxed);
  std::vector<Partial> parts(chunks.size());
  // The order items are handed out in: the blocks to decode, then whole items and split items
  // costliest first, a split item as its chunks' pass 1 then their pass 2 (its K codes, and its
  // kept scores, are still in cache when pass 2 reads them again).
  struct Work {
    int kind;     // 0: decode a K/V block, 1: a chunk's pass 1, 2: a whole item, 3: a chunk's pass 2
    int64_t idx;  // into blocks / chunks / whole / chunks
  };
  std::vector<Work> work;
  work.reserve(n_pre + whole.size() + 2 * chunks.size());
  for (int64_t i = 0; i < n_pre; ++i) work.push_back({0, i});
  {
    std::vector<Item> units = whole;  // (cost, and which: whole item w, or split item s as -1 - s)
    std::vector<int64_t> which(whole.size());
    for (size_t w = 0; w < whole.size(); ++w) which[w] = static_cast<int64_t>(w);
    for (size_t x = 0; x < split_items.size(); ++x) {
      units.push_back(split_items[x]);
      which.push_back(-1 - static_cast<int64_t>(x));
    }
    for (int64_t u : by_cost(units)) {
      const int64_t w = which[u];
      if (w >= 0) {
        work.push_back({2, w});
        continue;
      }
      const size_t x = static_cast<size_t>(-1 - w);
      const int64_t first = chunk_begin[x];
      const int64_t last = x + 1 < split_items.size() ? chunk_begin[x + 1] : static_cast<int64_t>(chunks.size());
      for (int64_t y = first; y < last; ++y) work.push_back({1, y});
      for (int64_t y = first; y < last; ++y) work.push_back({3, y});
    }
  }
  // Merge the chunks of split item s in chunk order: l = l * prod_k + l_k, O = O * prod_k + O_k,
  // where prod_k is the product of chunk k's alphas (the sequential walk applies them one by
  // one). Run inside the region by whichever thread finishes the item's last chunk (chunks_left):
  // the order, and so every bit, is the same whatever thread that is.
  std::vector<int64_t> split_of(chunks.size());
  std::unique_ptr<std::atomic<int64_t>[]> chunks_left(new std::atomic<int64_t>[split_items.size() + 1]);
  for (size_t x = 0; x < split_items.size(); ++x) {
    const int64_t first = chunk_begin[x];
    const int64_t last = x + 1 < split_items.size() ? chunk_begin[x + 1] : static_cast<int64_t>(chunks.size());
    for (int64_t y = first; y < last; ++y) split_of[y] = static_cast<int64_t>(x);
    chunks_left[x].store(last - first, std::memory_order_relaxed);
  }
  auto merge = [&](size_t x) {
    const Item& it = split_items[x];
    const int64_t R = (it.t1 - it.t0) * group;
    const int64_t first = chunk_begin[x];
    const int64_t last = x + 1 < split_items.size() ? chunk_begin[x + 1] : static_cast<int64_t>(chunks.size());
    Partial acc = parts[first];
    for (int64_t y = first + 1; y < last; ++y) {
      const Partial& p = parts[y];
      for (int64_t r = 0; r < R; ++r) {
        const float a = p.prod[r];
        acc.l[r] = acc.l[r] * a + p.l[r];
        for (int64_t d = 0; d < dim; ++d) acc.o[r * dim + d] = acc.o[r * dim + d] * a + p.o[r * dim + d];
      }
      acc.m = p.m;
    }
    std::vector<float> logl(R);
    finish(c, it, acc.m.data(), acc.l.data(), acc.o.data(), logl.data());
  };
  run_items(static_cast<int64_t>(work.size()), [&](int64_t i, Scratch& sc) {
    const Work wk = work[i];
    if (wk.kind == 0) {
      predecode(wk.idx, sc);
      return;
    }
    if (wk.kind == 1) {
      const Item& ch = chunks[wk.idx];
      // Marked on every exit, 2 if it threw: its pass 2 must not wait for it forever.
      struct Mark {
        std::atomic<int>& done;
        int value = 2;
        ~Mark() { done.store(value, std::memory_order_release); }
      } mark{max_done[wk.idx]};
      const int64_t R = (ch.t1 - ch.t0) * group;
      sc.ensure(R, dim, block_n);
      load_q(c, ch, sc);
      wait_predecoded(ch);
      cmax[wk.idx].assign(R, kNegInf);
      chunk_max(c, ch, sc, cmax[wk.idx].data(), store_of(ch));
      mark.value = 1;
      return;
    }
    const Item& it = wk.kind == 2 ? whole[wk.idx] : chunks[wk.idx];
    const int64_t R = (it.t1 - it.t0) * group;
    sc.ensure(R, dim, block_n);
    load_q(c, it, sc);
    wait_predecoded(it);
    float* m = sc.m.get();
    for (int64_t r = 0; r < R; ++r) m[r] = kNegInf;
    if (it.slot >= 0) {
      // The earlier chunks' maxima, and the chunk's own pass 1 (the scores it stored).
      for (int64_t x = it.first; x <= it.slot; ++x) {
        for (int spins = 0; !max_done[x].load(std::memory_order_acquire); ++spins) {
          if (spins < 64) {
            cpu_relax();
          } else {
            std::this_thread::yield();  // under load the thread we wait for may need this core
          }
        }
        TORCH_CHECK(max_done[x].load(std::memory_order_acquire) == 1, "qfa native attention: an earlier chunk failed");
        if (x < it.slot)
          for (int64_t r = 0; r < R; ++r) m[r] = max_nan(m[r], cmax[x][r]);
      }
    }
    walk(c, it, sc, store_of(it));
    if (it.slot < 0) {
      finish(c, it, m, sc.l.get(), sc.o.get(), sc.alpha.get());
    } else {
      Partial& p = parts[it.slot];
      p.m.assign(m, m + R); p.l.assign(sc.l.get(), sc.l.get() + R);
      p.prod.assign(sc.prod.get(), sc.prod.get() + R); p.o.assign(sc.o.get(), sc.o.get() + R * dim);
      const int64_t x = split_of[it.slot];
      if (chunks_left[x].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(static_cast<size_t>(x));
    }
  });
}

// The kernel's decoder on its own, for the tests: fp32 values of a 1-D uint8 tensor of codes, read
// from byte ``offset`` on (the SIMD body and the scalar tail both run), and whether all are finite.
std::tuple<at::Tensor, bool> decode_codes(const at::Tensor& codes, const at::Tensor& decode_table, bool simd) {
  TORCH_CHECK(codes.dtype() == at::kByte && codes.dim() == 1 && codes.is_contiguous(), "codes: contiguous 1-D uint8");
  TORCH_CHECK(decode_table.dtype() == at::kFloat && decode_table.numel() == 256 && decode_table.is_contiguous());
  Decoder dc;
  dc.init(decode_table.data_ptr<float>());
  dc.simd = dc.simd && simd;
  at::Tensor out = at::empty({codes.numel()}, at::kFloat);
  const bool finite = dc.decode(codes.data_ptr<uint8_t>(), 1, out.data_ptr<float>(), codes.numel());
  return {out, finite};
}

// The kernel's HiF8 rounding of P on its own, for the tests: a rounded copy of a 1-D fp32 tensor
// (the 8-lane body and the scalar tail, or the scalar rule alone).
at::Tensor round_p(const at::Tensor& x, std::vector<int64_t> round_consts, bool simd) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 1, "x: 1-D fp32");
  const RoundConsts rc = round_consts_of(round_consts);
  at::Tensor out = x.contiguous().clone();
  round_row(out.data_ptr<float>(), out.numel(), rc, simd);
  return out;
}

// The team of the last region a call ran, and how many threads entered it (tests).
std::tuple<std::string, int64_t> last_region() {
  static const char* names[] = {"caller", "own", "omp"};
  return {names[last_team.load()], last_team.load() == 2 ? last_entered.load() : -1};
}

// The kernels the last call's blocks ran, by name (the bench's ISA column; tests).
std::vector<std::string> last_paths_names() {
  const int bits = last_paths.load();
  std::vector<std::string> names;
  if (bits & kPathBf16) names.push_back("AVX512_BF16");
  if (bits & kPathAvx2) names.push_back("AVX2");
  if (bits & kPathScalar) names.push_back("scalar");
  return names;
}

// How many parallel regions the last call ran (tests: one, whatever the batch holds).
int64_t last_regions() { return regions.load(); }

// Whether this build has the bf16 dot-product kernels.
bool has_bf16_dot() {
#ifdef QFA_BF16_DOT
  return true;
#else
  return false;
#endif
}

// ---- the CPU's peak, measured: independent FMA (or bf16 dot) chains in registers ---------------
// Twelve accumulators per thread (more than latency x throughput on the CPUs here), on `threads`
// threads at once, each for about `seconds` of its own CPU time; returns the sum of the threads'
// rates, each its FLOPs over its CPU time (an FMA is 2 FLOP, a bf16 dot step 4 per lane), so
// another process time-sharing the cores does not lower it (wall time would: the bench's first
// tables showed rows "above" a peak measured beside a busy process). Kinds: peak_kinds().
inline double thread_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

template <typename Step>
double time_chains(int64_t threads, double seconds, double flop_per_step, const Step& step) {
  std::vector<double> rates(threads, 0.0);
  std::vector<std::thread> team;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::duration<double>(20 * seconds);
  for (int64_t t = 0; t < threads; ++t) {
    team.emplace_back([&, t] {
      step();  // warm up (clocks, caches)
      const double t0 = thread_cpu_seconds();
      int64_t n = 0;
      double used = 0;
      do {
        n += step();
        used = thread_cpu_seconds() - t0;
      } while (used < seconds && std::chrono::steady_clock::now() < give_up);
      rates[t] = double(n) * flop_per_step / used / 1e9;
    });
  }
  for (auto& t : team) t.join();
  double sum = 0;
  for (double r : rates) sum += r;
  return sum;
}

static thread_local volatile float peak_sink = 0.f;

#define QFA_R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
constexpr int64_t kPeakInner = 1 << 16;

std::vector<std::string> peak_kinds() {
  std::vector<std::string> kinds;
#ifdef QFA_SIMD
  kinds.push_back("fp32_avx2");
#endif
#ifdef CPU_CAPABILITY_AVX512
  kinds.push_back("fp32_avx512");
#endif
#ifdef QFA_BF16_DOT
  kinds.push_back("bf16_dot");
#endif
  return kinds;
}

double peak_gflops(const std::string& kind, int64_t threads, double seconds) {
  TORCH_CHECK(threads >= 1 && seconds > 0, "peak_gflops: threads >= 1 and seconds > 0");
#ifdef QFA_SIMD
  if (kind == "fp32_avx2") {
    return time_chains(threads, seconds, 12.0 * 8 * 2 * kPeakInner, [] {
#define QFA_D(i) __m256 a##i = _mm256_set1_ps(0.001f * i);
      QFA_R12(QFA_D)
      const __m256 m = _mm256_set1_ps(0.999999f), x = _mm256_set1_ps(1e-7f);
      for (int64_t n = 0; n < kPeakInner; ++n) {
#define QFA_F(i) a##i = _mm256_fmadd_ps(a##i, m, x);
        QFA_R12(QFA_F)
      }
      __m256 sum = _mm256_setzero_ps();
#define QFA_S(i) sum = _mm256_add_ps(sum, a##i);
      QFA_R12(QFA_S)
      alignas(32) float o[8];
      _mm256_store_ps(o, sum);
      peak_sink = o[0];  // keeps the chains live
      return int64_t(1);
    });
  }
#endif
#ifdef CPU_CAPABILITY_AVX512
  if (kind == "fp32_avx512") {
    return time_chains(threads, seconds, 12.0 * 16 * 2 * kPeakInner, [] {
#define QFA_D5(i) __m512 a##i = _mm512_set1_ps(0.001f * i);
      QFA_R12(QFA_D5)
      const __m512 m = _mm512_set1_ps(0.999999f), x = _mm512_set1_ps(1e-7f);
      for (int64_t n = 0; n < kPeakInner; ++n) {
#define QFA_F5(i) a##i = _mm512_fmadd_ps(a##i, m, x);
        QFA_R12(QFA_F5)
      }
      __m512 sum = _mm512_setzero_ps();
#define QFA_S5(i) sum = _mm512_add_ps(sum, a##i);
      QFA_R12(QFA_S5)
      peak_sink = _mm512_reduce_add_ps(sum);
      return int64_t(1);
    });
  }
#endif
#ifdef QFA_BF16_DOT
  if (kind == "bf16_dot") {
    return time_chains(threads, seconds, 12.0 * 32 * 2 * kPeakInner, [] {
#define QFA_DB(i) __m512 a##i = _mm512_setzero_ps();
      QFA_R12(QFA_DB)
      const __m512bh x = as_bh(_mm512_set1_epi16(0x3F80)), y = as_bh(_mm512_set1_epi16(0x3400));
      for (int64_t n = 0; n < kPeakInner; ++n) {
#define QFA_FB(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
        QFA_R12(QFA_FB)
      }
      __m512 sum = _mm512_setzero_ps();
      QFA_R12(QFA_S5)
      peak_sink = _mm512_reduce_add_ps(sum);
      return int64_t(1);
    });
  }
#endif
  TORCH_CHECK(false, "peak_gflops: kind must be one of this build's peak_kinds(), got '", kind, "'");
}

// Whether the SIMD decoder runs for this table in this build.
bool simd_decoder(const at::Tensor& decode_table) {
  TORCH_CHECK(decode_table.dtype() == at::kFloat && decode_table.numel() == 256 && decode_table.is_contiguous());
  Decoder dc;
  dc.init(decode_table.data_ptr<float>());
  return dc.simd;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_codes", &decode_codes, "HiF8 codes to fp32 with the kernel's decoder (tests)");
  m.def("round_p", &round_p, "HiF8 rounding of P with the kernel's code (tests)");
  m.def("simd_decoder", &simd_decoder, "whether the SIMD decoder runs for this table (tests)");
  m.def("last_region", &last_region, "the last region's team and the threads that entered it (tests)");
  m.def("last_paths", &last_paths_names, "the kernels the last call's blocks ran (bench, tests)");
  m.def("last_regions", &last_regions, "how many parallel regions the last call ran (tests)");
  m.def("has_bf16_dot", &has_bf16_dot, "whether this build has the bf16 dot-product kernels");
  m.def("peak_kinds", &peak_kinds, "the kinds peak_gflops measures in this build");
  m.def("peak_gflops", &peak_gflops, "GFLOP/s of independent FMA / bf16 dot chains on threads at once");
  m.def("forward", &forward, "quant_flash_attn torch backend on CPU (see qfa/attention/cpu_kernel.py)");
}
