// The Python module of the native attention kernel (qfa/attention/backends/cpu_kernel.py): the
// entry points of cpu_attention.cpp as the functions of a plain CPython extension module, and
// the tensors read for it. The kernel's file includes no ATen header (kernel_api.h is the seam):
// here the tensors are checked and handed over as pointers, lengths and torch's thread count,
// and torch's mm serves the kernel's GEMMs for head dims its tiles do not take (host_mm).
//
// Why not a pybind11 module: <pybind11/pybind11.h> and the 14 m.def bindings cost as much CPU in
// a cold build as the whole kernel (about 10 s each on the 2-core Zen 4, and a newcomer's first
// call waits for the build); this file compiles in a third of that. It takes pybind11's casters
// for the int, float, bool and tensor arguments (<pybind11/cast.h>; the tensor one is torch's,
// exported from libtorch_python and declared below as torch/csrc/utils/pybind.h declares it),
// converts sequences of ints, str and the results as pybind11's stl and str casters did, and
// raises C++ errors as torch's pybind11 translator did (torch::translate_exception_to_python:
// TORCH_CHECK is a RuntimeError with the message alone, and so is the kernel's own QFA_CHECK, a
// std::runtime_error). A second source, so it compiles beside the kernel. The kernel's code is
// not here; what this file computes is torch's own: host_mm's GEMM (torch's mm, which the kernel
// called before) and fill's zeros and infinities. Cold build on the Zen 3 EPYC (2026-12-03),
// each file compiled alone: this one 5.9 s, the kernel's 5.8 s, where the kernel's took 12.0 s
// with torch's vector and tensor headers.
//
// kernel_api.h's declarations are the definitions' signatures: one that differs leaves an
// undefined symbol, and the module fails to import (the op then runs the torch path and says so).
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <pybind11/cast.h>
#include <torch/csrc/Export.h>

#include "kernel_api.h"

#include <algorithm>
#include <cstring>

#include <cstdint>
#include <exception>
#include <string>
#include <tuple>
#include <type_traits>
#include <limits>
#include <utility>
#include <vector>

// torch's (libtorch_python), as its headers declare them.
namespace pybind11::detail {
template <>
struct TORCH_PYTHON_API type_caster<at::Tensor> {
 public:
  // NOLINTNEXTLINE(cppcoreguidelines-non-private-member-variables-in-classes)
  PYBIND11_TYPE_CASTER(at::Tensor, _("torch.Tensor"));

  bool load(handle src, bool /*unused*/);

  static handle cast(
      const at::Tensor& src,
      return_value_policy /* policy */,
      handle /* parent */);
};
}  // namespace pybind11::detail

namespace torch {
TORCH_PYTHON_API void translate_exception_to_python(const std::exception_ptr& /*e_ptr*/);
}  // namespace torch

// ---- the tensors: checked here, handed to the kernel as plain data (kernel_api.h) ---------------

void qfa_kernel::host_mm(float* c, int64_t ldc, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t m,
                         int64_t n, int64_t k, bool b_transposed) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor C = at::from_blob(c, {m, n}, {ldc, 1}, f32);
  at::Tensor A = at::from_blob(const_cast<float*>(a), {m, k}, {lda, 1}, f32);
  at::Tensor B = b_transposed ? at::from_blob(const_cast<float*>(b), {n, k}, {ldb, 1}, f32).t()
                              : at::from_blob(const_cast<float*>(b), {k, n}, {ldb, 1}, f32);
  // mm_out(C, A, B) is addmm with beta 0 and alpha 1 into C, the call below (Tensor's method:
  // <ATen/ops/mm.h> with its context headers cost 3 s of this file's cold build).
  C.addmm_(A, B, 0, 1);
}

namespace {

void check_table(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.numel() == 256 && t.is_contiguous(), name, ": 256 contiguous fp32 values");
}

// A wrapper without memory of its own (a torch.func.functionalize tensor) has a data pointer of
// 0: refused, where the kernel would read or write address 0. So is a tensor whose values are not
// its memory's (a negative or conjugate view: its bytes hold the values before the flip).
void has_memory(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.numel() == 0 || t.data_ptr() != nullptr, name,
              ": a tensor with memory of its own, got one without (a torch.func transform's wrapper?)");
  TORCH_CHECK(!t.is_neg() && !t.is_conj(), name,
              ": a tensor whose memory holds its values, got a negative or conjugate view (resolve_neg() it)");
}

// The bytes of a tensor of 8-bit codes: uint8, or the float8 dtypes whose codes the kernel reads
// as bytes (E4M3 elements, E8M0 scales). Taken as they come: a Python view to uint8 per tensor
// was a quarter of a mode 1 call's host-side ATen calls.
const uint8_t* code_bytes(const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kByte || st == at::ScalarType::Float8_e4m3fn || st == at::ScalarType::Float8_e8m0fnu, name,
              ": uint8, float8_e4m3fn or float8_e8m0fnu codes, got ", st);
  has_memory(t, name);
  return static_cast<const uint8_t*>(t.data_ptr());
}

// See qfa/attention/backends/cpu_kernel.py for the arguments.
void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::vector<int64_t> strides,
             at::Tensor& out, std::vector<int64_t> out_strides, at::Tensor& lse, std::vector<int64_t> lse_strides,
             int64_t heads_kv, int64_t group, int64_t dim, int64_t block_n, std::vector<int64_t> q_starts,
             std::vector<int64_t> kv_starts, std::vector<int64_t> q_lens, std::vector<int64_t> kv_lens, bool causal,
             double dscale, double ln_p, double v_descale, const at::Tensor& decode_table,
             std::vector<int64_t> round_consts, int64_t tile_rows, int64_t split_rows, int64_t chunk_blocks,
             int64_t predecode_bytes, int64_t store_bytes, const at::Tensor& block_table, int64_t block_size, bool bf16,
             bool fill, int64_t quant_mode, const at::Tensor& e8m0_table, const at::Tensor& q_scale,
             std::vector<int64_t> q_scale_strides, const at::Tensor& k_scale, std::vector<int64_t> k_scale_desc,
             const at::Tensor& v_scale, std::vector<int64_t> v_scale_desc, std::vector<int64_t> v_scale_starts,
             const at::Tensor& v_descale_heads, double rotate_c, int64_t min_bf16_e8m0) {
  // rotate_c != 0: out is the drop-in's output in its own dtype (ForwardArgs::out_rotated)
  TORCH_CHECK(out.dtype() == at::kBFloat16 || out.dtype() == at::kFloat || (rotate_c != 0 && out.dtype() == at::kHalf),
              rotate_c != 0 ? "out must be fp32, bf16 or fp16" : "out must be bf16 (or fp32)");
  TORCH_CHECK(lse.dtype() == at::kFloat, "lse must be fp32");
  check_table(decode_table, "decode_table");
  qfa_kernel::ForwardArgs a;
  a.q = code_bytes(q, "q"); a.k = code_bytes(k, "k"); a.v = code_bytes(v, "v");
  has_memory(out, "out");
  has_memory(lse, "lse");
  a.strides = std::move(strides);
  if (fill) {
    // A fresh out / lse: 0 and +inf for the rows no batch owns, set here on the calling thread. A
    // torch fill just before the call runs on torch's OpenMP team, whose worker then spins for
    // milliseconds on the core this call's pool thread needs (a fifth of a B = 8 decode call).
    TORCH_CHECK(out.is_contiguous() && lse.is_contiguous(), "fill: out and lse must be contiguous");
    if (out.numel()) std::memset(out.data_ptr(), 0, out.numel() * out.element_size());
    if (lse.numel()) std::fill(lse.data_ptr<float>(), lse.data_ptr<float>() + lse.numel(),
                               std::numeric_limits<float>::infinity());
  }
  if (rotate_c != 0) {
    a.out_rotated = out.data_ptr();
    a.rotated_dtype = out.dtype() == at::kFloat ? 0 : out.dtype() == at::kBFloat16 ? 1 : 2;  // row_rotation.h's Dtype
    a.rotate_c = rotate_c;
  } else if (out.dtype() == at::kBFloat16) {
    a.out_bf16 = reinterpret_cast<int16_t*>(out.data_ptr<at::BFloat16>());
  } else {
    a.out_f32 = out.data_ptr<float>();
  }
  a.out_strides = std::move(out_strides);
  a.lse = lse.numel() ? lse.data_ptr<float>() : nullptr;
  a.lse_strides = std::move(lse_strides);
  a.heads_kv = heads_kv; a.group = group; a.dim = dim; a.block_n = block_n;
  a.q_starts = std::move(q_starts); a.kv_starts = std::move(kv_starts);
  a.q_lens = std::move(q_lens); a.kv_lens = std::move(kv_lens);
  a.causal = causal; a.dscale = dscale; a.ln_p = ln_p; a.v_descale = v_descale;
  a.decode_table = decode_table.data_ptr<float>();
  a.round_consts = std::move(round_consts);
  a.tile_rows = tile_rows; a.split_rows = split_rows; a.chunk_blocks = chunk_blocks;
  a.predecode_bytes = predecode_bytes; a.store_bytes = store_bytes;
  if (block_table.numel()) {  // paged K/V, read in place (the planner checked the table's values)
    TORCH_CHECK(block_table.dtype() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1 &&
                block_size > 0, "block_table: int32 (B, blocks) with unit stride along a row, and block_size > 0");
    a.block_table = block_table.data_ptr<int32_t>();
    a.block_table_stride = block_table.stride(0);
    a.block_size = block_size;
  }
  a.bf16 = bf16;
  a.quant_mode = quant_mode;
  if (quant_mode == 6) {
    TORCH_CHECK(q_scale.dtype() == at::kFloat && k_scale.dtype() == at::kFloat && v_descale_heads.dtype() == at::kFloat &&
                v_descale_heads.numel() == heads_kv && v_descale_heads.is_contiguous() &&
                q_scale_strides.size() == 2 && k_scale_desc.size() == 3, "mode 6 scales: fp32 tensors and their strides");
    has_memory(q_scale, "q_scale");
    has_memory(k_scale, "k_scale");
    has_memory(v_descale_heads, "v_descale");
    a.q_scale = q_scale.data_ptr<float>();
    a.k_scale = k_scale.data_ptr<float>();
    a.v_descale_heads = v_descale_heads.data_ptr<float>();
  } else if (quant_mode == 1) {
    TORCH_CHECK(q_scale_strides.size() == 2 && k_scale_desc.size() == 7 && v_scale_desc.size() == 7 &&
                v_scale_starts.size() == a.kv_starts.size(), "mode 1 scales: E8M0 tensors and their layout");
    check_table(e8m0_table, "e8m0_table");
    a.e8m0_table = e8m0_table.data_ptr<float>();
    a.q_scale = code_bytes(q_scale, "q_scale");
    a.k_scale = code_bytes(k_scale, "k_scale");
    a.v_scale = code_bytes(v_scale, "v_scale");
  }
  a.q_scale_strides = std::move(q_scale_strides);
  a.k_scale_desc = std::move(k_scale_desc);
  a.v_scale_desc = std::move(v_scale_desc);
  a.v_scale_starts = std::move(v_scale_starts);
  a.min_bf16_e8m0 = min_bf16_e8m0;
  // What at::parallel_for reads to choose its team: torch's thread count, and whether the call
  // is already inside a parallel region (then it runs on its caller alone).
  a.threads = at::get_num_threads();
  a.nested = at::in_parallel_region();
  qfa_kernel::forward(a);
}

// The kernel's decoder on its own, for the tests: fp32 values of a 1-D uint8 tensor of codes (the
// SIMD body and the scalar tail both run), and whether all are finite.
std::tuple<at::Tensor, bool> decode_codes(const at::Tensor& codes, const at::Tensor& decode_table, bool simd,
                                          bool e4m3) {
  TORCH_CHECK(codes.dtype() == at::kByte && codes.dim() == 1 && codes.is_contiguous(), "codes: contiguous 1-D uint8");
  check_table(decode_table, "decode_table");
  at::Tensor out = codes.new_empty({codes.numel()}, at::TensorOptions().dtype(at::kFloat));
  const bool finite = qfa_kernel::decode_codes(codes.data_ptr<uint8_t>(), codes.numel(), decode_table.data_ptr<float>(),
                                               simd, e4m3, out.data_ptr<float>());
  return {out, finite};
}

// The same to bf16 words (int16), and whether all are finite.
std::tuple<at::Tensor, bool> decode_bf16_codes(const at::Tensor& codes, const at::Tensor& decode_table, bool simd,
                                               bool e4m3) {
  TORCH_CHECK(codes.dtype() == at::kByte && codes.dim() == 1 && codes.is_contiguous(), "codes: contiguous 1-D uint8");
  check_table(decode_table, "decode_table");
  at::Tensor out = codes.new_empty({codes.numel()}, at::TensorOptions().dtype(at::kShort));
  const bool finite = qfa_kernel::decode_codes_bf16(codes.data_ptr<uint8_t>(), codes.numel(),
                                                    decode_table.data_ptr<float>(), simd, e4m3,
                                                    reinterpret_cast<uint16_t*>(out.data_ptr<int16_t>()));
  return {out, finite};
}

std::string decoder_kind(const at::Tensor& decode_table, bool e4m3) {
  check_table(decode_table, "decode_table");
  return qfa_kernel::decoder_kind(decode_table.data_ptr<float>(), e4m3);
}

std::tuple<at::Tensor, bool> decode_e4m3_codes(const at::Tensor& codes, const at::Tensor& decode_table, bool simd) {
  return decode_codes(codes, decode_table, simd, true);
}

bool simd_decoder(const at::Tensor& decode_table) {
  check_table(decode_table, "decode_table");
  return qfa_kernel::simd_decoder(decode_table.data_ptr<float>(), false);
}

bool simd_e4m3_decoder(const at::Tensor& decode_table) {
  check_table(decode_table, "decode_table");
  return qfa_kernel::simd_decoder(decode_table.data_ptr<float>(), true);
}

// P's roundings on their own, for the tests: a rounded copy of a 1-D fp32 tensor.
at::Tensor round_p(const at::Tensor& x, std::vector<int64_t> round_consts, bool simd, bool bf16) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 1, "x: 1-D fp32");
  at::Tensor out = x.contiguous().clone();
  qfa_kernel::round_p(out.data_ptr<float>(), out.numel(), round_consts, simd, bf16);
  return out;
}

at::Tensor round_p_e4m3(const at::Tensor& x, bool simd, bool bf16) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 1, "x: 1-D fp32");
  at::Tensor out = x.contiguous().clone();
  qfa_kernel::round_p_e4m3(out.data_ptr<float>(), out.numel(), simd, bf16);
  return out;
}

// The few-row S's sums of 16 rows of 16 fp32 lanes (a contiguous (16, 16) fp32 tensor), for the
// tests; an empty tensor where the build's S has no 16-lane sums.
at::Tensor dot_sums16(const at::Tensor& x) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(0) == 16 && x.size(1) == 16 && x.is_contiguous(),
              "x: contiguous (16, 16) fp32");
  at::Tensor out = x.new_empty({16});
  if (!qfa_kernel::dot_sums16(x.data_ptr<float>(), out.data_ptr<float>())) return x.new_empty({0});
  return out;
}

}  // namespace

namespace {

namespace py = pybind11;

// One argument, converted as pybind11 converted it (its casters, conversions allowed).
template <typename T>
struct Arg {
  py::detail::make_caster<T> caster;
  bool load(PyObject* o) { return caster.load(py::handle(o), true); }
  T& get() { return py::detail::cast_op<T&>(caster); }
};

// pybind11's list caster (in <pybind11/stl.h>, which includes all of pybind11): any sequence
// but str and bytes, each item an int as the int caster takes it.
template <>
struct Arg<std::vector<int64_t>> {
  std::vector<int64_t> value;
  bool load(PyObject* o) {
    if (!PySequence_Check(o) || PyBytes_Check(o) || PyUnicode_Check(o)) return false;
    const Py_ssize_t n = PySequence_Size(o);
    if (n < 0) {
      PyErr_Clear();
      return false;
    }
    value.clear();
    value.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = PySequence_GetItem(o, i);
      if (item == nullptr) {
        PyErr_Clear();
        return false;
      }
      py::detail::make_caster<int64_t> conv;
      const bool ok = conv.load(py::handle(item), true);
      Py_DECREF(item);
      if (!ok) return false;
      value.push_back(py::detail::cast_op<int64_t>(conv));
    }
    return true;
  }
  std::vector<int64_t>& get() { return value; }
};

// pybind11's str caster (not used: it refers to pybind11's error type, whose code is in
// <pybind11/pybind11.h>): str as UTF-8, or bytes.
template <>
struct Arg<std::string> {
  std::string value;
  bool load(PyObject* o) {
    if (PyBytes_Check(o)) {
      value.assign(PyBytes_AS_STRING(o), static_cast<size_t>(PyBytes_GET_SIZE(o)));
      return true;
    }
    if (!PyUnicode_Check(o)) return false;
    Py_ssize_t n = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(o, &n);
    if (utf8 == nullptr) {
      PyErr_Clear();
      return false;
    }
    value.assign(utf8, static_cast<size_t>(n));
    return true;
  }
  std::string& get() { return value; }
};

bool set_item(PyObject* tuple, Py_ssize_t i, PyObject* item) {
  if (item == nullptr) return false;
  PyTuple_SET_ITEM(tuple, i, item);
  return true;
}

// The results, as pybind11 returned them: bool, int, float, str, tuple, list of str, torch.Tensor.
PyObject* result(bool b) { return PyBool_FromLong(b); }
PyObject* result(int64_t i) { return PyLong_FromLongLong(i); }
PyObject* result(double d) { return PyFloat_FromDouble(d); }
PyObject* result(const std::string& s) {
  return PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), nullptr);
}
PyObject* result(const at::Tensor& t) {
  return py::detail::type_caster<at::Tensor>::cast(t, py::return_value_policy::move, py::handle()).ptr();
}

PyObject* result(const std::vector<std::string>& names) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(names.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < names.size(); ++i) {
    PyObject* s = result(names[i]);
    if (s == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), s);
  }
  return list;
}

template <typename... T>
PyObject* result(const std::tuple<T...>& values) {
  PyObject* tuple = PyTuple_New(sizeof...(T));
  if (tuple == nullptr) return nullptr;
  bool ok = true;
  Py_ssize_t i = 0;
  std::apply([&](const auto&... v) { ((ok = ok && set_item(tuple, i++, result(v))), ...); }, values);
  if (!ok) {
    Py_DECREF(tuple);
    return nullptr;
  }
  return tuple;
}

// A by-value parameter takes the converted value over; a reference binds to it.
template <typename P, typename H>
decltype(auto) pass(H& h) {
  if constexpr (std::is_reference_v<P>) {
    return h.get();
  } else {
    return std::move(h.get());
  }
}

template <auto F, const char* Name>
struct Bind;

template <typename R, typename... P, R (*F)(P...), const char* Name>
struct Bind<F, Name> {
  static constexpr Py_ssize_t arity = sizeof...(P);

  // The positional arguments, already as many as F takes.
  template <size_t... I>
  static PyObject* invoke(PyObject* const* args, std::index_sequence<I...>) {
    try {
      std::tuple<Arg<std::decay_t<P>>...> held;
      Py_ssize_t bad = -1;
      ((bad < 0 && !std::get<I>(held).load(args[I]) ? (bad = static_cast<Py_ssize_t>(I)) : 0), ...);
      if (bad >= 0) {
        if (!PyErr_Occurred()) {
          PyErr_Format(PyExc_TypeError, "%s(): argument %zd has an incompatible type (%s)", Name, bad + 1,
                       Py_TYPE(args[bad])->tp_name);
        }
        return nullptr;
      }
      if constexpr (std::is_void_v<R>) {
        F(pass<P>(std::get<I>(held))...);
        Py_RETURN_NONE;
      } else {
        return result(F(pass<P>(std::get<I>(held))...));
      }
    } catch (...) {
      torch::translate_exception_to_python(std::current_exception());
      return nullptr;
    }
  }

  static PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t n) {
    if (n != arity) {
      PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", Name, arity, n);
      return nullptr;
    }
    return invoke(args, std::index_sequence_for<P...>{});
  }
};

constexpr char kDecodeCodes[] = "decode_codes", kDecodeE4m3Codes[] = "decode_e4m3_codes",
               kDecodeBf16Codes[] = "decode_bf16_codes", kDecoderKind[] = "decoder_kind",
               kSimdE4m3Decoder[] = "simd_e4m3_decoder", kRoundPE4m3[] = "round_p_e4m3", kVecWidth[] = "vec_width",
               kRoundP[] = "round_p", kSimdDecoder[] = "simd_decoder", kLastRegion[] = "last_region",
               kLastPaths[] = "last_paths", kLastRegions[] = "last_regions", kHasBf16Dot[] = "has_bf16_dot",
               kPeakKinds[] = "peak_kinds", kPeakGflops[] = "peak_gflops", kForward[] = "forward",
               kDotSums16[] = "dot_sums16";

// decode_codes(codes, decode_table, simd, e4m3=False), keywords allowed (its pybind11 binding
// named its arguments).
PyObject* decode_codes_py(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* const names[] = {"codes", "decode_table", "simd", "e4m3"};
  PyObject* all[4] = {nullptr, nullptr, nullptr, Py_False};
  bool given[4] = {false, false, false, false};
  if (nargs > 4) {
    PyErr_Format(PyExc_TypeError, "decode_codes() takes at most 4 arguments (%zd given)", nargs);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    all[i] = args[i];
    given[i] = true;
  }
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t j = 0; j < nkw; ++j) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, j);
    int slot = -1;
    for (int s = 0; s < 4; ++s) {
      if (PyUnicode_CompareWithASCIIString(key, names[s]) == 0) slot = s;
    }
    if (slot < 0 || given[slot]) {
      PyErr_Format(PyExc_TypeError, "decode_codes(): %s keyword argument '%U'", slot < 0 ? "unexpected" : "repeated",
                   key);
      return nullptr;
    }
    all[slot] = args[nargs + j];
    given[slot] = true;
  }
  for (int s = 0; s < 3; ++s) {
    if (!given[s]) {
      PyErr_Format(PyExc_TypeError, "decode_codes(): missing argument '%s'", names[s]);
      return nullptr;
    }
  }
  using B = Bind<&decode_codes, kDecodeCodes>;
  return B::invoke(all, std::make_index_sequence<4>{});
}

template <auto F, const char* Name>
PyMethodDef method(const char* doc) {
  return {Name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&Bind<F, Name>::call)), METH_FASTCALL,
          doc};
}

PyMethodDef methods[] = {
    {kDecodeCodes, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&decode_codes_py)),
     METH_FASTCALL | METH_KEYWORDS,
     "decode_codes(codes, decode_table, simd, e4m3=False): HiF8 codes to fp32 with the kernel's decoder (tests)"},
    method<&decode_e4m3_codes, kDecodeE4m3Codes>("E4M3 codes to fp32 with the kernel's decoder (tests)"),
    method<&decode_bf16_codes, kDecodeBf16Codes>("HiF8 / E4M3 codes to bf16 words with the kernel's decoder (tests)"),
    method<&decoder_kind, kDecoderKind>("which form of the decoder runs for this table here (tests)"),
    method<&simd_e4m3_decoder, kSimdE4m3Decoder>("whether the SIMD E4M3 decoder runs for this table (tests)"),
    method<&round_p_e4m3, kRoundPE4m3>("E4M3 rounding of P with the kernel's code (tests)"),
    method<&vec_width, kVecWidth>("fp32 lanes of the build's vectors (head dims are a multiple)"),
    method<&round_p, kRoundP>("HiF8 rounding of P with the kernel's code (tests)"),
    method<&dot_sums16, kDotSums16>("the few-row S's sums of 16 x 16 fp32 lanes, or an empty tensor (tests)"),
    method<&simd_decoder, kSimdDecoder>("whether the SIMD decoder runs for this table (tests)"),
    method<&last_region, kLastRegion>("the last region's team and the threads that entered it (tests)"),
    method<&last_paths_names, kLastPaths>("the kernels the last call's blocks ran (bench, tests)"),
    method<&last_regions, kLastRegions>("how many parallel regions the last call ran (tests)"),
    method<&has_bf16_dot, kHasBf16Dot>("whether this build has the bf16 dot-product kernels"),
    method<&peak_kinds, kPeakKinds>("the kinds peak_gflops measures in this build"),
    method<&peak_gflops, kPeakGflops>("GFLOP/s of independent FMA / bf16 dot chains on threads at once"),
    method<&forward, kForward>("quant_flash_attn torch backend on CPU (see qfa/attention/backends/cpu_kernel.py)"),
    {nullptr, nullptr, 0, nullptr},
};

#define QFA_STR2(x) #x
#define QFA_STR(x) QFA_STR2(x)

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, QFA_STR(TORCH_EXTENSION_NAME),
                          "qfa's native CPU attention kernel (see qfa/attention/backends/cpu_kernel.py)", -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

#define QFA_INIT2(name) PyInit_##name
#define QFA_INIT(name) QFA_INIT2(name)

PyMODINIT_FUNC QFA_INIT(TORCH_EXTENSION_NAME)() { return PyModule_Create(&module_def); }
