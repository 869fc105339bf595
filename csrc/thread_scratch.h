// Aligned scratch memory and the per-thread Scratch every work item runs in: 64-byte aligned fp32
// buffers (the bf16 ones used by halves), kept for the thread's life and grown on demand. A header
// of its own because the walk (which fills the buffers) and the parallel region (which hands each
// thread its Scratch) both need it, and neither needs the other.
//
// Only cpu_attention.cpp includes this header: the kernel is one translation unit, and the
// anonymous namespace gives everything here the internal linkage it had when the kernel was one
// file (nothing exported beside the entry points, the optimiser free to inline and drop as before).

#pragma once

#include "kernel_config.h"
#include "scale_row_memo.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace {

// ---- aligned scratch --------------------------------------------------------------------------

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float, FreeDeleter>;

Buffer alloc(int64_t n) {
  const size_t bytes = ((static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float) + 63) / 64) * 64;
  float* p = static_cast<float*>(std::aligned_alloc(64, bytes));
  QFA_CHECK(p != nullptr, "qfa native attention: out of memory allocating ", bytes, " bytes of scratch");
  return Buffer(p);
}

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
  ScaleRowMemo vmemo;  // MXFP8: the last V scale row this thread expanded
  bool few_bf16 = false;  // the item's few-row blocks run bf16 dot products (load_q decides)
  alignas(64) int16_t pair_step[kMaxScaledDim];  // (bf16 V pairs: the first key's steps, across two rows)
  // A split chunk's scores, kept from its pass 1 for its pass 2 (n floats; grown on demand).
  Buffer kept;
  int64_t kept_floats = 0;
  float* keep(int64_t n) {
    if (n > kept_floats) {
      kept_floats = 0;
      kept = alloc(n);
      kept_floats = n;
    }
    return kept.get();
  }
};

inline Scratch& thread_scratch() {
  thread_local Scratch sc;
  return sc;
}

}  // namespace
