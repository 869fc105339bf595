// The seam between the kernel (cpu_attention.cpp, which includes no ATen header) and its Python
// module (cpu_attention_bindings.cpp, which reads the tensors): the call's arguments as plain
// pointers, lengths and scalars, the kernel's entry points on them, and the one thing the kernel
// asks of torch, a GEMM for the head dims its register tiles do not take. Two sources because
// torch's headers were half of the kernel's cold build; ninja compiles the two on two cores.
//
// Plain C++ (standard library only), included by both sources.

#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace qfa_kernel {

// forward's arguments (see qfa/attention/backends/cpu_kernel.py for each): the tensors as their
// data (the bindings checked their dtypes and shapes), the rest as given.
struct ForwardArgs {
  const uint8_t *q = nullptr, *k = nullptr, *v = nullptr;
  std::vector<int64_t> strides;      // q, k, v: 4 each
  int16_t* out_bf16 = nullptr;       // out: one of the two
  float* out_f32 = nullptr;
  std::vector<int64_t> out_strides;  // 4
  float* lse = nullptr;              // null: no lse
  std::vector<int64_t> lse_strides;  // 3
  int64_t heads_kv = 0, group = 0, dim = 0, block_n = 0;
  std::vector<int64_t> q_starts, kv_starts, q_lens, kv_lens;
  bool causal = false;
  double dscale = 0, ln_p = 0, v_descale = 0;
  const float* decode_table = nullptr;  // 256 fp32
  std::vector<int64_t> round_consts;
  int64_t tile_rows = 0, split_rows = 0, chunk_blocks = 0, predecode_bytes = 0, store_bytes = 0;
  const int32_t* block_table = nullptr;  // null: K / V not paged
  int64_t block_table_stride = 0, block_size = 0;
  bool bf16 = false;
  int64_t quant_mode = 0;
  // mode 1: E8M0 bytes and the E8M0 table; mode 6: fp32 q / k scales and v per head.
  const float* e8m0_table = nullptr;
  const void* q_scale = nullptr;
  std::vector<int64_t> q_scale_strides;
  const void* k_scale = nullptr;
  std::vector<int64_t> k_scale_desc;
  const uint8_t* v_scale = nullptr;
  std::vector<int64_t> v_scale_desc, v_scale_starts;
  const float* v_descale_heads = nullptr;  // heads_kv values (mode 6)
  // The drop-in's epilogue (rotate_c != 0): out_rotated receives H bf16(O / l) of every row in a
  // float dtype (row_rotation.h's Dtype codes; finite values beyond it saturate), the output the
  // drop-in's un-rotation pass would make of out; out_bf16 / out_f32 are then not written. Needs
  // dim 128 and rows contiguous along it.
  void* out_rotated = nullptr;
  int64_t rotated_dtype = 0;
  double rotate_c = 0;
  // MXFP8: the least E8M0 scale code for which bf16 dot products are exact (MIN_BF16_E8M0). The
  // host checks every scale against it when a call has many-row blocks (bf16 then means they
  // passed); few-row blocks check the scales they read, and run fp32 where one is below it.
  int64_t min_bf16_e8m0 = 0;
  int64_t threads = 1;   // torch.get_num_threads()
  bool nested = false;   // called inside a parallel region (at::in_parallel_region())
};

void forward(const ForwardArgs& a);

// The tests' probes (cpu_attention_bindings.cpp wraps them for tensors).
bool decode_codes(const uint8_t* codes, int64_t n, const float* decode_table, bool simd, bool e4m3, float* out);
bool decode_codes_bf16(const uint8_t* codes, int64_t n, const float* decode_table, bool simd, bool e4m3, uint16_t* out);
std::string decoder_kind(const float* decode_table, bool e4m3);
bool simd_decoder(const float* decode_table, bool e4m3);
void round_p(float* x, int64_t n, const std::vector<int64_t>& round_consts, bool simd, bool bf16);
void round_p_e4m3(float* x, int64_t n, bool simd, bool bf16);
bool dot_sums16(const float* x, float* out);

// C (m x n, row stride ldc) = A (m x k, lda) @ B, with B (k x n, ldb), or B^T with B (n x k, ldb)
// when b_transposed: torch's mm (MKL where torch has it), on the calling thread. Defined in
// cpu_attention_bindings.cpp.
void host_mm(float* c, int64_t ldc, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t m, int64_t n,
             int64_t k, bool b_transposed);

}  // namespace qfa_kernel

// The kernel's plain entry points, as the module exposes them.
int64_t vec_width();
std::tuple<std::string, int64_t> last_region();
std::vector<std::string> last_paths_names();
int64_t last_regions();
bool has_bf16_dot();
std::vector<std::string> peak_kinds();
double peak_gflops(const std::string& kind, int64_t threads, double seconds);
