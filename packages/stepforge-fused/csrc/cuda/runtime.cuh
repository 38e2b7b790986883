// SPDX-License-Identifier: Apache-2.0
//
// Host-side helpers shared by the launchers: error checking, device selection, the device table cache and the
// per-stream scratch buffer. Implemented in runtime.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "launch_api.h"

namespace stepforge::cuda {

[[noreturn]] void throw_cuda(cudaError_t err, const char* what);

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw_cuda(err, what);
}

// Makes `launch.device` current for this thread's runtime (the module links its own static cudart, whose
// current device is independent of torch's) and returns the stream.
cudaStream_t prepare(const Launch& launch);

// Fills chunk_begin, returns the total number of chunks, and validates the rows (non-negative sizes, present
// pointers for the `required` lists). Throws std::invalid_argument with the offending row.
std::int64_t plan_rows(std::vector<TensorRow>& rows, const int* required, int n_required);

// Device copy of `rows`, cached by content per (device, stream): an unchanged table is not uploaded again, so
// a steady-state step issues no host-to-device copy at all (and a CUDA graph can capture the launch).
const TensorRow* device_table(const std::vector<TensorRow>& rows, const Launch& launch, cudaStream_t stream);

// Stream-ordered scratch of at least `bytes` bytes for (device, stream, slot); contents are undefined. Each
// slot is one independent buffer (slot 0: the finite-check flag; slot 1: reduction partials), reused by the
// next call on the same stream, which the stream orders after this one.
void* scratch(std::size_t bytes, const Launch& launch, cudaStream_t stream, int slot);

// Device index owning the first non-null pointer of `rows` (list `list`), when launch.device < 0.
void resolve_device(const std::vector<TensorRow>& rows, Launch& launch);

inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

}  // namespace stepforge::cuda
