// The Python module of the native attention kernel (qfa/attention/backends/cpu_kernel.py): the
// entry points of cpu_attention.cpp as the functions of a plain CPython extension module.
//
// Why not a pybind11 module: <pybind11/pybind11.h> and the 14 m.def bindings cost as much CPU in
// a cold build as the whole kernel (about 10 s each on the 2-core Zen 4, and a newcomer's first
// call waits for the build); this file compiles in a third of that. It takes pybind11's casters
// for the int, float, bool and tensor arguments (<pybind11/cast.h>; the tensor one is torch's,
// exported from libtorch_python and declared below as torch/csrc/utils/pybind.h declares it),
// converts sequences of ints, str and the results as pybind11's stl and str casters did, and
// raises C++ errors as torch's pybind11 translator did (torch::translate_exception_to_python:
// TORCH_CHECK is a RuntimeError with the message alone). A second source, so it compiles beside
// the kernel; the kernel's code is not here, so nothing in this file can change one of its bits.
//
// The declarations are the definitions' signatures: one that differs leaves an undefined symbol,
// and the module fails to import (the op then runs the torch path and says so).
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <pybind11/cast.h>
#include <torch/csrc/Export.h>

#include <cstdint>
#include <exception>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

void forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::vector<int64_t> strides,
             at::Tensor& out, std::vector<int64_t> out_strides, at::Tensor& lse, std::vector<int64_t> lse_strides,
             int64_t heads_kv, int64_t group, int64_t dim, int64_t block_n, std::vector<int64_t> q_starts,
             std::vector<int64_t> kv_starts, std::vector<int64_t> q_lens, std::vector<int64_t> kv_lens, bool causal,
             double dscale, double ln_p, double v_descale, const at::Tensor& decode_table,
             std::vector<int64_t> round_consts, int64_t tile_rows, int64_t split_rows, int64_t chunk_blocks, int64_t predecode_bytes,
             int64_t store_bytes, const at::Tensor& block_table, int64_t block_size, bool bf16, bool fill,
             int64_t quant_mode, const at::Tensor& e8m0_table, const at::Tensor& q_scale,
             std::vector<int64_t> q_scale_strides, const at::Tensor& k_scale, std::vector<int64_t> k_scale_desc,
             const at::Tensor& v_scale, std::vector<int64_t> v_scale_desc, std::vector<int64_t> v_scale_starts,
             const at::Tensor& v_descale_heads);
std::tuple<at::Tensor, bool> decode_codes(const at::Tensor& codes, const at::Tensor& decode_table, bool simd, bool e4m3);
std::tuple<at::Tensor, bool> decode_e4m3_codes(const at::Tensor& codes, const at::Tensor& decode_table, bool simd);
bool simd_e4m3_decoder(const at::Tensor& decode_table);
at::Tensor round_p_e4m3(const at::Tensor& x, bool simd, bool bf16);
int64_t vec_width();
at::Tensor round_p(const at::Tensor& x, std::vector<int64_t> round_consts, bool simd);
bool simd_decoder(const at::Tensor& decode_table);
std::tuple<std::string, int64_t> last_region();
std::vector<std::string> last_paths_names();
int64_t last_regions();
bool has_bf16_dot();
std::vector<std::string> peak_kinds();
double peak_gflops(const std::string& kind, int64_t threads, double seconds);

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
               kSimdE4m3Decoder[] = "simd_e4m3_decoder", kRoundPE4m3[] = "round_p_e4m3", kVecWidth[] = "vec_width",
               kRoundP[] = "round_p", kSimdDecoder[] = "simd_decoder", kLastRegion[] = "last_region",
               kLastPaths[] = "last_paths", kLastRegions[] = "last_regions", kHasBf16Dot[] = "has_bf16_dot",
               kPeakKinds[] = "peak_kinds", kPeakGflops[] = "peak_gflops", kForward[] = "forward";

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
    method<&simd_e4m3_decoder, kSimdE4m3Decoder>("whether the SIMD E4M3 decoder runs for this table (tests)"),
    method<&round_p_e4m3, kRoundPE4m3>("E4M3 rounding of P with the kernel's code (tests)"),
    method<&vec_width, kVecWidth>("fp32 lanes of the build's vectors (head dims are a multiple)"),
    method<&round_p, kRoundP>("HiF8 rounding of P with the kernel's code (tests)"),
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
