// The per-call entry points of attention (the remembered calls in fused.cpp) as builtins of
// CPython's vectorcall convention (METH_FASTCALL | METH_KEYWORDS), not through pybind11's
// dispatcher, whose generic argument handling is code of its own that a call must fetch again
// where it has left the caches, as it has in a model between one attention layer and the next
// (docs/performance.md: the HuggingFace layer). Errors are turned into Python's as torch's own
// bindings turn them (HANDLE_TH_ERRORS).
#pragma once

#include <torch/extension.h>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstddef>
#include <optional>

namespace {

// The N arguments of a call in `names`' order, each passed by position or by name, all of them;
// false after setting a TypeError otherwise.
template <size_t N>
bool fast_arguments(const char* function, const char* const (&names)[N], PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames,
                    PyObject* (&found)[N]) {
  const Py_ssize_t positional = PyVectorcall_NARGS(nargs);
  if (positional > static_cast<Py_ssize_t>(N)) {
    PyErr_Format(PyExc_TypeError, "%s() takes %zu arguments (%zd given)", function, N, positional);
    return false;
  }
  for (size_t i = 0; i < N; ++i) found[i] = static_cast<Py_ssize_t>(i) < positional ? args[i] : nullptr;
  const Py_ssize_t named = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t j = 0; j < named; ++j) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, j);
    size_t i = 0;
    while (i < N && PyUnicode_CompareWithASCIIString(name, names[i]) != 0) ++i;
    if (i == N || found[i] != nullptr) {
      PyErr_Format(PyExc_TypeError, "%s() got %s argument %R", function, i == N ? "an unexpected" : "a repeated", name);
      return false;
    }
    found[i] = args[positional + j];
  }
  for (size_t i = 0; i < N; ++i) {
    if (found[i] == nullptr) {
      PyErr_Format(PyExc_TypeError, "%s() missing argument '%s'", function, names[i]);
      return false;
    }
  }
  return true;
}

// An int argument (not a bool) as int64; false after setting a TypeError or OverflowError otherwise.
bool fast_int(const char* function, const char* name, PyObject* x, int64_t& value) {
  if (!PyLong_Check(x) || PyBool_Check(x)) {
    PyErr_Format(PyExc_TypeError, "%s(): %s must be an int, got %s", function, name, Py_TYPE(x)->tp_name);
    return false;
  }
  const long long v = PyLong_AsLongLong(x);
  if (v == -1 && PyErr_Occurred()) return false;
  value = v;
  return true;
}

// A tensor argument (None too where `optional`); nullptr after setting a TypeError otherwise.
const at::Tensor* fast_tensor(const char* function, const char* name, PyObject* x, bool optional = false) {
  static const at::Tensor none;
  if (optional && x == Py_None) return &none;
  if (!THPVariable_Check(x)) {
    PyErr_Format(PyExc_TypeError, "%s(): %s must be a Tensor%s, got %s", function, name, optional ? " or None" : "", Py_TYPE(x)->tp_name);
    return nullptr;
  }
  return &THPVariable_Unpack(x);
}

// An undefined tensor (fast_tensor's None) as nullopt.
c10::optional<at::Tensor> optional_of(const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; }

// A builtin made from `def` (which must outlive the module), added to `module` under its name.
void add_fast(py::module_& module, PyMethodDef* def) {
  PyObject* function = PyCFunction_NewEx(def, nullptr, module.attr("__name__").ptr());
  if (function == nullptr) throw py::error_already_set();
  module.add_object(def->ml_name, py::reinterpret_steal<py::object>(function));
}

}  // namespace
