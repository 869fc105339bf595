// The many-row blocks' GEMMs as bf16 dot products (vdpbf16ps; the AVX512_BF16 build only, empty
// in every other): 12 x 32 register tiles, K in panels of 32 keys by dim pairs, V in slices of 32
// dims by key pairs. Apart from the fp32 tiles since their ISA, their layouts and the argument
// that they compute the fp32 kernels' numbers up to summation order (below) are their own.
//
// Only cpu_attention.cpp includes this header: the kernel is one translation unit, and the
// anonymous namespace gives everything here the internal linkage it had when the kernel was one
// file (nothing exported beside the entry points, the optimiser free to inline and drop as before).

#pragma once

#include "kernel_config.h"

#include <cstdint>
#include <cstring>

namespace {

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

}  // namespace
