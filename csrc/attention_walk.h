// One call's data and the walk of one work item: Call (the arguments as the kernel reads them:
// codes, strides, lengths, scalars, the pre-decoded K / V), Item ((batch, kv head, query tile[,
// key chunk])), the causal geometry (which rows see which keys), the few-row fused kernels of
// decode, scores (a block's S by the kernel its shape takes), the online-softmax walk over an
// item's blocks, a split item's pass 1 (chunk_max) and the rows' out and lse (finish). Which
// thread runs an item, and when, is parallel_region.h's concern; forward builds the items.
//
// Only cpu_attention.cpp includes this header: the kernel is one translation unit, and the
// anonymous namespace gives everything here the internal linkage it had when the kernel was one
// file (nothing exported beside the entry points, the optimiser free to inline and drop as before).

#pragma once

#include "gemm_tiles_bf16.h"
#include "gemm_tiles_fp32.h"
#include "hif8_rounding.h"
#include "kernel_config.h"
#include "kernel_api.h"
#include "kv_decoder.h"
#include "row_rotation.h"
#include "thread_scratch.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// ---- the call -------------------------------------------------------------------------------

struct Call {
  const uint8_t* q;
  KvSrc k, v;
  int64_t sq[4];  // element strides (batch, head, position, dim)
  int16_t* out;    // bf16 bits, or
  float* out_f32;  // O / l unrounded (the tests' view of the fp32 result), when out is fp32
  void* out_rot = nullptr;  // or H bf16(O / l) in dtype rot_dt (the drop-in's epilogue, ForwardArgs)
  int rot_dt = 0;
  float rot_c = 0.f;
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
  bool bf16_few = false;    // the few-row blocks too (the decoder's wide form: see forward) ...
  int min_e8m0 = 0, max_e8m0 = 0;  // ... MXFP8: where their scales lie in [min, max] (see forward)
  // quant_modes 1 and 6 (0: HiF8): E4M3 codes (dec.e4m3) and P rounded to E4M3. Mode 1's E8M0
  // scales are folded into Q (q_e8m0, per (token, head) ceil(D/32) scales at q_st = (token,
  // head) strides) and into K and V at decode (KvSrc::sbase). Mode 6's fp32 scales are applied
  // where the torch path applies them: S per row by q_f32 (q_st: (head, token)) and per column
  // by k_f32 (kst: (block, head, position in block), through K's block table); P8 V per head.
  int mode = 0;
  const uint8_t* q_e8m0 = nullptr;
  const float* e8m0 = nullptr;
  const float* q_f32 = nullptr;
  const float* k_f32 = nullptr;
  int64_t q_st[2] = {0, 0}, kst[3] = {0, 0, 0};
  std::vector<float> v_descale_h;  // per kv head (mode 0: v_descale for every head)
  std::vector<int64_t> v_scale_starts;  // mode 1, contiguous V: per batch, its scales' first key
};

// Mode 6: the q_descale of each row of the item this thread is running (load_q sets it).
inline std::vector<float>& q_row_scale() {
  thread_local std::vector<float> scale;
  return scale;
}

struct Item {
  int64_t b, h, t0, t1;  // query positions [t0, t1) of batch b, kv head h
  int64_t c0, c1;        // key blocks [c0, c1)
  int64_t slot;          // partial-state slot of a split item, -1 if not split
  int64_t first;         // index of its item's first chunk in the split list (split items)
  double cost;
};

// Q tile rows in (position, group) order: row (i - t0) * G + g holds q head h * G + g.
void load_q_rows(const Call& c, const Item& it, float* dst) {
  const int64_t G = c.group;
  for (int64_t i = it.t0; i < it.t1; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* p = c.q + it.b * c.sq[0] + (it.h * G + g) * c.sq[1] + (c.q_starts[it.b] + i) * c.sq[2];
      float* d = dst + ((i - it.t0) * G + g) * c.dim;
      c.dec.decode(p, c.sq[3], d, c.dim);
      if (c.q_e8m0) {
        const uint8_t* sp = c.q_e8m0 + (c.q_starts[it.b] + i) * c.q_st[0] + (it.h * G + g) * c.q_st[1];
        for (int64_t x = 0; x < c.dim; ++x) d[x] = d[x] * c.e8m0[sp[x / 32]];
      }
    }
  }
  if (c.q_f32) {
    std::vector<float>& rs = q_row_scale();
    rs.resize((it.t1 - it.t0) * G);
    for (int64_t i = it.t0; i < it.t1; ++i)
      for (int64_t g = 0; g < G; ++g)
        rs[(i - it.t0) * G + g] = c.q_f32[(it.h * G + g) * c.q_st[0] + (c.q_starts[it.b] + i) * c.q_st[1]];
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
// and run the dot products from there, in a fixed order (lanes of 8 dims, or 16 folded to 8 in
// the AVX-512 builds, then a fixed add tree; keys in ascending order for P @ V). Whether a block
// takes this path depends only on the item's shape, so the bits never depend on the thread count.
constexpr int64_t kFusedRows = 16;
constexpr int64_t kGroup = 8;  // keys per decoded group of K
// ... and of V: P V's accumulators go through memory once per group (its rows' sums outnumber
// the registers), so a longer group pays that less often (32 keys: 16 KB of fp32, in L1).
constexpr int64_t kVGroup = 32;

inline bool fused(const Call& c, int64_t rows) {
#ifdef QFA_SIMD
  return rows <= kFusedRows && c.dim == kFusedDim;
#else
  (void)c; (void)rows;
  return false;
#endif
}

// Which kernels the last call's blocks ran (bits; the bench names them per row, the tests check
// the bf16 path really ran): bf16 dot products, the AVX2 tiles or fused kernels, MKL / scalar,
// the AVX-512 fused kernels.
// (AVX-512 builds: the few-row kernels are the 16-lane ones, kPathAvx512.)
constexpr int kPathBf16 = 1, kPathAvx2 = 2, kPathScalar = 4, kPathAvx512 = 8;
#ifdef QFA_WIDE
constexpr int kPathFused = kPathAvx512;
#else
constexpr int kPathFused = kPathAvx2;
#endif
std::atomic<int> last_paths{0};
inline void ran(int bit) {
  if (!(last_paths.load(std::memory_order_relaxed) & bit)) last_paths.fetch_or(bit, std::memory_order_relaxed);
}

// Rows of keys [g0, g0 + n) of the item's block at j0: pre-decoded (pre), or decoded into buf.
inline const float* key_rows(const Call& c, const Item& it, const KvSrc& src, const float* pre, int64_t j0,
                             int64_t g0, int64_t n, float* buf, ScaleRowMemo& memo) {
  if (pre) return pre + g0 * c.dim;
  decode_rows(c.dec, c.dim, src, it.b, it.h, c.kv_starts[it.b], j0 + g0, j0 + g0 + n, buf, &memo);
  return buf;
}

#ifdef QFA_SIMD
// The few-row kernels' registers: 8 lanes (AVX2), or 16 in the AVX-512 builds, whose 8-lane
// form left half of these CPUs' vector width unused. A dot product's lanes are folded to 8 (lane
// i plus lane i + 8) before the add tree; P V's chains over the keys do not depend on the width.
struct Lanes8 {
  using T = __m256;
  static constexpr int64_t n = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  // A load the compiler keeps in a register: where one value feeds two FMAs, GCC otherwise folds
  // the load into both (two loads per value), and the few-row loops become load-bound.
  static T load_once(const float* p) {
    T v = _mm256_loadu_ps(p);
    asm("" : "+x"(v));
    return v;
  }
  static T set1(float f) { return _mm256_set1_ps(f); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static __m256 fold(T a) { return a; }
};
#ifdef QFA_WIDE
struct Lanes16 {
  using T = __m512;
  static constexpr int64_t n = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load_once(const float* p) {
    T v = _mm512_loadu_ps(p);
    asm("" : "+v"(v));
    return v;
  }
  static T set1(float f) { return _mm512_set1_ps(f); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static __m256 fold(T a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); }
};
using FusedLanes = Lanes16;
#else
using FusedLanes = Lanes8;
#endif

// [sum(a0), ..., sum(a7)]
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Two rows' scores of four keys (hsum8's [row 0: keys 0-3, row 1: keys 0-3]) to dst and
// dst + stride, of which the first `keys` are stored: whole, two 4-float stores (a chain of
// scalar stores was a quarter of the decode kernel's S time).
inline void store_pair_scores(__m256 s, float* dst, int64_t stride, int64_t keys) {
  if (keys >= 4) {
    _mm_storeu_ps(dst, _mm256_castps256_ps128(s));
    _mm_storeu_ps(dst + stride, _mm256_extractf128_ps(s, 1));
    return;
  }
  alignas(32) float v[8];  // a short last group (AVX2 builds have no masked stores)
  _mm256_store_ps(v, s);
  for (int64_t j = 0; j < keys; ++j) {
    dst[j] = v[j];
    dst[stride + j] = v[4 + j];
  }
}

// S = Q K^T for rows [lo, R) and columns [0, nc) of the block at j0 (K pre-decoded or codes).
// keys [k_first, k_last) of the block only (k_last < 0: all): the bf16 kernel's fallback for
// one group.
template <typename L = FusedLanes>
void qk_fused(const Call& c, const Item& it, const float* kpre, int64_t j0, int64_t lo, int64_t R, int64_t nc,
              Scratch& sc, float* dst, int64_t k_first = 0, int64_t k_last = -1) {
  using T = typename L::T;
  constexpr int64_t D = kFusedDim;
  const int64_t BN = c.block_n;
  float* buf = sc.k.get();
  if (k_last >= 0) nc = std::min(nc, k_last);
  for (int64_t g0 = k_first; g0 < nc; g0 += kGroup) {
    const int64_t n = std::min(kGroup, nc - g0);
    const float* kr = key_rows(c, it, c.k, kpre, j0, g0, n, buf, sc.vmemo);  // (K's scales never use it)
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
        T a0 = L::zero(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int64_t x = 0; x < D; x += L::n) {
          const T u = L::load(q0 + x), w = L::load(q1 + x);
          T kv = L::load_once(k + x);
          a0 = L::fma(u, kv, a0); b0 = L::fma(w, kv, b0);
          kv = L::load_once(k + D + x);
          a1 = L::fma(u, kv, a1); b1 = L::fma(w, kv, b1);
          kv = L::load_once(k + 2 * D + x);
          a2 = L::fma(u, kv, a2); b2 = L::fma(w, kv, b2);
          kv = L::load_once(k + 3 * D + x);
          a3 = L::fma(u, kv, a3); b3 = L::fma(w, kv, b3);
        }
        store_pair_scores(hsum8(L::fold(a0), L::fold(a1), L::fold(a2), L::fold(a3), L::fold(b0), L::fold(b1),
                                L::fold(b2), L::fold(b3)),
                          dst + (r - lo) * BN + g0 + h, BN, n - h);
      }
    }
    for (; r < R; ++r) {
      const float* q = sc.q.get() + r * D;
      T a0 = L::zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int64_t x = 0; x < D; x += L::n) {
        const T qv = L::load(q + x);
        a0 = L::fma(qv, L::load(kr + x), a0);
        a1 = L::fma(qv, L::load(kr + D + x), a1);
        a2 = L::fma(qv, L::load(kr + 2 * D + x), a2);
        a3 = L::fma(qv, L::load(kr + 3 * D + x), a3);
        a4 = L::fma(qv, L::load(kr + 4 * D + x), a4);
        a5 = L::fma(qv, L::load(kr + 5 * D + x), a5);
        a6 = L::fma(qv, L::load(kr + 6 * D + x), a6);
        a7 = L::fma(qv, L::load(kr + 7 * D + x), a7);
      }
      alignas(32) float s[8];
      _mm256_store_ps(s, hsum8(L::fold(a0), L::fold(a1), L::fold(a2), L::fold(a3), L::fold(a4), L::fold(a5),
                               L::fold(a6), L::fold(a7)));
      std::memcpy(dst + (r - lo) * BN + g0, s, sizeof(float) * n);
    }
  }
}
#endif

#ifdef QFA_BF16_DOT
// ---- few-row blocks as bf16 dot products (AVX512_BF16 builds) ------------------------------------
// The fused kernels' structure with gemm_tiles_bf16.h's arithmetic (and its argument for the
// numbers): K and V decoded straight to bf16 (no widening, half the bytes), each vdpbf16ps two
// products a lane. S: a dot product's lanes are the dim pairs (2d, 2d + 1) of 32-dim steps,
// folded to 8 lanes and the fused kernels' add tree. P V: each output element is its row's chain
// over key pairs in ascending order. MXFP8's scales are applied by moving the words' exponent
// fields (move_exponents), exact for scale codes within bounds from the table (Call::min_e8m0,
// max_e8m0, see forward): these kernels check the scales they read, and a Q scale outside them
// sends its item to the fp32 kernels, a K or V scale its group of keys.
constexpr int64_t kPairGroup = 64;  // keys of V decoded as pairs at a time (16 KB of bf16)

// MXFP8 (quant_mode 1): 32 E4M3 codes' bf16 words times their scales (move_exponents); the
// non-finite codes flagged in big / apart, lanes of a NaN scale (nan) NaN.
inline __m512i scaled_words(const Decoder& dc, const uint8_t* p, __m512i step, __mmask32 nan, __m512i& big,
                            __m512i& apart, __m512i exc_v) {
  return _mm512_mask_mov_epi16(move_exponents(dc.words_wide<false>(p, big, apart, exc_v), step), nan,
                               _mm512_set1_epi16(0x7FC0));
}

// The codes of keys [j0, j1) of K or V, asked for ahead of their decode (as decode_rows does
// within a run): only keys of the sequence, as a paged row's address reads the block table.
inline void prefetch_key_rows(const Call& c, const Item& it, const KvSrc& src, int64_t j0, int64_t j1) {
  if (src.st[3] != 1) return;
  j1 = std::min(j1, c.kv_lens[it.b]);
  for (int64_t j = j0; j < j1; ++j) {
    const char* p = reinterpret_cast<const char*>(src.row(it.b, it.h, c.kv_starts[it.b], j));
    for (int64_t x = 0; x < kFusedDim; x += 64) _mm_prefetch(p + x, _MM_HINT_T0);
  }
}

// Keys [k0, k0 + n) of MXFP8's K (one scale per 32 channels) as bf16 rows into dst. A code or
// scale that is not finite needs no fp32 fallback here: its word is NaN (or Inf), which a dot
// product propagates as the fp32 one does, whatever the order.
// Returns false where a scale is below c.min_e8m0 (then the group runs fp32; dst is not complete).
bool scaled_k_rows_bf16(const Call& c, const Item& it, int64_t k0, int64_t n, uint16_t* dst) {
  constexpr int64_t D = kFusedDim;
  const KvSrc& src = c.k;
  if (src.st[3] != 1) return false;  // (the codes are loaded as runs along D)
  const __m512i exc_v = c.dec.exc_word();
  __m512i big = _mm512_setzero_si512(), apart = _mm512_set1_epi16(-1);
  if (c.dec.vbmi && src.per == 32) {  // the group's 32 scales checked and expanded at once, one call for its rows
    constexpr int64_t G = D / 32;  // scales per key
    static_assert(kGroup * G == 32, "a group's K scales fill one register of words");
    prefetch_key_rows(c, it, src, k0 + kAhead, k0 + kAhead + n);
    const uint8_t* rows[kGroup];
    alignas(32) uint8_t codes[kGroup * G] = {};
    for (int64_t j = 0; j < n; ++j) {
      rows[j] = src.row(it.b, it.h, c.kv_starts[it.b], k0 + j);
      const uint8_t* sp = src.scale_row(it.b, it.h, k0 + j);
      if (src.el_st == 1) std::memcpy(codes + j * G, sp, G);
      else for (int64_t g = 0; g < G; ++g) codes[j * G + g] = sp[g * src.el_st];
    }
    const __m512i cw = _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(codes)));
    const __mmask32 live = n * G >= 32 ? ~__mmask32(0) : (__mmask32(1) << (n * G)) - 1;
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(cw, _mm512_set1_epi16(0xFF)) & live;
    if ((_mm512_cmplt_epi16_mask(cw, _mm512_set1_epi16(static_cast<short>(c.min_e8m0))) |
         (_mm512_cmpgt_epi16_mask(cw, _mm512_set1_epi16(static_cast<short>(c.max_e8m0))) & ~nan)) & live)
      return false;
    alignas(64) int16_t kstep[kGroup * G];  // e8m0_step of each code, in 16-bit lanes
    _mm512_store_si512(kstep, _mm512_slli_epi16(_mm512_sub_epi16(cw, _mm512_set1_epi16(kE8m0Bias)), kBf16ExpShift));
    uint32_t knan[kGroup];
    for (int64_t j = 0; j < n; ++j) knan[j] = (nan >> (j * G)) & ((1u << G) - 1);
    scaled_rows_bf16_vbmi(c.dec, rows, n, D, nullptr, kstep, knan, dst);
    return true;
  }
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* p = src.row(it.b, it.h, c.kv_starts[it.b], k0 + j);
    const uint8_t* sp = src.scale_row(it.b, it.h, k0 + j);
    for (int64_t x = 0; x < D; x += 32) {
      const int code = sp[(x >> src.per_shift) * src.el_st];
      if (code < c.min_e8m0 || (code > c.max_e8m0 && code != 0xFF)) return false;
      const __mmask32 nan = code == 0xFF ? ~__mmask32(0) : 0;
      _mm512_storeu_si512(dst + j * D + x, scaled_words(c.dec, p + x, _mm512_set1_epi16(e8m0_step(code)), nan, big,
                                                        apart, exc_v));
    }
  }
  return true;
}

// Sixteen dot products' lanes, each summed by the fused kernels' add tree (its 16 lanes folded
// to 8, then hsum8's pairs of pairs), side by side: lane i of the result is x[i]'s sum, the bits
// of Lanes16::fold and hsum8. 45 instructions where two hsum8 of eight folds take twice the
// micro-ops (hadd is three), which were the larger part of the few-row S.
inline __m512 tree_sums16(const __m512* x) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  __m512 y[8], z[4], w[2];
  for (int t = 0; t < 8; ++t)  // the folds: lanes 0-7 x[2t]'s a[i] + a[i + 8], lanes 8-15 x[2t + 1]'s
    y[t] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * t], x[2 * t + 1], 0x44),
                         _mm512_shuffle_f32x4(x[2 * t], x[2 * t + 1], 0xEE));
  for (int u = 0; u < 4; ++u)  // f[2j] + f[2j + 1]: four per sum
    z[u] = _mm512_add_ps(_mm512_permutex2var_ps(y[2 * u], even, y[2 * u + 1]),
                         _mm512_permutex2var_ps(y[2 * u], odd, y[2 * u + 1]));
  for (int v = 0; v < 2; ++v)  // (f0 + f1) + (f2 + f3) and (f4 + f5) + (f6 + f7): two per sum
    w[v] = _mm512_add_ps(_mm512_permutex2var_ps(z[2 * v], even, z[2 * v + 1]),
                         _mm512_permutex2var_ps(z[2 * v], odd, z[2 * v + 1]));
  return _mm512_add_ps(_mm512_permutex2var_ps(w[0], even, w[1]), _mm512_permutex2var_ps(w[0], odd, w[1]));
}

// S = Q K^T for rows [lo, R) and columns [0, nc) of the block at j0, from the codes.
void qk_fused_bf16(const Call& c, const Item& it, int64_t j0, int64_t lo, int64_t R, int64_t nc, Scratch& sc,
                   float* dst) {
  constexpr int64_t D = kFusedDim;
  const int64_t BN = c.block_n;
  uint16_t* kr = sc.half(sc.kb);
  const uint16_t* qb = sc.half(sc.qb);
  auto dot = [](__m512 acc, const uint16_t* a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a), (__m512bh)b);
  };
  for (int64_t g0 = 0; g0 < nc; g0 += kGroup) {
    const int64_t n = std::min(kGroup, nc - g0);
    if (c.k.sbase) {
      if (!scaled_k_rows_bf16(c, it, j0 + g0, n, kr)) {  // a scale below the bound: this group in fp32
        qk_fused(c, it, nullptr, j0, lo, R, nc, sc, dst, g0, g0 + n);
        ran(kPathFused);
        continue;
      }
    } else {
      decode_rows(c.dec, D, c.k, it.b, it.h, c.kv_starts[it.b], j0 + g0, j0 + g0 + n, kr);
    }
    if (n < kGroup) std::memset(kr + n * D, 0, sizeof(uint16_t) * (kGroup - n) * D);
    int64_t r = lo;
    const __mmask8 keys = n >= 8 ? 0xFF : static_cast<__mmask8>((1u << n) - 1);
    static_assert(kGroup == 8, "two rows of a group's scores fill one register");
    for (; r + 2 <= R; r += 2) {  // two rows x the group's 8 keys: 16 dot products, summed together
      const uint16_t* q0 = qb + r * D;
      const uint16_t* q1 = q0 + D;
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t x = 0; x < D; x += 32) {
        for (int64_t j = 0; j < kGroup; ++j) {
          const __m512i kv = _mm512_loadu_si512(kr + j * D + x);
          acc[j] = dot(acc[j], q0 + x, kv);
          acc[kGroup + j] = dot(acc[kGroup + j], q1 + x, kv);
        }
      }
      const __m512 s = tree_sums16(acc);
      _mm256_mask_storeu_ps(dst + (r - lo) * BN + g0, keys, _mm512_castps512_ps256(s));
      _mm256_mask_storeu_ps(dst + (r + 1 - lo) * BN + g0, keys, _mm512_extractf32x8_ps(s, 1));
    }
    for (; r < R; ++r) {
      const uint16_t* q = qb + r * D;
      __m512 a[kGroup];
      for (int64_t j = 0; j < kGroup; ++j) a[j] = _mm512_setzero_ps();
      for (int64_t x = 0; x < D; x += 32)
        for (int64_t j = 0; j < kGroup; ++j) a[j] = dot(a[j], q + x, _mm512_loadu_si512(kr + j * D + x));
      alignas(32) float s8[8];
      _mm256_store_ps(s8, hsum8(Lanes16::fold(a[0]), Lanes16::fold(a[1]), Lanes16::fold(a[2]), Lanes16::fold(a[3]),
                                Lanes16::fold(a[4]), Lanes16::fold(a[5]), Lanes16::fold(a[6]), Lanes16::fold(a[7])));
      std::memcpy(dst + (r - lo) * BN + g0, s8, sizeof(float) * n);
    }
  }
}
#endif

#ifdef QFA_BF16_DOT
// MXFP8: whether every scale code of the item's Q rows is at least least.
inline bool q_scales_at_least(const Call& c, const Item& it, int least) {
  const int64_t G = c.group, groups = (c.dim + 31) / 32;
  for (int64_t i = it.t0; i < it.t1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* sp = c.q_e8m0 + (c.q_starts[it.b] + i) * c.q_st[0] + (it.h * G + g) * c.q_st[1];
      for (int64_t x = 0; x < groups; ++x)
        if (sp[x] < least) return false;
    }
  return true;
}
#endif

// The item's Q tile into sc.q, and as bf16 into sc.qb where its many-row blocks take bf16 dot
// products (values exact in bf16).
void load_q(const Call& c, const Item& it, Scratch& sc) {
  load_q_rows(c, it, sc.q.get());
#ifdef QFA_BF16_DOT
  const int64_t R = (it.t1 - it.t0) * c.group;
  if (c.bf16 && (c.bf16_few || !fused(c, R))) to_bf16(sc.q.get(), R * c.dim, sc.half(sc.qb));
  sc.few_bf16 = c.bf16_few && (!c.q_e8m0 || q_scales_at_least(c, it, c.min_e8m0));
#endif
}


// Scores of block blk for the rows [lo, R) of the item: row r at dst + (r - lo) * block_n.
// Sets vblk to the block's fp32 V where it is pre-decoded, else to nullptr. Returns nk.
int64_t scores_of(const Call& c, const Item& it, int64_t blk, int64_t lo, Scratch& sc, float* dst, const float*& vblk) {
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
#ifdef QFA_BF16_DOT
    if (sc.few_bf16) {
      qk_fused_bf16(c, it, j0, lo, R, nc, sc, dst);
      ran(kPathBf16);
      return nk;
    }
#endif
    qk_fused(c, it, c.panel_gemm ? nullptr : kpre, j0, lo, R, nc, sc, dst);
    ran(kPathFused);
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
  qfa_kernel::host_mm(dst, BN, sc.q.get() + lo * D, D, kblk, D, R - lo, nc, D, true);
  return nk;
}

// scores_of, then mode 6's scales as the torch path applies them: S * (q_descale[i] * k_descale[j]).
int64_t scores(const Call& c, const Item& it, int64_t blk, int64_t lo, Scratch& sc, float* dst, const float*& vblk) {
  const int64_t nk = scores_of(c, it, blk, lo, sc, dst, vblk);
  if (!c.k_f32) return nk;
  const int64_t BN = c.block_n, j0 = blk * BN;
  const int64_t R = (it.t1 - it.t0) * c.group;
  const int64_t nc = columns(c, it, j0, nk);
  thread_local std::vector<float> ks;
  ks.resize(BN);
  for (int64_t j = 0; j < nc; ++j) {
    const int64_t key = j0 + j;
    const int64_t b = c.k.table ? c.k.table[it.b * c.k.table_stride + key / c.k.block_size] : it.b;
    const int64_t pos = c.k.table ? key % c.k.block_size : c.kv_starts[it.b] + key;
    ks[j] = c.k_f32[b * c.kst[0] + it.h * c.kst[1] + pos * c.kst[2]];
  }
  const std::vector<float>& rs = q_row_scale();
  for (int64_t r = lo; r < R; ++r) {
    float* s = dst + (r - lo) * BN;
    const Vec f(rs[r]);
    int64_t j = 0;
    for (; j + Vec::size() <= nc; j += Vec::size()) (Vec::loadu(s + j) * (f * Vec::loadu(ks.data() + j))).store(s + j);
    for (; j < nc; ++j) s[j] = s[j] * (rs[r] * ks[j]);
  }
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
// keys [k_first, k_last) of the block only (k_last < 0: all), adding to pv as it is: the bf16
// kernel's fallback for one group.
template <typename L = FusedLanes>
void pv_fused(const Call& c, const Item& it, const float* vpre, int64_t j0, int64_t nk, int64_t lo, int64_t R,
              const float* p, Scratch& sc, float* pv, int64_t k_first = 0, int64_t k_last = -1) {
  using T = typename L::T;
  constexpr int64_t D = kFusedDim;
  const int64_t BN = c.block_n;
  if (k_last < 0) std::memset(pv, 0, sizeof(float) * (R - lo) * D);
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
  if (k_last >= 0) vis_max = std::min(vis_max, k_last);
  for (int64_t g0 = k_first; g0 < vis_max; g0 += kVGroup) {
    const int64_t n = std::min(kVGroup, vis_max - g0);
    const float* vr = key_rows(c, it, c.v, vpre, j0, g0, n, buf, sc.vmemo);
    // Two rows x four registers of dims per pass (6 loads per 8 FMAs); each element is its row's
    // chain over the keys in ascending order, whichever pass computes it.
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
      for (int64_t x = 0; x < D; x += 4 * L::n) {
        T a0 = L::load(o0 + x), a1 = L::load(o0 + x + L::n), a2 = L::load(o0 + x + 2 * L::n),
          a3 = L::load(o0 + x + 3 * L::n);
        T b0 = L::zero(), b1 = b0, b2 = b0, b3 = b0;
        if (pair) {
          b0 = L::load(o1 + x); b1 = L::load(o1 + x + L::n); b2 = L::load(o1 + x + 2 * L::n);
          b3 = L::load(o1 + x + 3 * L::n);
        }
        int64_t j = 0;
        for (; j < both; ++j) {
          const T u = L::set1(p0[j]), w = L::set1(p1[j]);
          const float* v = vr + j * D + x;
          T vv = L::load_once(v);
          a0 = L::fma(u, vv, a0); b0 = L::fma(w, vv, b0);
          vv = L::load_once(v + L::n);
          a1 = L::fma(u, vv, a1); b1 = L::fma(w, vv, b1);
          vv = L::load_once(v + 2 * L::n);
          a2 = L::fma(u, vv, a2); b2 = L::fma(w, vv, b2);
          vv = L::load_once(v + 3 * L::n);
          a3 = L::fma(u, vv, a3); b3 = L::fma(w, vv, b3);
        }
        for (int64_t jj = j; jj < n0; ++jj) {
          const T u = L::set1(p0[jj]);
          const float* v = vr + jj * D + x;
          a0 = L::fma(u, L::load(v), a0); a1 = L::fma(u, L::load(v + L::n), a1);
          a2 = L::fma(u, L::load(v + 2 * L::n), a2); a3 = L::fma(u, L::load(v + 3 * L::n), a3);
        }
        for (int64_t jj = j; jj < n1; ++jj) {
          const T w = L::set1(p1[jj]);
          const float* v = vr + jj * D + x;
          b0 = L::fma(w, L::load(v), b0); b1 = L::fma(w, L::load(v + L::n), b1);
          b2 = L::fma(w, L::load(v + 2 * L::n), b2); b3 = L::fma(w, L::load(v + 3 * L::n), b3);
        }
        L::store(o0 + x, a0); L::store(o0 + x + L::n, a1); L::store(o0 + x + 2 * L::n, a2);
        L::store(o0 + x + 3 * L::n, a3);
        if (pair) {
          L::store(o1 + x, b0); L::store(o1 + x + L::n, b1); L::store(o1 + x + 2 * L::n, b2);
          L::store(o1 + x + 3 * L::n, b3);
        }
      }
    }
  }
}
#endif

#ifdef QFA_BF16_DOT
// V keys [k0, k0 + n) of item it (the sequence's own indices) as bf16 key pairs: pair i's dims
// 16t .. 16t + 15 at dst + (i * D / 16 + t) * 32, dword d holding (V[2i][16t + d], V[2i + 1][16t +
// d]); an odd n's last pair has a zero second key. Returns false where a value is not finite, or
// the codes are not contiguous along D (then nothing is promised of dst: the caller runs fp32).
bool v_pairs_bf16(const Call& c, const Item& it, int64_t k0, int64_t n, uint16_t* dst, Scratch& sc) {
  constexpr int64_t D = kFusedDim;
  const Decoder& dc = c.dec;
  const KvSrc& src = c.v;
  if (!dc.wide || src.st[3] != 1) return false;
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  const int64_t start = c.kv_starts[it.b];
  if (dc.vbmi) {  // the rows through the VBMI decoder (MXFP8: scaled as they are), then paired
    uint16_t* rows = sc.half(sc.kb);
    if (!src.sbase) {
      if (!decode_rows(dc, D, src, it.b, it.h, start, k0, k0 + n, rows)) return false;
    } else {  // the keys sharing a scale row (up to 32, within a block: at a constant stride) in one call
      const uint8_t* run[kPairGroup];
      for (int64_t j = 0; j < n;) {
        const ScaleRowMemo& m = v_scale_row(src, src.scale_row(it.b, it.h, k0 + j), D, sc.vmemo);
        if (!m.finite || m.min_code < c.min_e8m0 || m.max_code > c.max_e8m0) return false;
        const int64_t e = std::min(n, src.scale_run_end(it.b, k0 + j) - k0);
        prefetch_key_rows(c, it, src, k0 + j + kAhead, k0 + e + kAhead);
        const uint8_t* first = src.row(it.b, it.h, start, k0 + j);
        for (int64_t i = 0; i < e - j; ++i) run[i] = first + i * src.st[2];
        if (scaled_rows_bf16_vbmi(dc, run, e - j, D, m.step, nullptr, nullptr, rows + j * D)) return false;
        j = e;
      }
    }
    if (n % 2) std::memset(rows + n * D, 0, sizeof(uint16_t) * D);
    for (int64_t i = 0; i < n; i += 2) {
      const uint16_t* r0 = rows + i * D;
      uint16_t* o = dst + i * D;
      for (int64_t x = 0; x < D; x += 32) {
        const __m512i w0 = _mm512_loadu_si512(r0 + x), w1 = _mm512_loadu_si512(r0 + D + x);
        _mm512_storeu_si512(o + 2 * x, _mm512_permutex2var_epi16(w0, lo_idx, w1));
        _mm512_storeu_si512(o + 2 * x + 32, _mm512_permutex2var_epi16(w0, hi_idx, w1));
      }
    }
    return true;
  }
  const __m512i exc_v = dc.exc_word();
  __m512i big = _mm512_setzero_si512(), apart = _mm512_set1_epi16(-1);
  alignas(64) static const uint8_t zeros[D] = {};
  alignas(64) static const int16_t no_step[D] = {};
  for (int64_t i = 0; i < n; i += 2) {
    const uint8_t* p0 = src.row(it.b, it.h, start, k0 + i);
    const uint8_t* p1 = i + 1 < n ? src.row(it.b, it.h, start, k0 + i + 1) : zeros;
    if (src.run_after(k0 + i) >= kAhead) {  // as decode_rows: the codes kAhead keys on (past the group too)
      const char* ahead = reinterpret_cast<const char*>(p0 + kAhead * src.st[2]);
      for (int64_t x = 0; x < 2 * D; x += 64) _mm_prefetch(ahead + x, _MM_HINT_T0);
    }
    // MXFP8: each key's scale row (one scale per channel; one row per 32 keys, the memo's); a
    // NaN scale sends the group to the fp32 chains
    const int16_t* st0 = no_step;
    const int16_t* st1 = no_step;
    if (src.sbase) {
      const uint8_t* sp0 = src.scale_row(it.b, it.h, k0 + i);
      const ScaleRowMemo& m0 = v_scale_row(src, sp0, D, sc.vmemo);
      if (!m0.finite || m0.min_code < c.min_e8m0 || m0.max_code > c.max_e8m0) return false;
      st0 = st1 = m0.step;
      const uint8_t* sp1 = i + 1 < n ? src.scale_row(it.b, it.h, k0 + i + 1) : sp0;
      if (sp1 != sp0) {  // a pair across two scale rows (the memo holds one: keep the first's steps)
        std::memcpy(sc.pair_step, m0.step, sizeof(sc.pair_step));
        st0 = sc.pair_step;
        const ScaleRowMemo& m1 = v_scale_row(src, sp1, D, sc.vmemo);
        if (!m1.finite || m1.min_code < c.min_e8m0 || m1.max_code > c.max_e8m0) return false;
        st1 = m1.step;
      }
    }
    uint16_t* o = dst + i * D;
    for (int64_t x = 0; x < D; x += 32) {
      __m512i w0, w1;
      if (src.sbase) {
        w0 = scaled_words(dc, p0 + x, _mm512_load_si512(st0 + x), 0, big, apart, exc_v);
        w1 = scaled_words(dc, p1 + x, _mm512_load_si512(st1 + x), 0, big, apart, exc_v);
      } else {
        w0 = dc.words_wide<false>(p0 + x, big, apart, exc_v);
        w1 = dc.words_wide<false>(p1 + x, big, apart, exc_v);
      }
      _mm512_storeu_si512(o + 2 * x, _mm512_permutex2var_epi16(w0, lo_idx, w1));
      _mm512_storeu_si512(o + 2 * x + 32, _mm512_permutex2var_epi16(w0, hi_idx, w1));
    }
  }
  return !Decoder::flagged(big, apart);
}

// pv = P V for rows [lo, R) of the block at j0 (nk keys) as bf16 dot products over key pairs; a
// group of V holding a value that is not finite runs pv_fused's fp32 chains (each row over its
// visible keys alone, as everywhere a non-finite value may meet a zero P).
void pv_fused_bf16(const Call& c, const Item& it, int64_t j0, int64_t nk, int64_t lo, int64_t R, const float* p,
                   Scratch& sc, float* pv) {
  constexpr int64_t D = kFusedDim;
  const int64_t BN = c.block_n;
  std::memset(pv, 0, sizeof(float) * (R - lo) * D);
  int64_t vis_max = 0;
  for (int64_t r = lo; r < R; ++r) vis_max = std::max(vis_max, visible(c, it, r, j0, nk));
  // P's pairs per row (P is zero past each row's visible keys; the pad past vis_max is zero)
  const int64_t pairs = (vis_max + 1) / 2;
  uint32_t* pp = reinterpret_cast<uint32_t*>(sc.half(sc.pb));
  const int64_t pstride = (BN + 1) / 2;
  for (int64_t r = lo; r < R; ++r) {
    const float* s = p + (r - lo) * BN;
    uint32_t* d = pp + (r - lo) * pstride;
    for (int64_t j = 0; j < 2 * pairs; j += 32) {
      const int64_t left = std::min<int64_t>(32, vis_max - j);
      const __mmask16 m0 = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
      const __mmask16 m1 = static_cast<__mmask16>(left >= 32 ? 0xFFFF : left > 16 ? (1u << (left - 16)) - 1 : 0);
      const __m512i b = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, s + j + 16), _mm512_maskz_loadu_ps(m0, s + j));
      const int64_t words = std::min<int64_t>(32, 2 * pairs - j);
      _mm512_mask_storeu_epi16(reinterpret_cast<uint16_t*>(d) + j, static_cast<__mmask32>(words >= 32 ? ~0u : (1u << words) - 1), b);
    }
  }
  uint16_t* vp = sc.half(sc.vb);
  for (int64_t g0 = 0; g0 < vis_max; g0 += kPairGroup) {
    const int64_t n = std::min(kPairGroup, vis_max - g0);
    if (!v_pairs_bf16(c, it, j0 + g0, n, vp, sc)) {
      pv_fused(c, it, nullptr, j0, nk, lo, R, p, sc, pv, g0, g0 + n);
      ran(kPathFused);
      continue;
    }
    const int64_t np = (n + 1) / 2;
    for (int64_t r = lo; r < R; r += 2) {
      const bool pair = r + 1 < R;
      const uint32_t* u0 = pp + (r - lo) * pstride + g0 / 2;
      const uint32_t* u1 = pair ? u0 + pstride : u0;
      float* o0 = pv + (r - lo) * D;
      float* o1 = pair ? o0 + D : o0;
      __m512 a[8], b[8];
      for (int t = 0; t < 8; ++t) { a[t] = _mm512_loadu_ps(o0 + 16 * t); b[t] = _mm512_loadu_ps(o1 + 16 * t); }
      for (int64_t i = 0; i < np; ++i) {
        const __m512bh w0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(u0[i]));
        const __m512bh w1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(u1[i]));
        const uint16_t* v = vp + i * 2 * D;
        for (int t = 0; t < 8; ++t) {
          const __m512bh vv = (__m512bh)_mm512_loadu_si512(v + 32 * t);
          a[t] = _mm512_dpbf16_ps(a[t], w0, vv);
          b[t] = _mm512_dpbf16_ps(b[t], w1, vv);
        }
      }
      for (int t = 0; t < 8; ++t) _mm512_storeu_ps(o0 + 16 * t, a[t]);
      if (pair)
        for (int t = 0; t < 8; ++t) _mm512_storeu_ps(o1 + 16 * t, b[t]);
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
    // The block's V first: a block whose values are all finite takes the bf16 P V, and then P is
    // needed only as bf16 (one pass over S); one holding a value that is not finite runs
    // pv_fused on the fp32 P (each row over its visible keys), which decodes the codes itself.
    const uint16_t* slices = nullptr;
    bool v_finite = true;
    if (bf16_block) {
      if (!c.vb_dec.empty() && c.vb_dec[it.b]) {
        const int64_t at_ = it.h * ((c.kv_lens[it.b] + BN - 1) / BN) + blk;
        slices = c.vb_dec[it.b] + at_ * BN * D;
        v_finite = c.v_finite[it.b][at_] != 0;
      } else {
        v_finite = decode_rows(c.dec, D, c.v, it.b, it.h, c.kv_starts[it.b], j0, j0 + nc, sc.half(sc.vb));
        if (v_finite) {
          to_bslices(sc.half(sc.vb), nc, sc.half(sc.vs), BN * kBPanel);
          slices = sc.half(sc.vs);
        }
      }
    }
#endif
    for (int64_t r = lo; r < R; ++r) {
      float* s = sblk + (r - lo) * BN;
      const int64_t nv = visible(c, it, r, j0, nk);
      const float rm = row_max(s, nv);
      const float m_new = max_nan(m[r], rm * c.dscale - c.ln_p);
      // Rows that have seen no key keep m = -inf; subtract 0 there so exp gives 0, not NaN.
      const float m_safe = m_new == kNegInf ? 0.f : m_new;
#ifdef QFA_BF16_DOT
      if (bf16_block) {
        uint16_t* pb = sc.half(sc.pb) + (r - lo) * BN;
        rsum[r] = c.mode ? exp_round_to_bf16<true>(s, nv, ncp, c.dscale, m_safe, c.rc, pb, !v_finite)
                         : exp_round_to_bf16<false>(s, nv, ncp, c.dscale, m_safe, c.rc, pb, !v_finite);
        alpha[r] = m[r] - m_safe;
        m[r] = m_new;
        continue;
      }
#endif
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
      if (c.mode) {
        round_row_e4m3(s, nv);
      } else {
        round_row(s, nv, c.rc);
      }
      for (int64_t jj = nv; jj < nc; ++jj) s[jj] = 0.f;
      alpha[r] = m[r] - m_safe;
      rsum[r] = sum;
      m[r] = m_new;
    }
    exp_inplace(alpha + lo, R - lo);
    for (int64_t r = lo; r < R; ++r) l[r] = alpha[r] * l[r] + rsum[r];
    bool done = false;
#ifdef QFA_SIMD
    if (fused(c, R - lo)) {
#ifdef QFA_BF16_DOT
      if (sc.few_bf16) {
        pv_fused_bf16(c, it, j0, nk, lo, R, sblk, sc, sc.pv.get());
      } else {
        pv_fused(c, it, vblk, j0, nk, lo, R, sblk, sc, sc.pv.get());
      }
#else
      pv_fused(c, it, vblk, j0, nk, lo, R, sblk, sc, sc.pv.get());
#endif
      done = true;
#ifdef QFA_BF16_DOT
    } else if (bf16_block) {
      if (v_finite) {
        pv_bpanels(sc.half(sc.pb), R - lo, BN, slices, BN * kBPanel, ncp / 2, sc.pv.get());
      } else {
        pv_fused(c, it, nullptr, j0, nk, lo, R, sblk, sc, sc.pv.get());
        ran(kPathFused);
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
        qfa_kernel::host_mm(sc.pv.get(), D, sblk, BN, vblk, D, R - lo, D, nc, false);
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
    const Vec vds(c.v_descale_h[it.h]);
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
    if (c.out_rot) {  // the bf16 row the op would return, rotated back by the drop-in's own code
      alignas(64) uint16_t row[qfa_rows::kD];
      for (int64_t x = 0; x < D; ++x) row[x] = seen ? static_cast<uint16_t>(bf16_half_away(orow[x] / l[r])) : 0;
      qfa_rows::rotate_row_built(qfa_rows::RowIn{row, qfa_rows::BF16, nullptr, true, c.rot_c},
                                 static_cast<char*>(c.out_rot) + at * qfa_rows::esize(c.rot_dt), c.rot_dt);
    } else if (c.out_f32) {
      for (int64_t x = 0; x < D; ++x) c.out_f32[at + x * c.so[3]] = seen ? orow[x] / l[r] : 0.f;
    } else {
      for (int64_t x = 0; x < D; ++x) c.out[at + x * c.so[3]] = seen ? bf16_half_away(orow[x] / l[r]) : int16_t(0);
    }
    if (c.lse) c.lse[it.b * c.sl[0] + n * c.sl[1] + (qs + i) * c.sl[2]] = seen ? m[r] + logl[r] : kInf;
  }
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
