// SPDX-License-Identifier: Apache-2.0
//
// Pieces shared by the update kernels (Adam, LAMB, SGD): kernel-argument block, dtype dispatch, the
// finite-check pre-pass, per-tensor bias corrections and the host-side launch preamble.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "multi_tensor.cuh"
#include "stepforge/common.h"
#include "stepforge/dtype_dispatch.h"
#include "runtime.cuh"

namespace stepforge::cuda {

// Everything an update kernel reads besides its hyper-parameters. Passed by value (about 100 bytes).
struct UpdateArgs {
  const TensorRow* rows;
  std::int64_t n_rows;
  std::int64_t total_chunks;
  const float* skip_flag;   // non-zero -> return at once (found_inf, or the internal finite-check flag)
  double lr;
  const float* lr_ptr;      // device lr (CUDA-graph capture) or nullptr
  double grad_div;
  const float* grad_div_ptr;  // further device divisor (e.g. a clip factor computed on the device) or nullptr
  int copy_dtype;           // kNoDType: no param copy (list kCopy)
  bool sr;
  std::uint64_t seed;
  bool write_grads;         // store the unscaled grad back into list kG (when the divisor is not 1)
  // Step per tensor: TensorRow::step (device float32 counter) if set, else steps[row] (host steps, uploaded
  // when they differ between tensors), else the uniform `step`.
  const std::int64_t* steps;
  std::int64_t step;
};

__device__ __forceinline__ double load_lr(const UpdateArgs& a) {
  return a.lr_ptr ? static_cast<double>(*a.lr_ptr) : a.lr;
}

__device__ __forceinline__ double load_div(const UpdateArgs& a) {
  return a.grad_div_ptr ? a.grad_div * static_cast<double>(*a.grad_div_ptr) : a.grad_div;
}

__device__ __forceinline__ long long row_step(const UpdateArgs& a, const TensorRow& r, std::int64_t row) {
  if (r.step != 0) return static_cast<long long>(*reinterpret_cast<const float*>(r.step));
  if (a.steps != nullptr) return a.steps[row];
  return a.step;
}

// The shared dtype dispatch (stepforge/dtype_dispatch.h) with the CUDA storage types.
#define SF_DISPATCH_DTYPE(code, T, ...)                                                                   \
  STEPFORGE_DISPATCH_DTYPE(code, T, __half, __nv_bfloat16,                                               \
                           throw std::invalid_argument("unknown dtype code " + std::to_string(code)), \
                           __VA_ARGS__)

// Host: device index, stream, validation and the per-call argument block (table upload, scratch flag,
// per-tensor bias corrections, finite-check pre-pass). Defined in update_common.cu.
struct Prepared {
  UpdateArgs args;
  cudaStream_t stream;
  bool empty;                  // nothing to do (no elements)
  float* internal_flag;        // the finite-check flag when the caller gave no found_inf, else nullptr
};

Prepared prepare_update(std::vector<TensorRow>& rows, const int* required, int n_required, int g_dtype,
                        const Common& common, double lr, const std::vector<std::int64_t>* host_steps,
                        int copy_dtype, Launch& launch);

// Releases the transient per-call buffers (stream-ordered) after the update kernels were queued; returns the
// launcher result (kSkipOnDevice, or 0/1 read back from the internal finite-check flag).
int finish_update(Prepared& prep);

}  // namespace stepforge::cuda
