// The build's configuration, shared by every part of the native attention kernel: which vector
// ISA it is compiled for (QFA_SIMD: AVX2 or AVX-512; QFA_BF16_DOT: the AVX512_BF16 build; the -m
// flags come from Python per CPU capability), torch's fp32 vector type, the infinities, and the
// head dim the vector kernels are specialised for. One place, so every header tests the same
// macros and no header depends on the order the others were included in.
//
// Only cpu_attention.cpp includes this header: the kernel is one translation unit, and the
// anonymous namespace gives everything here the internal linkage it had when the kernel was one
// file (nothing exported beside the entry points, the optimiser free to inline and drop as before).

#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <cstdint>
#include <limits>

// The AVX512_BF16 build (-mavx512bf16, chosen by qfa/attention/backends/cpu_kernel.py from the CPU's
// flags): the many-row blocks' two GEMMs run as bf16 dot products (see gemm_tiles_bf16.h).
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define QFA_BF16_DOT 1
#endif

// The AVX2 and AVX-512 builds: the decoder's vpshufb rule, the fp32 register tiles and the
// few-row fused kernels (8-lane code, which the AVX-512 builds run too).
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define QFA_SIMD 1
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();

// HEAD_DIM of the vector kernels (fp32 and bf16 tiles, panels, fused kernels): constant offsets
// keep the row pointers in registers. Other head dims take the scalar / MKL path.
constexpr int64_t kFusedDim = 128;

}  // namespace
