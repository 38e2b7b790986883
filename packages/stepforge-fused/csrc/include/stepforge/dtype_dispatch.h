// SPDX-License-Identifier: Apache-2.0
// The one dtype dispatch of the CPU and CUDA kernels: a dtype code of the kernel contract (stepforge::DType,
// passed explicitly by the caller, never inferred from data) selects the storage type T for the statement(s)
// that follow. The 16-bit storage types are the backend's own (CPU: stepforge::half_t / bf16_t; CUDA: __half /
// __nv_bfloat16); ON_UNKNOWN runs for any other code (the host side has validated codes before).
//
//   STEPFORGE_DISPATCH_DTYPE(code, T, half_t, bf16_t, return, run<T>(args))
#pragma once

#include "stepforge/common.h"

#define STEPFORGE_DISPATCH_DTYPE(code, T, HALF_T, BF16_T, ON_UNKNOWN, ...) \
  switch (code) {                                                          \
    case ::stepforge::kFloat32: {                                          \
      using T = float;                                                     \
      __VA_ARGS__;                                                         \
      break;                                                               \
    }                                                                      \
    case ::stepforge::kFloat16: {                                          \
      using T = HALF_T;                                                    \
      __VA_ARGS__;                                                         \
      break;                                                               \
    }                                                                      \
    case ::stepforge::kBFloat16: {                                         \
      using T = BF16_T;                                                    \
      __VA_ARGS__;                                                         \
      break;                                                               \
    }                                                                      \
    default:                                                               \
      ON_UNKNOWN;                                                          \
  }
