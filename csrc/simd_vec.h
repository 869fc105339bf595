// Vec: the few operations of torch's at::vec::Vectorized<float> that the kernel's SIMD builds use,
// with the same semantics and the same bits (the same intrinsics, the same lane count, and
// exp / log by the same Sleef functions, which libtorch_cpu exports). A header of its own because
// torch's vector and tensor headers were half of the kernel's cold build (the AVX2 kernel's file
// compiled alone on the Zen 3 EPYC: 12.0 s with them, 5.8 s without; the headers alone 6.0 s):
// the kernel's translation unit includes no ATen header, and cpu_attention_bindings.cpp,
// compiled beside it on the other core, is where the tensors are read.
//
// The AVX2 build's Vec is torch's vec256 float (8 lanes), the AVX-512 builds' its vec512 float
// (16 lanes): the lane count fixes the order of the kernel's lane sums, so it must stay torch's
// per capability. The scalar build (no SIMD capability) keeps torch's own generic Vectorized
// (kernel_config.h), whose exp is std::exp lane by lane.
//
// Only cpu_attention.cpp includes this header (through kernel_config.h).

#pragma once

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)

#include <immintrin.h>
#include <sleef.h>

#include <cstdint>

namespace {

#if defined(CPU_CAPABILITY_AVX512)

struct Vec {
  __m512 values;
  Vec() : values(_mm512_setzero_ps()) {}  // zeros, as torch's
  Vec(__m512 v) : values(v) {}
  Vec(float v) : values(_mm512_set1_ps(v)) {}
  static constexpr int size() { return 16; }
  // The tail: lanes [0, count) read, the rest zero (torch's masked load).
  static Vec loadu(const float* p, int64_t count = size()) {
    if (count == size()) return _mm512_loadu_ps(p);
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1ULL << count) - 1), p);
  }
  void store(float* p, int64_t count = size()) const {
    if (count == size()) {
      _mm512_storeu_ps(p, values);
    } else if (count > 0) {
      _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1ULL << count) - 1), values);
    }
  }
  Vec exp() const { return Sleef_expf16_u10(values); }
  Vec log() const { return Sleef_logf16_u10(values); }
};

inline Vec operator+(const Vec& a, const Vec& b) { return _mm512_add_ps(a.values, b.values); }
inline Vec operator-(const Vec& a, const Vec& b) { return _mm512_sub_ps(a.values, b.values); }
inline Vec operator*(const Vec& a, const Vec& b) { return _mm512_mul_ps(a.values, b.values); }

#else  // AVX2

struct Vec {
  __m256 values;
  Vec() : values(_mm256_setzero_ps()) {}  // zeros, as torch's
  Vec(__m256 v) : values(v) {}
  Vec(float v) : values(_mm256_set1_ps(v)) {}
  static constexpr int size() { return 8; }
  static __m256i lanes_below(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // The tail: lanes [0, count) read, the rest zero (torch's masked load).
  static Vec loadu(const float* p, int64_t count = size()) {
    if (count >= size()) return _mm256_loadu_ps(p);
    return _mm256_maskload_ps(p, lanes_below(count));
  }
  void store(float* p, int64_t count = size()) const {
    if (count >= size()) {
      _mm256_storeu_ps(p, values);
    } else if (count > 0) {
      _mm256_maskstore_ps(p, lanes_below(count), values);
    }
  }
  Vec exp() const { return Sleef_expf8_u10(values); }
  Vec log() const { return Sleef_logf8_u10(values); }
};

inline Vec operator+(const Vec& a, const Vec& b) { return _mm256_add_ps(a.values, b.values); }
inline Vec operator-(const Vec& a, const Vec& b) { return _mm256_sub_ps(a.values, b.values); }
inline Vec operator*(const Vec& a, const Vec& b) { return _mm256_mul_ps(a.values, b.values); }
// NaN in either operand gives a NaN lane (all ones), as torch's maximum.
inline Vec maximum(const Vec& a, const Vec& b) {
  return _mm256_or_ps(_mm256_max_ps(a.values, b.values), _mm256_cmp_ps(a.values, b.values, _CMP_UNORD_Q));
}

#endif

}  // namespace

#endif
