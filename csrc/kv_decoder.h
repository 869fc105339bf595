// HiF8 (and E4M3) codes to values: the Decoder (the 256-entry table, and on AVX2 / AVX-512 builds its affine
// vpshufb rule, fitted to that table at init; to fp32 or to bf16 patterns), where K and V codes lie
// (KvSrc: strided, or paged through a block table; read in place), and decode_rows, which decodes
// a run of keys with prefetching. Nothing here knows a call or an item: the walk, prefill's
// pre-decode, the Q tile's load and the tests' decode_codes all decode through it.
//
// Only cpu_attention.cpp includes this header: the kernel is one translation unit, and the
// anonymous namespace gives everything here the internal linkage it had when the kernel was one
// file (nothing exported beside the entry points, the optimiser free to inline and drop as before).

#pragma once

#include "kernel_config.h"
#include "scale_row_memo.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace {

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

// Keys whose codes the decoders ask for ahead of their decode. A decode call reads its K and V
// once, cache-cold in a model (each layer's cache was last read a token ago): 8 keys (1 KiB of
// codes) ahead left the HiF8 decode kernel (B = 1, Skv = 4096, Zen 5) at 140 us after a cache
// flush against 86 warm; 64 ahead took 115-120 (32: 121, 128: 116-120, 256: 124-164).
constexpr int64_t kAhead = 64;

#ifdef QFA_WIDE
struct Decoder;
#define QFA_VBMI_FN __attribute__((target("avx512vbmi,avx512bw,avx512f")))
QFA_VBMI_FN int64_t decode_f32_vbmi(const Decoder& dc, const uint8_t* p, float* d, int64_t n, bool& bad);
QFA_VBMI_FN int64_t decode_bf16_vbmi(const Decoder& dc, const uint8_t* p, uint16_t* d, int64_t n, bool& bad);
QFA_VBMI_FN bool decode_rows_bf16_vbmi(const Decoder& dc, const uint8_t* p, int64_t stride, int64_t rows,
                                       int64_t ahead, int64_t dim, uint16_t* d);
QFA_VBMI_FN bool scaled_rows_bf16_vbmi(const Decoder& dc, const uint8_t* const* rows, int64_t n, int64_t dim,
                                       const int16_t* vstep, const int16_t* kstep, const uint32_t* knan,
                                       uint16_t* out);
#endif

struct Decoder {
  // 2^8: an E4M3 value over the half e4m3_lowered makes of its code (see there).
  static constexpr float kE4m3Lift = 256.0f;
  float table[256];
  bool simd = false;
  bool e4m3 = false;  // the codes are E4M3 (quant_modes 1 and 6), not HiF8
#ifdef QFA_SIMD
  __m256i xor_t, mul_t, base_t;  // X, M and B by H, repeated in both 128-bit lanes
  __m256i den_hi, den_lo;        // E4M3: the bf16 bytes of the subnormal magnitudes 0 .. 7
#endif
#ifdef QFA_WIDE
  // AVX-512 builds: the table itself as 128 bf16 magnitude words in four registers, looked up 32
  // codes at a time (two vpermt2w and a blend), so the values are the table's by construction
  // (init_wide checks the sign bit and the low halves). Codes whose value is not finite are
  // flagged from the looked-up word; exc is a code the lookup decodes finite where the table does
  // not (HiF8's 0x80, NaN beside the sign-magnitude -0), flagged by comparison; -1 if none.
  __m512i mag[4];
  int exc = -1;
  bool wide = false;
  // CPUs with AVX512_VBMI (Ice Lake and Zen 4 on): the same table as two 128-entry byte tables
  // (the words' high bytes, sign cleared, and low bytes), one vpermt2b each for 64 codes; the
  // functions that use them are compiled for VBMI alone (vbmi_decode.h's), chosen at run time
  // (QFA_VBMI=0 keeps the vpermt2w lookups, for the tests).
  __m512i hb[2], lb[2];
  bool vbmi = false;
  // The exponent fields of the table's finite words: the largest, and the smallest of a nonzero
  // one (MXFP8's exponent moves stay exact within bounds derived from them; see attention_walk.h).
  int max_field = 0, min_field = 0;
#endif

  // Codes the affine rule leaves to the table.
  static bool special(int m) { return m == 0 || m == 0x6F; }
  static bool nonfinite(int code) { return code == 0x80 || (code & 0x7F) == 0x6F; }

  void init(const float* t, bool e4m3_codes = false) {
    std::memcpy(table, t, sizeof(table));
    e4m3 = e4m3_codes;
#ifdef QFA_WIDE
    init_wide();
#endif
    if (e4m3) {
      init_e4m3();
      return;
    }
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

  // E4M3 (quant_modes 1 and 6): sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7F / 0xFF
  // NaN, no Inf. A normal magnitude m (exponent field > 0) is the bf16 magnitude (m << 4) +
  // 0x3C00 (exponent rebiased by 120, mantissa in place); the 7 subnormals and zero are looked up
  // (vpshufb) in bytes taken from the table. The rule, and the fp32 route through fp16
  // (e4m3_lowered), are then run on all 256 codes and checked against the table, NaN codes
  // flagged, so they are the table's, as the HiF8 fit is.
  void init_e4m3() {
    uint32_t bits[256];
    std::memcpy(bits, table, sizeof(bits));
    bool ok = true;
    for (int x = 0; x < 256; ++x) {
      ok = ok && (bits[x] & 0xFFFFu) == 0;
      ok = ok && std::isfinite(table[x]) == ((x & 0x7F) != 0x7F);
    }
    simd = false;
#ifdef QFA_SIMD
    if (!ok) return;
    alignas(32) uint8_t hi[32], lo[32];
    for (int x = 0; x < 32; ++x) {
      hi[x] = static_cast<uint8_t>(bits[x % 8] >> 24);
      lo[x] = static_cast<uint8_t>(bits[x % 8] >> 16);
    }
    den_hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi));
    den_lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo));
    uint8_t codes[256];
    for (int x = 0; x < 256; ++x) codes[x] = static_cast<uint8_t>(x);
    for (int x0 = 0; x0 < 256 && ok; x0 += 32) {
      alignas(32) uint16_t got[32];
      alignas(32) uint8_t bad[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(bad), decode32_bf16<true>(codes + x0, got));
      alignas(32) float wide[32];
      alignas(32) uint8_t bad_wide[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(bad_wide), decode32<true>(codes + x0, wide));
      for (int i = 0; i < 32; ++i) {
        const int x = x0 + i;
        ok = ok && (bad[i] != 0) == !std::isfinite(table[x]) && (bad_wide[i] != 0) == (bad[i] != 0);
        ok = ok && (bad[i] != 0 || got[i] == static_cast<uint16_t>(bits[x] >> 16));
        ok = ok && (bad[i] != 0 || std::memcmp(&wide[i], &table[x], 4) == 0);
      }
    }
    simd = ok;
#else
    (void)ok;
#endif
  }

#ifdef QFA_SIMD
  // words32 for E4M3 codes (same lane order and mask).
  inline __m256i words32_e4m3(const uint8_t* p, __m256i& w0, __m256i& w1) const {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i m = _mm256_and_si256(c, _mm256_set1_epi8(0x7F));
    const __m256i sub = _mm256_cmpgt_epi8(_mm256_set1_epi8(8), m);  // exponent field 0
    // (16-bit shifts, masked back to bytes)
    const __m256i hi_n = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(m, 4), _mm256_set1_epi8(0x0F)),
                                         _mm256_set1_epi8(0x3C));
    const __m256i lo_n = _mm256_and_si256(_mm256_slli_epi16(m, 4), _mm256_set1_epi8(static_cast<char>(0xF0)));
    const __m256i hi = _mm256_or_si256(_mm256_blendv_epi8(hi_n, _mm256_shuffle_epi8(den_hi, m), sub),
                                       _mm256_and_si256(c, _mm256_set1_epi8(static_cast<char>(0x80))));
    const __m256i lo = _mm256_blendv_epi8(lo_n, _mm256_shuffle_epi8(den_lo, m), sub);
    w0 = _mm256_unpacklo_epi8(lo, hi);
    w1 = _mm256_unpackhi_epi8(lo, hi);
    return _mm256_cmpeq_epi8(m, _mm256_set1_epi8(0x7F));
  }

  template <bool E4M3>
  inline __m256i words(const uint8_t* p, __m256i& w0, __m256i& w1) const {
    if constexpr (E4M3) {
      return words32_e4m3(p, w0, w1);
    } else {
      return words32(p, w0, w1);
    }
  }
#endif

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

  // E4M3 codes to fp32 through fp16 (F16C): a code's byte sign-extended to 16 bits and shifted
  // left by 7 holds its mantissa in fp16's mantissa field, its exponent field in the low 4 bits of
  // fp16's and its sign in bit 15 (bit 14, a copy of the sign, is cleared). That half is 2^-8
  // times the code's value (exponent bias 15 against 7; E4M3's subnormals are fp16 subnormals,
  // which vcvtph2ps converts exactly), so the caller's factor carries the 2^8: kE4m3Lift. Four
  // instructions a vector fewer than the bf16 patterns' rule and no lane permutes: MXFP8's K and V
  // decode was a third of the few-row kernels' time. f[i] holds codes 8i .. 8i+7; NaN codes (0x7F,
  // 0xFF) come out finite and are flagged in the returned mask.
  inline __m256i e4m3_lowered(const uint8_t* p, __m256* f) const {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i keep = _mm256_set1_epi16(static_cast<short>(0xBF80));
    const __m256i h0 = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(c)), 7), keep);
    const __m256i h1 = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(c, 1)), 7), keep);
    f[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h0));
    f[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h0, 1));
    f[2] = _mm256_cvtph_ps(_mm256_castsi256_si128(h1));
    f[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(h1, 1));
    const __m256i m7f = _mm256_set1_epi8(0x7F);
    return _mm256_cmpeq_epi8(_mm256_and_si256(c, m7f), m7f);
  }

  // 32 contiguous codes to fp32 (HiF8: the bf16 patterns widened); the mask as words32's.
  template <bool E4M3 = false>
  inline __m256i decode32(const uint8_t* p, float* d) const {
    if constexpr (E4M3) {
      __m256 f[4];
      const __m256i bad = e4m3_lowered(p, f);
      const __m256 lift = _mm256_set1_ps(kE4m3Lift);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(d + 8 * i, _mm256_mul_ps(f[i], lift));
      return bad;
    }
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

  // 32 E4M3 codes to fp32, value i times lane i % 8 of lifted[i / 8]: MXFP8's scaled rows (a power
  // of two times each value) in one pass over the codes. lifted is the scales times kE4m3Lift
  // (exact, and finite for every scale the plan allows: 2^119 * 2^8 < 2^128; decode_rows_scaled
  // takes the table's route for a row with a larger one).
  inline __m256i decode32_e4m3_scaled(const uint8_t* p, float* d, const __m256* lifted) const {
    __m256 f[4];
    const __m256i bad = e4m3_lowered(p, f);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(d + 8 * i, _mm256_mul_ps(f[i], lifted[i]));
    return bad;
  }

  // 32 contiguous codes to bf16; the mask as words32's.
  template <bool E4M3 = false>
  inline __m256i decode32_bf16(const uint8_t* p, uint16_t* d) const {
    __m256i w0, w1;
    const __m256i bad = words<E4M3>(p, w0, w1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), _mm256_permute2x128_si256(w0, w1, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 16), _mm256_permute2x128_si256(w0, w1, 0x31));
    return bad;
  }
#endif

#ifdef QFA_WIDE
  void init_wide() {
    uint32_t bits[256];
    std::memcpy(bits, table, sizeof(bits));
    alignas(64) uint16_t m[128];
    for (int x = 0; x < 128; ++x) m[x] = static_cast<uint16_t>((bits[x] >> 16) & 0x7FFF);
    bool ok = true;
    exc = -1;
    for (int x = 0; x < 256 && ok; ++x) {
      const uint16_t looked = static_cast<uint16_t>(m[x & 0x7F] | ((x & 0x80) << 8));
      const bool flagged = (looked & 0x7F80) == 0x7F80;
      const bool finite = std::isfinite(table[x]);
      ok = (bits[x] & 0xFFFFu) == 0;
      if (flagged && !finite) continue;  // the table decodes it
      if (!flagged && finite && looked == static_cast<uint16_t>(bits[x] >> 16)) continue;
      ok = ok && !flagged && !finite && exc < 0;
      exc = x;
    }
    max_field = 0;
    min_field = 255;
    bool top_free = true;  // no finite word with a high byte of 0x7F (VBMI flags that byte)
    for (int x = 0; x < 128; ++x) {
      const int field = m[x] >> 7;
      if (field == 0xFF) continue;
      max_field = std::max(max_field, field);
      if (m[x]) min_field = std::min(min_field, field);
      top_free = top_free && (m[x] >> 8) != 0x7F;
    }
    wide = ok;
    for (int i = 0; i < 4; ++i) mag[i] = _mm512_load_si512(m + 32 * i);
    alignas(64) uint8_t hi[128], lo[128];
    for (int x = 0; x < 128; ++x) {
      hi[x] = static_cast<uint8_t>(m[x] >> 8);
      lo[x] = static_cast<uint8_t>(m[x]);
    }
    for (int i = 0; i < 2; ++i) {
      hb[i] = _mm512_load_si512(hi + 64 * i);
      lb[i] = _mm512_load_si512(lo + 64 * i);
    }
    const char* off = std::getenv("QFA_VBMI");
    vbmi = wide && top_free && __builtin_cpu_supports("avx512vbmi") && !(off && std::strcmp(off, "0") == 0);
  }

  // 32 contiguous codes to their bf16 patterns: in order, or (Spread) with codes 4L .. 4L + 3
  // and 16 + 4L .. 19 + 4L in 128-bit lane L, which vpunpck{l,h}wd against zero turn into the
  // fp32 values of codes 0 .. 15 and 16 .. 31 (one vpermd on the codes: cheaper than widening).
  // The lanes that the table must decode are tracked in two accumulators, no mask moves in the
  // loop: big (the largest exponent field seen; 0x7F80 means a value that is not finite) and
  // apart (the smallest xor of a code with exc, 0 where a code is exc; exc_v is 0xFFFF without one).
  template <bool Spread>
  inline __m512i words_wide(const uint8_t* p, __m512i& big, __m512i& apart, __m512i exc_v) const {
    __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (Spread) bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const __m512i c = _mm512_cvtepu8_epi16(bytes);
    const __m512i m = _mm512_and_si512(c, _mm512_set1_epi16(0x7F));
    const __mmask32 upper = _mm512_test_epi16_mask(m, _mm512_set1_epi16(64));
    __m512i w = _mm512_mask_blend_epi16(upper, _mm512_permutex2var_epi16(mag[0], m, mag[1]),
                                        _mm512_permutex2var_epi16(mag[2], m, mag[3]));
    // w | (c << 8 & 0x8000): the sign
    w = _mm512_ternarylogic_epi32(w, _mm512_slli_epi16(c, 8), _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);
    big = _mm512_max_epu16(big, _mm512_and_si512(w, _mm512_set1_epi16(0x7F80)));
    apart = _mm512_min_epu16(apart, _mm512_xor_si512(c, exc_v));
    return w;
  }
  inline __m512i exc_word() const { return _mm512_set1_epi16(static_cast<short>(exc >= 0 ? exc : 0xFFFF)); }
  static bool flagged(__m512i big, __m512i apart) {
    return _mm512_cmpeq_epi16_mask(big, _mm512_set1_epi16(0x7F80)) != 0 ||
           _mm512_cmpeq_epi16_mask(apart, _mm512_setzero_si512()) != 0;
  }

  // 16 E4M3 codes as e4m3_lowered makes them, on 16 lanes: 2^-8 times their values; sets bad's
  // lanes of the NaN codes.
  static inline __m512 e4m3_lowered16(const uint8_t* p, __mmask16& bad) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(c), 7),
                                       _mm256_set1_epi16(static_cast<short>(0xBF80)));
    const __m128i m7f = _mm_set1_epi8(0x7F);
    bad |= _mm_cmpeq_epi8_mask(_mm_and_si128(c, m7f), m7f);
    return _mm512_cvtph_ps(h);
  }

  // The codes [0, n - n % 32) to fp32 (HiF8: the words widened; E4M3: the fp16 route, 16 codes at a
  // time); returns the count done, and whether a code's value is not finite (then wrong here).
  inline int64_t decode_wide(const uint8_t* p, float* d, int64_t n, bool& bad_any) const {
    int64_t x = 0;
    if (e4m3) {
      __mmask16 bad = 0;
      const __m512 lift = _mm512_set1_ps(kE4m3Lift);
      for (; x + 16 <= n; x += 16) _mm512_storeu_ps(d + x, _mm512_mul_ps(e4m3_lowered16(p + x, bad), lift));
      bad_any = bad != 0;
      return x;
    }
    const __m512i exc_v = exc_word(), z = _mm512_setzero_si512();
    __m512i big = z, apart = _mm512_set1_epi16(-1);
    for (; x + 32 <= n; x += 32) {
      const __m512i w = words_wide<true>(p + x, big, apart, exc_v);
      _mm512_storeu_si512(d + x, _mm512_unpacklo_epi16(z, w));
      _mm512_storeu_si512(d + x + 16, _mm512_unpackhi_epi16(z, w));
    }
    bad_any = flagged(big, apart);
    return x;
  }

  // The codes [0, n - n % 32) to bf16 patterns; as decode_wide.
  inline int64_t decode_bf16_wide(const uint8_t* p, uint16_t* d, int64_t n, bool& bad_any) const {
    const __m512i exc_v = exc_word();
    __m512i big = _mm512_setzero_si512(), apart = _mm512_set1_epi16(-1);
    int64_t x = 0;
    for (; x + 32 <= n; x += 32) _mm512_storeu_si512(d + x, words_wide<false>(p + x, big, apart, exc_v));
    bad_any = flagged(big, apart);
    return x;
  }

  // 32 E4M3 codes to fp32, value i times lane i % 16 of lifted[i / 16] (decode32_e4m3_scaled's
  // 16-lane form).
  inline __mmask32 decode32_e4m3_scaled(const uint8_t* p, float* d, const __m512* lifted) const {
    __mmask16 bad0 = 0, bad1 = 0;
    _mm512_storeu_ps(d, _mm512_mul_ps(e4m3_lowered16(p, bad0), lifted[0]));
    _mm512_storeu_ps(d + 16, _mm512_mul_ps(e4m3_lowered16(p + 16, bad1), lifted[1]));
    return static_cast<__mmask32>(bad0 | (uint32_t(bad1) << 16));
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
#ifdef QFA_WIDE
    if (st == 1 && wide) {
      bool bad;
      x = vbmi ? decode_bf16_vbmi(*this, p, d, n, bad) : decode_bf16_wide(p, d, n, bad);
      if (bad) {
        for (int64_t i = 0; i < x; ++i) d[i] = bf16_of(p[i]);
        finite = false;
      }
    }
#elif defined(QFA_SIMD)
    if (st == 1 && simd) {
      __m256i bad = _mm256_setzero_si256();
      if (e4m3) {
        for (; x + 32 <= n; x += 32) bad = _mm256_or_si256(bad, decode32_bf16<true>(p + x, d + x));
      } else {
        for (; x + 32 <= n; x += 32) bad = _mm256_or_si256(bad, decode32_bf16(p + x, d + x));
      }
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
#ifdef QFA_WIDE
      if (simd && (wide || e4m3)) {
        bool bad;
        x = vbmi && !e4m3 ? decode_f32_vbmi(*this, p, d, n, bad) : decode_wide(p, d, n, bad);
        if (bad) {
          for (int64_t i = 0; i < x; ++i) d[i] = table[p[i]];
          finite = false;
        }
      }
#elif defined(QFA_SIMD)
      if (simd) {
        __m256i bad = _mm256_setzero_si256();
        if (e4m3) {
          for (; x + 32 <= n; x += 32) bad = _mm256_or_si256(bad, decode32<true>(p + x, d + x));
        } else {
          for (; x + 32 <= n; x += 32) bad = _mm256_or_si256(bad, decode32(p + x, d + x));
        }
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

#ifdef QFA_WIDE
// ---- the VBMI lookups -------------------------------------------------------------------------
// Compiled for AVX512_VBMI on their own (target attribute: the build's flags stay torch's AVX512
// capability, which has no VBMI), run only where Decoder::vbmi says the CPU has it. 64 codes a
// step: two vpermt2b give the bf16 words' high and low bytes (index bits 0-6: the magnitude),
// the sign goes into the high byte, and vpunpck{l,h}bw make words, 8 codes of each 16 per
// 128-bit lane. A high byte of 0x7F (0x7F80 and up: Inf, NaN) flags the range for the table, as
// does exc.
// MXFP8: bf16 words times 2^(step / 128) per lane, by moving the exponent fields of the normal
// words (zero and non-finite words stay as they are). Exact where every result's field stays in
// 1 .. 254: the callers check the scales against bounds derived from the table (cpu_attention.cpp).
inline __m512i move_exponents(__m512i w, __m512i step) {
  const __m512i field = _mm512_set1_epi16(0x7F80);
  const __m512i e = _mm512_and_si512(w, field);
  const __mmask32 normal = _mm512_test_epi16_mask(e, e) & _mm512_cmpneq_epi16_mask(e, field);
  return _mm512_mask_add_epi16(w, normal, w, step);
}

struct VbmiFlags {
  __m512i big = _mm512_setzero_si512();  // the largest high byte seen, sign cleared
  __m512i apart = _mm512_set1_epi8(-1);  // the smallest code ^ exc seen (0: exc met)
};

// The lookup tables in registers for the length of a loop: read through the Decoder, they would
// be loaded again after every store of words (a store may alias them).
struct VbmiTables {
  __m512i hb0, hb1, lb0, lb1, exc_v;
  bool exc;
};

QFA_VBMI_FN inline VbmiTables vbmi_tables(const Decoder& dc) {
  return {dc.hb[0], dc.hb[1], dc.lb[0], dc.lb[1], _mm512_set1_epi8(static_cast<char>(dc.exc)), dc.exc >= 0};
}

QFA_VBMI_FN inline void bytes64_vbmi(const VbmiTables& t, __m512i c, __m512i& lo, __m512i& hi, VbmiFlags& f) {
  const __m512i h = _mm512_permutex2var_epi8(t.hb0, c, t.hb1);
  lo = _mm512_permutex2var_epi8(t.lb0, c, t.lb1);
  f.big = _mm512_max_epu8(f.big, h);
  if (t.exc) f.apart = _mm512_min_epu8(f.apart, _mm512_xor_si512(c, t.exc_v));
  hi = _mm512_ternarylogic_epi32(h, c, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // h | (c & 0x80)
}

QFA_VBMI_FN inline bool flagged_vbmi(const VbmiFlags& f) {
  return _mm512_cmpeq_epi8_mask(f.big, _mm512_set1_epi8(0x7F)) != 0 ||
         _mm512_cmpeq_epi8_mask(f.apart, _mm512_setzero_si512()) != 0;
}

// The codes [0, n - n % 64) to fp32; returns the count done, and in bad whether the table must
// decode them again. The codes' dwords are permuted first (a 4 x 4 transpose of 4-code groups)
// so that the unpacks against zero leave codes 0-15, 16-31, 32-47 and 48-63 in order.
QFA_VBMI_FN int64_t decode_f32_vbmi(const Decoder& dc, const uint8_t* p, float* d, int64_t n, bool& bad) {
  const __m512i spread = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i z = _mm512_setzero_si512();
  const VbmiTables t = vbmi_tables(dc);
  VbmiFlags f;
  int64_t x = 0;
  for (; x + 64 <= n; x += 64) {
    __m512i lo, hi;
    bytes64_vbmi(t, _mm512_permutexvar_epi32(spread, _mm512_loadu_si512(p + x)), lo, hi, f);
    const __m512i a = _mm512_unpacklo_epi8(lo, hi), b = _mm512_unpackhi_epi8(lo, hi);
    _mm512_storeu_si512(d + x, _mm512_unpacklo_epi16(z, a));
    _mm512_storeu_si512(d + x + 16, _mm512_unpackhi_epi16(z, a));
    _mm512_storeu_si512(d + x + 32, _mm512_unpacklo_epi16(z, b));
    _mm512_storeu_si512(d + x + 48, _mm512_unpackhi_epi16(z, b));
  }
  bad = flagged_vbmi(f);
  return x;
}

// Word i of 64 codes' bf16 words in order: lane i / 16 of the unpacked words, the low (a) or
// high (b) unpack by i % 16.
alignas(64) constexpr int16_t kVbmiOrder[64] = {
    0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39, 8,  9,  10, 11, 12, 13,
    14, 15, 40, 41, 42, 43, 44, 45, 46, 47, 16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51,
    52, 53, 54, 55, 24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};

// 64 codes to bf16 words in order (n0: codes 0-31, n1: 32-63).
QFA_VBMI_FN inline void words64_vbmi(const VbmiTables& t, const uint8_t* p, __m512i& n0, __m512i& n1, VbmiFlags& f) {
  __m512i lo, hi;
  bytes64_vbmi(t, _mm512_loadu_si512(p), lo, hi, f);
  const __m512i a = _mm512_unpacklo_epi8(lo, hi), b = _mm512_unpackhi_epi8(lo, hi);
  n0 = _mm512_permutex2var_epi16(a, _mm512_load_si512(kVbmiOrder), b);
  n1 = _mm512_permutex2var_epi16(a, _mm512_load_si512(kVbmiOrder + 32), b);
}

// The codes [0, n - n % 64) to bf16 words in order; as decode_f32_vbmi.
QFA_VBMI_FN int64_t decode_bf16_vbmi(const Decoder& dc, const uint8_t* p, uint16_t* d, int64_t n, bool& bad) {
  const VbmiTables t = vbmi_tables(dc);
  VbmiFlags f;
  int64_t x = 0;
  for (; x + 64 <= n; x += 64) {
    __m512i n0, n1;
    words64_vbmi(t, p + x, n0, n1, f);
    _mm512_storeu_si512(d + x, n0);
    _mm512_storeu_si512(d + x + 32, n1);
  }
  bad = flagged_vbmi(f);
  return x;
}

// `rows` key rows of dim codes (a multiple of 64, contiguous) at p + r * stride to bf16 words at
// d + r * dim, the codes kAhead rows on prefetched while they lie within `ahead` rows of p. One
// call for a run of keys: per row, the call and its table loads cost as much as the lookups.
// Returns whether the table must decode them again (bad, as decode_bf16_vbmi).
QFA_VBMI_FN bool decode_rows_bf16_vbmi(const Decoder& dc, const uint8_t* p, int64_t stride, int64_t rows,
                                       int64_t ahead, int64_t dim, uint16_t* d) {
  const VbmiTables t = vbmi_tables(dc);
  VbmiFlags f;
  for (int64_t r = 0; r < rows; ++r, p += stride, d += dim) {
    if (r + kAhead < ahead)
      for (int64_t x = 0; x < dim; x += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * stride + x), _MM_HINT_T0);
    for (int64_t x = 0; x < dim; x += 64) {
      __m512i n0, n1;
      words64_vbmi(t, p + x, n0, n1, f);
      _mm512_storeu_si512(d + x, n0);
      _mm512_storeu_si512(d + x + 32, n1);
    }
  }
  return flagged_vbmi(f);
}

// MXFP8: n key rows (rows[j]) of dim (a multiple of 64) E4M3 codes to bf16 words times their
// scales (move_exponents) at out + j * dim: V with one step per channel, the same for every row
// (vstep), or K with one per 32 channels (kstep[j * dim / 32 + g]; knan[j]'s bit g: channels
// 32g .. 32g + 31 have a NaN scale, their words NaN). Returns whether a code is not finite (its
// word is then the table's, unscaled).
QFA_VBMI_FN bool scaled_rows_bf16_vbmi(const Decoder& dc, const uint8_t* const* rows, int64_t n, int64_t dim,
                                       const int16_t* vstep, const int16_t* kstep, const uint32_t* knan,
                                       uint16_t* out) {
  const VbmiTables t = vbmi_tables(dc);
  VbmiFlags f;
  const int64_t groups = dim / 32;
  for (int64_t j = 0; j < n; ++j, out += dim) {
    for (int64_t x = 0; x < dim; x += 64) {
      __m512i w[2];
      words64_vbmi(t, rows[j] + x, w[0], w[1], f);
      for (int h = 0; h < 2; ++h) {
        const int64_t xs = x + 32 * h;
        const __m512i step = vstep ? _mm512_load_si512(vstep + xs) : _mm512_set1_epi16(kstep[j * groups + (xs >> 5)]);
        __m512i r = move_exponents(w[h], step);
        if (!vstep && ((knan[j] >> (xs >> 5)) & 1)) r = _mm512_set1_epi16(0x7FC0);
        _mm512_storeu_si512(out + xs, r);
      }
    }
  }
  return flagged_vbmi(f);
}
#endif

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

  // MXFP8 (quant_mode 1): each key row's E8M0 scales, read in place in upstream's paired layout
  // (sbase nullptr: none). Element x of key j's row is multiplied by e8m0[s[(x / per) * el_st]],
  // s = scale_row(j): K one scale per 32 channels (per 32), V one per channel and 32 keys (per
  // 1; 64 keys to a row of pairs, pos_div 64, the pair's half at (position / 32) % 2). A power of
  // two times an E4M3 value is exact in fp32: the products are the torch path's operands.
  const uint8_t* sbase = nullptr;
  int64_t sst[3] = {0, 0, 0};  // (batch or block, head, position / pos_div) strides of the scales
  int64_t pos_div = 1, pair_st = 0, el_st = 1, per = 32;
  // log2 of pos_div, per and block_size (powers of two in mode 1): a division per key row cost
  // more than decoding the row.
  int pos_shift = 0, per_shift = 5, bs_shift = 0;
  const int64_t* sstart = nullptr;  // contiguous K/V: per batch, the scales' first position
  const float* e8m0 = nullptr;      // the 256 E8M0 values
  uint64_t call_id = 0;             // new_call_id() of the call: keys ScaleRowMemo
  inline const uint8_t* scale_row(int64_t b, int64_t h, int64_t j) const {
    int64_t blk = b, pos = sstart ? sstart[b] + j : j;
    if (table) { blk = table[b * table_stride + (j >> bs_shift)]; pos = j & (block_size - 1); }
    const uint8_t* s = sbase + blk * sst[0] + h * sst[1] + (pos >> pos_shift) * sst[2];
    return pos_shift ? s + ((pos >> 5) & 1) * pair_st : s;
  }
  // The first key after j whose scale row may differ from j's: scale_row reads a new row per
  // position (K) or per 32 positions (V's paired rows), and per block when paged.
  inline int64_t scale_run_end(int64_t b, int64_t j) const {
    const int64_t span = pos_shift ? 32 : 1;
    if (table) return std::min((j / span + 1) * span, ((j >> bs_shift) + 1) << bs_shift);
    const int64_t pos = (sstart ? sstart[b] : 0) + j;
    return j + span - pos % span;
  }
};

// A fresh id for a KvSrc of a call (never 0): each call's K and V get one each, which keys the
// thread's ScaleRowMemo.
inline uint64_t new_call_id() {
  static std::atomic<uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

// V's scale row at sp (one scale per channel), expanded into memo unless it holds it already.
inline const ScaleRowMemo& v_scale_row(const KvSrc& src, const uint8_t* sp, int64_t dim, ScaleRowMemo& memo) {
  if (memo.sp != sp || memo.call_id != src.call_id) {
    bool finite = true, liftable = true;
    int64_t x0 = 0;
#ifdef QFA_WIDE
    // 16 channels a step (the scalar loop's checks per channel were a third of the bf16 few-row
    // kernels' V decode, one row per 32 keys): the codes copied out, their values gathered from
    // the table.
    alignas(64) uint8_t code[kMaxScaledDim];
    for (int64_t x = 0; x < dim; ++x) code[x] = sp[x * src.el_st];
    const __m512 lift = _mm512_set1_ps(Decoder::kE4m3Lift), inf = _mm512_set1_ps(kInf);
    __mmask16 nan_any = 0, inf_any = 0;
    __m512i least = _mm512_set1_epi32(255), most = _mm512_setzero_si512();
    for (; x0 + 16 <= dim; x0 += 16) {
      const __m512i ci = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(code + x0)));
      const __m512 f = _mm512_i32gather_ps(ci, src.e8m0, 4);
      const __m512 lifted = _mm512_mul_ps(f, lift);
      _mm512_store_ps(memo.fs + x0, f);
      _mm512_store_ps(memo.lifted + x0, lifted);
      _mm256_store_si256(reinterpret_cast<__m256i*>(memo.step + x0),
                         _mm512_cvtepi32_epi16(_mm512_slli_epi32(_mm512_sub_epi32(ci, _mm512_set1_epi32(kE8m0Bias)),
                                                                 kBf16ExpShift)));  // e8m0_step's rule
      nan_any |= _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
      least = _mm512_min_epi32(least, ci);
      most = _mm512_mask_max_epi32(most, _mm512_cmpneq_epi32_mask(ci, _mm512_set1_epi32(255)), most, ci);
      inf_any |= _mm512_cmp_ps_mask(_mm512_abs_ps(lifted), inf, _CMP_EQ_OQ);
    }
    finite = nan_any == 0;
    liftable = inf_any == 0;
    memo.min_code = _mm512_reduce_min_epi32(least);
    memo.max_code = _mm512_reduce_max_epi32(most);
#else
    memo.min_code = 255;
    memo.max_code = 0;
#endif
    for (int64_t x = x0; x < dim; ++x) {
      const float f = src.e8m0[sp[x * src.el_st]];
      memo.step[x] = e8m0_step(sp[x * src.el_st]);
      memo.min_code = std::min<int>(memo.min_code, sp[x * src.el_st]);
      if (sp[x * src.el_st] != 0xFF) memo.max_code = std::max<int>(memo.max_code, sp[x * src.el_st]);
      memo.fs[x] = f;
      memo.lifted[x] = f * Decoder::kE4m3Lift;
      finite = finite && !std::isnan(f);
      liftable = liftable && !std::isinf(memo.lifted[x]);
    }
    memo.sp = sp;
    memo.call_id = src.call_id;
    memo.finite = finite;
    memo.liftable = liftable;
  }
  return memo;
}

#ifdef QFA_WIDE
inline __m512 load_lifted(const float* p) { return _mm512_load_ps(p); }
inline __m512 broadcast_lifted(float f) { return _mm512_set1_ps(f); }
#elif defined(QFA_SIMD)
inline __m256 load_lifted(const float* p) { return _mm256_load_ps(p); }
inline __m256 broadcast_lifted(float f) { return _mm256_set1_ps(f); }
#endif

// decode_rows for K/V with E8M0 scales (dim a multiple of the vector width and of 32, or at most
// one partial group of whole vectors): the row decoded to fp32, times its scales (expanded
// once per distinct scale row: V's cover 32 keys), to bf16 by truncation where T is (exact: the
// caller runs bf16 only where every scaled value is a normal bf16). Finite: the codes' and the
// scales' (448 x the largest scale the plan allows is finite, so no product overflows).
template <typename T>
inline bool decode_rows_scaled(const Decoder& dc, int64_t dim, const KvSrc& src, int64_t b, int64_t h,
                               int64_t start, int64_t j0, int64_t j1, T* dst, ScaleRowMemo& memo) {
  alignas(64) float row[kMaxScaledDim];
  bool scales_finite = true, finite = true;
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* p = src.row(b, h, start, j);
#ifdef QFA_SIMD
    // As decode_rows: the codes kAhead keys on in this run of keys, past j1 too (the caller's
    // next group; a prefetch never faults).
    if (src.run_after(j) >= kAhead && src.st[3] == 1) {
      const char* ahead = reinterpret_cast<const char*>(p + kAhead * src.st[2]);
      for (int64_t x = 0; x < dim; x += 64) _mm_prefetch(ahead + x, _MM_HINT_T0);
    }
#endif
    float* d;
    if constexpr (std::is_same<T, float>::value) {
      d = dst + (j - j0) * dim;
    } else {
      d = row;
    }
    const uint8_t* sp = src.scale_row(b, h, j);
#ifdef QFA_SIMD
    // One pass: each group of 32 codes decoded and multiplied by its scales (K: one scale, as
    // per is a multiple of 32; V: the channels' 32). Non-finite codes (rare) take the table.
    if (dc.simd && dc.e4m3 && src.st[3] == 1 && dim % 32 == 0 && (src.per == 1 || src.per % 32 == 0)) {
      const ScaleRowMemo* vs = nullptr;
      bool lift_ok = true;  // no scale beyond the plan's cap (a direct caller's): else the table's route
      if (src.per == 1) {
        vs = &v_scale_row(src, sp, dim, memo);
        scales_finite = scales_finite && vs->finite;
        lift_ok = vs->liftable;
      }
#ifdef QFA_WIDE
      using Lifted = __m512;
      constexpr int kLanes = 16;
      __mmask32 bad = 0;
#else
      using Lifted = __m256;
      constexpr int kLanes = 8;
      __m256i bad = _mm256_setzero_si256();
#endif
      for (int64_t x = 0; x < dim; x += 32) {
        Lifted mul[32 / kLanes];
        if (vs) {
          for (int i = 0; i < 32 / kLanes; ++i) mul[i] = load_lifted(vs->lifted + x + kLanes * i);
        } else {
          const float f = src.e8m0[sp[(x >> src.per_shift) * src.el_st]];
          scales_finite = scales_finite && !std::isnan(f);
          const float lifted = f * Decoder::kE4m3Lift;
          lift_ok = lift_ok && !std::isinf(lifted);
          for (int i = 0; i < 32 / kLanes; ++i) mul[i] = broadcast_lifted(lifted);
        }
#ifdef QFA_WIDE
        bad |= dc.decode32_e4m3_scaled(p + x, d + x, mul);
      }
      if (!lift_ok || bad) {
#else
        bad = _mm256_or_si256(bad, dc.decode32_e4m3_scaled(p + x, d + x, mul));
      }
      if (!lift_ok || !_mm256_testz_si256(bad, bad)) {
#endif
        for (int64_t x = 0; x < dim; ++x) {
          const float f = vs ? vs->fs[x] : src.e8m0[sp[(x >> src.per_shift) * src.el_st]];
          d[x] = dc.table[p[x]] * f;
          finite = finite && std::isfinite(dc.table[p[x]]);
        }
      }
      if constexpr (!std::is_same<T, float>::value) {
        const uint32_t* u = reinterpret_cast<const uint32_t*>(row);
        T* o = dst + (j - j0) * dim;
        for (int64_t x = 0; x < dim; ++x) o[x] = static_cast<T>(u[x] >> 16);
      }
      continue;
    }
#endif
    finite = dc.decode(p, src.st[3], d, dim) && finite;
    if (src.per > 1) {  // K: a few scales per row, each over a run of channels
      for (int64_t x0 = 0; x0 < dim; x0 += src.per) {
        const float f = src.e8m0[sp[(x0 >> src.per_shift) * src.el_st]];
        scales_finite = scales_finite && !std::isnan(f);
        const int64_t x1 = std::min(dim, x0 + src.per);
        const Vec vf(f);
        for (int64_t x = x0; x < x1; x += Vec::size()) (Vec::loadu(d + x) * vf).store(d + x);
      }
    } else {  // V: one scale per channel, the same row of them for 32 keys
      const ScaleRowMemo& vs = v_scale_row(src, sp, dim, memo);
      scales_finite = scales_finite && vs.finite;
      for (int64_t x = 0; x < dim; x += Vec::size()) (Vec::loadu(d + x) * Vec::loadu(vs.fs + x)).store(d + x);
    }
    if constexpr (!std::is_same<T, float>::value) {
      const uint32_t* u = reinterpret_cast<const uint32_t*>(row);
      T* o = dst + (j - j0) * dim;
      for (int64_t x = 0; x < dim; ++x) o[x] = static_cast<T>(u[x] >> 16);
    }
  }
  return finite && scales_finite;
}

// Decode keys [j0, j1) of kv head h of batch b into dst (rows x dim), fp32 or bf16 (T);
// returns whether every value is finite. memo: the thread's scale row memo (MXFP8; callers that
// decode a few keys at a time pass their Scratch's).
template <typename T>
inline bool decode_rows(const Decoder& dc, int64_t dim, const KvSrc& src, int64_t b, int64_t h, int64_t start,
                        int64_t j0, int64_t j1, T* dst, ScaleRowMemo* memo = nullptr) {
  if (src.sbase) {
    ScaleRowMemo local;
    return decode_rows_scaled(dc, dim, src, b, h, start, j0, j1, dst, memo ? *memo : local);
  }
  bool finite = true;
  for (int64_t j = j0; j < j1;) {
    const uint8_t* p = src.row(b, h, start, j);
    // Keys [j, run_end) lie at a constant stride (the rest of a page, if paged), up to kAhead past j1.
    const int64_t run_end = j + 1 + std::min<int64_t>(src.run_after(j), j1 + kAhead - j - 1);
    const int64_t end = std::min(j1, run_end);
#ifdef QFA_WIDE
    if constexpr (std::is_same<T, uint16_t>::value) {
      if (dc.vbmi && src.st[3] == 1 && dim % 64 == 0) {  // the run in one call (decode_rows_bf16_vbmi)
        uint16_t* d = dst + (j - j0) * dim;
        if (decode_rows_bf16_vbmi(dc, p, src.st[2], end - j, run_end - j, dim, d)) {
          for (int64_t r = 0; r < end - j; ++r)  // a flagged run: the table's words, as decode_bf16
            for (int64_t x = 0; x < dim; ++x) d[r * dim + x] = dc.bf16_of(p[r * src.st[2] + x]);
          finite = false;
        }
        j = end;
        continue;
      }
    }
#endif
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

}  // namespace
