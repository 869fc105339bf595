// The many-row blocks' fp32 GEMMs (AVX2 and AVX-512 builds; empty in the scalar one): 6 x 16
// register tiles for S = Q K^T and P V, with K transposed into panels of 16 keys and V cut into
// slices of 16 dims, so every operand a tile reads is contiguous. Functions of their arrays
// alone (no call, item or scratch): a block's summation order, and so its bits, is fixed here.
//
// Only cpu_attention.cpp includes this header: the kernel is one translation unit, and the
// anonymous namespace gives everything here the internal linkage it had when the kernel was one
// file (nothing exported beside the entry points, the optimiser free to inline and drop as before).

#pragma once

#include "kernel_config.h"

#include <cstdint>
#include <cstring>

namespace {

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

}  // namespace
