// SPDX-License-Identifier: Apache-2.0
// Conversion of a Python pointer list / int64 array argument (csrc/README.md, "Conventions") to a read-only
// int64 view: zero-copy for objects with a 1-D contiguous 8-byte integer buffer (array.array('q'), numpy
// int64), a copy for a list/tuple of ints, absent for None.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cpu/ops.h"

namespace stepforge::bindings {

namespace py = pybind11;

class I64Arg {
 public:
  I64Arg(py::handle obj, const char* name) {
    if (obj.is_none()) return;
    if (PyObject_CheckBuffer(obj.ptr()) && !PyBytes_Check(obj.ptr())) {
      info_ = std::make_unique<py::buffer_info>(py::reinterpret_borrow<py::buffer>(obj).request());
      const std::string& f = info_->format;
      const bool int8byte = info_->itemsize == 8 && (f == "q" || f == "l" || f == "Q" || f == "L" ||
                                                     f == "<q" || f == "<l" || f == "=q" || f == "=l");
      if (!int8byte || info_->ndim != 1 || (info_->size > 1 && info_->strides[0] != 8))
        throw py::value_error(std::string(name) +
                              ": expected a 1-D contiguous int64 buffer (array.array('q') or an int64 array), got "
                              "format '" + f + "' with ndim " + std::to_string(info_->ndim));
      view_.data = static_cast<const int64_t*>(info_->ptr);
      view_.size = info_->size;
      if (view_.data == nullptr) {
        static const int64_t kEmpty = 0;
        view_.data = &kEmpty;
      }
      return;
    }
    if (!py::isinstance<py::sequence>(obj) || py::isinstance<py::str>(obj))
      throw py::type_error(std::string(name) + ": expected a list of ints, an int64 buffer or None");
    py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
    copy_.reserve(seq.size());
    for (py::handle item : seq) copy_.push_back(item.cast<int64_t>());
    view_.data = copy_.empty() ? &kZero : copy_.data();
    view_.size = int64_t(copy_.size());
  }
  const stepforge::cpu::I64& view() const { return view_; }

 private:
  static constexpr int64_t kZero = 0;
  std::unique_ptr<py::buffer_info> info_;
  std::vector<int64_t> copy_;
  stepforge::cpu::I64 view_;
};

}  // namespace stepforge::bindings
