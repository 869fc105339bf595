// ScaleRowMemo: one thread's last expanded MXFP8 V scale row. A header of its own because the
// thread's Scratch holds one and the decoder (kv_decoder.h) fills it, and neither of those
// headers needs the other.
//
// Only cpu_attention.cpp includes this header (see kernel_config.h: one translation unit,
// internal linkage).

#pragma once

#include "kernel_config.h"

#include <cstdint>

namespace {

// The most elements a scaled row may hold (quant_mode 1's head dims go up to 256).
constexpr int64_t kMaxScaledDim = 256;

// V's scales cover 32 keys and the few-row kernels decode 8 keys a call: expanding the row
// (128 table lookups) on every call cost a quarter of MXFP8's decode. Keyed by the row's
// address and the KvSrc's id (a fresh one per KvSrc of every call), so a row rewritten
// between calls is never reused.
struct ScaleRowMemo {
  const uint8_t* sp = nullptr;
  uint64_t call_id = 0;
  bool finite = true;    // no NaN scale in the row
  bool liftable = true;  // every scale times the E4M3 route's 2^8 is finite (the plan's cap: 2^119)
  alignas(64) float fs[kMaxScaledDim];
  alignas(64) float lifted[kMaxScaledDim];  // fs times Decoder::kE4m3Lift
  // (e - 127) << 7 of each scale code e: what times 2^(e - 127) adds to a bf16 word's bits (the
  // bf16 few-row kernels; meaningless for a NaN scale, where finite is false)
  alignas(64) int16_t step[kMaxScaledDim];
  int min_code = 0;  // the row's least scale code (bf16 needs MIN_BF16_E8M0 at least) ...
  int max_code = 0;  // ... and its largest but NaN's (the exponent moves stay below Inf)
};

constexpr int kE8m0Bias = 127, kBf16ExpShift = 7;  // E8M0's exponent bias; bf16's exponent field's place
inline int16_t e8m0_step(int code) { return static_cast<int16_t>((code - kE8m0Bias) << kBf16ExpShift); }

}  // namespace
