// SPDX-License-Identifier: Apache-2.0
// The dtype codes of the kernel contract (csrc/README.md), the one definition for the CPU module, the CUDA
// kernels and both bindings (exported to Python as DTYPE_*). Plain constexpr, no CUDA or pybind11: nvcc uses
// these from device code through --expt-relaxed-constexpr, the host compilers as ordinary constants.
#pragma once

namespace stepforge {

// Never reorder or renumber: Python passes these integers.
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// "No such list" where a dtype code is optional (the CUDA launchers' low-precision param copy).
constexpr int kNoDType = -1;

// The codes with their names, for error messages of both modules.
constexpr const char* kDTypeCodesHelp = "0 (float32), 1 (float16) or 2 (bfloat16)";

constexpr bool is_dtype_code(int code) { return code == kFloat32 || code == kFloat16 || code == kBFloat16; }

// Bytes per element of a code; 0 for kNoDType (an absent list moves no bytes).
constexpr int dtype_bytes(int code) { return code < 0 ? 0 : (code == kFloat32 ? 4 : 2); }

}  // namespace stepforge
