// SPDX-License-Identifier: Apache-2.0
//
// Device-side multi-tensor machinery (the role of apex's multi_tensor_apply.cuh, built differently):
// - the per-tensor metadata lives in a device table (TensorRow[]), not in the kernel arguments, so a launch
//   covers any number of tensors and small tensors are not split across many launches;
// - one block per 16K-element chunk; a block finds its tensor through a chunk -> tensor map in the same table;
// - 64-bit indexing everywhere;
// - 4 elements per thread per iteration, loaded as one vector when every pointer of the row is aligned;
// - dtype conversion and (optional) stochastic rounding on store.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "launch_api.h"
#include "stepforge/common.h"

namespace stepforge::cuda {

constexpr int kThreads = 256;
constexpr int kIlp = 4;

// ---- dtype traits -------------------------------------------------------------------------------------------
template <typename T>
struct Vec4;  // the 4-element vector type used for aligned loads/stores
template <>
struct alignas(16) Vec4<float> {
  float v[4];
};
template <>
struct alignas(8) Vec4<__half> {
  __half v[4];
};
template <>
struct alignas(8) Vec4<__nv_bfloat16> {
  __nv_bfloat16 v[4];
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __ushort_as_half(::stepforge::float_to_half_bits(x));
}
// Rounding through the shared header (stepforge/common.h), so the CPU and CUDA modules store identical bits,
// NaN payloads included (bf16 NaN -> torch's canonical 0x7FC0).
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __ushort_as_bfloat16(::stepforge::float_to_bf16_bits(x));
}

// ---- stochastic rounding ------------------------------------------------------------------------------------
// Counter-based: the random bits are a hash of (seed, tensor, element), so results do not depend on the launch
// geometry and a CUDA graph replays with a new seed read from the caller's arguments.
__device__ __forceinline__ std::uint32_t mix32(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<std::uint32_t>(x);
}

// fp32 -> bf16 rounding up or down with probability proportional to the distance (unbiased in expectation).
__device__ __forceinline__ __nv_bfloat16 bf16_stochastic(float x, std::uint32_t rnd) {
  std::uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7f800000u) == 0x7f800000u) return __float2bfloat16_rn(x);  // inf / nan: no dithering
  bits += (rnd & 0xffffu);
  bits &= 0xffff0000u;
  return __float2bfloat16_rz(__uint_as_float(bits));
}

// ---- table lookup -------------------------------------------------------------------------------------------
// The device table is [TensorRow x n_rows][int32 chunk -> row map x total_chunks] (runtime.cu builds both once
// per distinct table), so a block finds its tensor with one broadcast load instead of a search.
__device__ __forceinline__ const std::int32_t* chunk_map(const TensorRow* rows, std::int64_t n_rows) {
  return reinterpret_cast<const std::int32_t*>(rows + n_rows);
}

// Block-uniform description of the piece of work a block does for one chunk.
struct ChunkWork {
  std::int64_t row;
  std::int64_t begin;  // first element of this chunk inside the tensor
  std::int64_t end;    // one past the last element
};

// The chunk's tensor and element range. Starts with a barrier, so block-shared values written by thread 0 for
// the previous chunk are no longer being read when the caller overwrites them for this one.
__device__ __forceinline__ ChunkWork chunk_work(const TensorRow* rows, std::int64_t n_rows, std::int64_t c) {
  __syncthreads();
  ChunkWork w;
  w.row = chunk_map(rows, n_rows)[c];
  const TensorRow& r = rows[w.row];
  w.begin = (c - r.chunk_begin) * kChunk;
  w.end = w.begin + kChunk < r.numel ? w.begin + kChunk : r.numel;
  return w;
}

// Whether the 4-element vector path is usable for a row: every present pointer aligned to 4 elements.
__device__ __forceinline__ bool row_aligned(const TensorRow& r, const int* elem_bytes, int n_lists) {
  bool ok = true;
  for (int l = 0; l < n_lists; ++l) {
    if (r.ptr[l] != 0 && elem_bytes[l] > 0) ok = ok && (r.ptr[l] % (4ull * elem_bytes[l]) == 0);
  }
  return ok;
}

// ---- element-group load/store -------------------------------------------------------------------------------
// Loads 4 consecutive elements starting at i (vector path: i is a multiple of 4 and i+3 < end) or the valid
// subset of them (scalar path); absent elements read as 0.
template <typename T>
__device__ __forceinline__ void load4(const void* base, std::int64_t i, std::int64_t end, bool vec, float (&out)[4]) {
  const T* p = static_cast<const T*>(base);
  if (vec) {
    Vec4<T> v = *reinterpret_cast<const Vec4<T>*>(p + i);
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = to_float(v.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = (i + k < end) ? to_float(p[i + k]) : 0.f;
  }
}

template <typename T>
__device__ __forceinline__ void store4(void* base, std::int64_t i, std::int64_t end, bool vec, const float (&in)[4]) {
  T* p = static_cast<T*>(base);
  if (vec) {
    Vec4<T> v;
#pragma unroll
    for (int k = 0; k < 4; ++k) v.v[k] = from_float<T>(in[k]);
    *reinterpret_cast<Vec4<T>*>(p + i) = v;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (i + k < end) p[i + k] = from_float<T>(in[k]);
    }
  }
}

// Store with an optional stochastic rounding (bf16 only; other dtypes round to nearest).
template <typename T>
__device__ __forceinline__ void store4_sr(void* base, std::int64_t i, std::int64_t end, bool vec,
                                          const float (&in)[4], bool sr, std::uint64_t seed, std::int64_t row) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (sr) {
      __nv_bfloat16* p = static_cast<__nv_bfloat16*>(base);
      __nv_bfloat16 o[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        std::uint64_t key = seed ^ (static_cast<std::uint64_t>(row) << 40) ^ static_cast<std::uint64_t>(i + k);
        o[k] = bf16_stochastic(in[k], mix32(key + 0x9e3779b97f4a7c15ULL));
      }
      if (vec) {
        Vec4<__nv_bfloat16> v;
#pragma unroll
        for (int k = 0; k < 4; ++k) v.v[k] = o[k];
        *reinterpret_cast<Vec4<__nv_bfloat16>*>(p + i) = v;
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (i + k < end) p[i + k] = o[k];
        }
      }
      return;
    }
  }
  store4<T>(base, i, end, vec, in);
}

// Runtime-typed store for the optional low-precision param copy (dtype chosen per launch, uniform branch).
__device__ __forceinline__ void store4_dyn(int dtype, void* base, std::int64_t i, std::int64_t end, bool vec,
                                           const float (&in)[4], bool sr, std::uint64_t seed, std::int64_t row) {
  switch (dtype) {
    case kFloat32:
      store4<float>(base, i, end, vec, in);
      break;
    case kFloat16:
      store4<__half>(base, i, end, vec, in);
      break;
    default:
      store4_sr<__nv_bfloat16>(base, i, end, vec, in, sr, seed, row);
      break;
  }
}

// Block-wide sum of one value per thread (result valid in thread 0). Deterministic: fixed reduction tree.
template <typename T>
__device__ __forceinline__ T block_sum(T x) {
  __shared__ T s_warp[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) s_warp[warp] = x;
  __syncthreads();
  x = (threadIdx.x < kThreads / 32) ? s_warp[threadIdx.x] : T(0);
  if (warp == 0) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
  }
  return x;
}

// Sum (in double) of the chunk partials [first, first + count) of one tensor, valid in thread 0.
__device__ __forceinline__ double segment_sum(const float* partials, std::int64_t first, std::int64_t count) {
  double acc = 0.0;
  for (std::int64_t j = threadIdx.x; j < count; j += kThreads) acc += static_cast<double>(partials[first + j]);
  return block_sum<double>(acc);
}

__host__ __device__ __forceinline__ std::int64_t chunks_of(std::int64_t numel) { return (numel + kChunk - 1) / kChunk; }

// Grid size for a chunked launch: one block per chunk up to a cap, then blocks loop over chunks.
inline unsigned grid_for(std::int64_t total_chunks) {
  const std::int64_t cap = std::int64_t{1} << 20;
  return static_cast<unsigned>(total_chunks < cap ? (total_chunks > 0 ? total_chunks : 1) : cap);
}

// Block-uniform "skip this call" decision (every thread of a block must take the same branch, because the
// kernels synchronise inside their chunk loops and another block may be setting the flag concurrently).
__device__ __forceinline__ bool skip_step(const float* flag) {
  int mine = 0;
  if (threadIdx.x == 0 && flag != nullptr) mine = *reinterpret_cast<const volatile float*>(flag) != 0.f;
  return __syncthreads_or(mine) != 0;
}

}  // namespace stepforge::cuda
