// The build's configuration, shared by every part of the native attention kernel: which vector
// ISA it is compiled for (QFA_SIMD: AVX2 or AVX-512; QFA_BF16_DOT: the AVX512_BF16 build; the -m
// flags come from Python per CPU capability), the fp32 vector type (torch's semantics: simd_vec.h
// in the SIMD builds, torch's own generic one in the scalar build), the infinities, and the head
// dim the vector kernels are specialised for. One place, so every header tests the same
// macros and no header depends on the order the others were included in.
//
// Only cpu_attention.cpp includes this header: the kernel is one translation unit, and the
// anonymous namespace gives everything here the internal linkage it had when the kernel was one
// file (nothing exported beside the entry points, the optimiser free to inline and drop as before).

#pragma once

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include "simd_vec.h"
#else
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#endif

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

// The AVX512_BF16 build (-mavx512bf16, chosen by qfa/attention/backends/cpu_kernel.py from the CPU's
// flags): the many-row blocks' two GEMMs run as bf16 dot products (see gemm_tiles_bf16.h).
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define QFA_BF16_DOT 1
#endif

// The AVX2 and AVX-512 builds: the decoder's vpshufb rule, the fp32 register tiles and the
// few-row fused kernels (8-lane code, which the AVX-512 builds run too, except for ...)
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define QFA_SIMD 1
#endif

// ... the AVX-512 builds' own 16-lane parts: the decoder's table lookups (kv_decoder.h) and the
// few-row kernels of decode (attention_walk.h), whose 8-lane forms left half of these CPUs'
// vector width unused (the decode of K and V was about half of a Sq = 1 call).
#if defined(CPU_CAPABILITY_AVX512)
#define QFA_WIDE 1
#endif

namespace {

#if !defined(QFA_SIMD)
using Vec = at::vec::Vectorized<float>;
#endif
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();

// The kernel's checks: no c10 header in the SIMD builds (see simd_vec.h), so a failed one throws a
// std::runtime_error, which the bindings turn into a Python RuntimeError as they did TORCH_CHECK's
// c10::Error. The message is the parts given, numbers in decimal.
inline void append_part(std::string& s, const char* p) { s += p; }
inline void append_part(std::string& s, const std::string& p) { s += p; }
template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
inline void append_part(std::string& s, T v) { s += std::to_string(v); }
template <typename... Parts>
[[noreturn]] void check_failed(const char* cond, const Parts&... parts) {
  std::string s;
  if constexpr (sizeof...(parts) == 0) {
    s = std::string("qfa native attention: check failed: ") + cond;
  } else {
    (append_part(s, parts), ...);
  }
  throw std::runtime_error(s);
}
#define QFA_CHECK(cond, ...)                                        \
  do {                                                              \
    if (!(cond)) check_failed(#cond __VA_OPT__(, ) __VA_ARGS__);    \
  } while (0)

// HEAD_DIM of the vector kernels (fp32 and bf16 tiles, panels, fused kernels): constant offsets
// keep the row pointers in registers. Other head dims take the scalar / MKL path.
constexpr int64_t kFusedDim = 128;

}  // namespace
