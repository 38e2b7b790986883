// SPDX-License-Identifier: Apache-2.0
//
// The CUDA module `stepforge.fused._cuda`: constants, diagnostics and the kernel functions registered by
// register_cuda_kernels.cpp (the bindings are the only translation units that see pybind11; the kernels in
// csrc/cuda/*.cu are reached through the plain C++ interface in csrc/cuda/launch_api.h).
// Function names, argument order and meaning follow csrc/README.md, the contract shared with `_cpu`; the
// trailing keyword-only arguments are CUDA extensions (device-side lr / divisor / steps for CUDA graphs,
// stochastic rounding, explicit device).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "../cuda/launch_api.h"
#include "stepforge/dtype_codes.h"

#ifndef STEPFORGE_CUDA_TOOLKIT_VERSION  // set by cmake/StepforgeCuda.cmake
#define STEPFORGE_CUDA_TOOLKIT_VERSION "unknown"
#endif

namespace py = pybind11;
namespace sc = stepforge::cuda;

namespace stepforge::bindings {
void register_cuda_kernels(py::module_& m);
}

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "stepforge-fused CUDA kernels (raw pointers; see csrc/README.md). Imports without a GPU; "
            "stepforge.fused._backend.cuda_status() says why it cannot run.";
  m.attr("DTYPE_FLOAT32") = int(stepforge::kFloat32);
  m.attr("DTYPE_FLOAT16") = int(stepforge::kFloat16);
  m.attr("DTYPE_BFLOAT16") = int(stepforge::kBFloat16);
  m.attr("CHUNK_SIZE") = sc::kChunk;
  m.attr("TOOLKIT_VERSION") = STEPFORGE_CUDA_TOOLKIT_VERSION;
  stepforge::bindings::register_cuda_kernels(m);

  m.def("available", &sc::available, "True when a CUDA device is usable from this module");
  m.def("device_count", &sc::device_count, "Number of CUDA devices (RuntimeError without a driver)");
  m.def("runtime_version", &sc::runtime_version, "Version of the statically linked CUDA runtime (e.g. 13000)");
  m.def("driver_version", &sc::driver_version, "CUDA driver version, 0 when no driver is loadable");
  m.def("built_archs", &sc::built_archs, "CMake CUDA architectures compiled in (e.g. ['80-real', '90-real', ...])");
  m.def("clear_table_cache", &sc::clear_table_cache, "Free the cached device launch tables");
  m.def("table_cache_size", &sc::table_cache_size, "Number of cached device launch tables");
  m.def("table_uploads", &sc::table_uploads, "Launch tables uploaded since import (unchanged lists are not)");
}
