// SPDX-License-Identifier: Apache-2.0
//
// Multi-tensor L2 norm (global + per tensor, one segmented reduction, deterministic) and scale / unscale with
// an inf/NaN flag (the AMP unscale + overflow check).
#include <cmath>
#include <limits>

#include "update_common.cuh"

namespace stepforge::cuda {
namespace {

template <typename T>
__global__ __launch_bounds__(kThreads) void sumsq_chunks_kernel(const TensorRow* rows, std::int64_t n_rows,
                                                                std::int64_t total_chunks, float* partials) {
  const int bytes[1] = {int(sizeof(T))};
  for (std::int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    ChunkWork w = chunk_work(rows, n_rows, c);
    const TensorRow& r = rows[w.row];
    const bool vec = row_aligned(r, bytes, 1);
    const void* xp = reinterpret_cast<const void*>(r.ptr[0]);
    float acc = 0.f;
    for (std::int64_t i = w.begin + 4 * threadIdx.x; i < w.end; i += 4 * kThreads) {
      float x[4];
      load4<T>(xp, i, w.end, vec && i + 3 < w.end, x);  // out-of-range elements load as 0
#pragma unroll
      for (int e = 0; e < 4; ++e) acc += x[e] * x[e];
    }
    acc = block_sum<float>(acc);
    if (threadIdx.x == 0) partials[c] = acc;
  }
}

__global__ __launch_bounds__(kThreads) void sumsq_tensors_kernel(const TensorRow* rows, std::int64_t n_rows,
                                                                 const float* partials, double* per_tensor_sumsq,
                                                                 float* per_tensor_norm) {
  for (std::int64_t t = blockIdx.x; t < n_rows; t += gridDim.x) {
    const TensorRow& r = rows[t];
    const double s = segment_sum(partials, r.chunk_begin, chunks_of(r.numel));
    if (threadIdx.x == 0) {
      per_tensor_sumsq[t] = s;
      if (per_tensor_norm != nullptr) per_tensor_norm[t] = static_cast<float>(sqrt(s));
    }
  }
}

__global__ __launch_bounds__(kThreads) void sumsq_total_kernel(const double* per_tensor_sumsq, std::int64_t n,
                                                               double* total, float* sumsq_out) {
  double acc = 0.0;
  for (std::int64_t j = threadIdx.x; j < n; j += kThreads) acc += per_tensor_sumsq[j];
  acc = block_sum<double>(acc);
  if (threadIdx.x == 0) {
    *total = acc;
    if (sumsq_out != nullptr) *sumsq_out += static_cast<float>(acc);
  }
}

template <typename S, typename D>
__global__ __launch_bounds__(kThreads) void scale_kernel(const TensorRow* rows, std::int64_t n_rows,
                                                         std::int64_t total_chunks, float scale, float* found_inf) {
  const int bytes[2] = {int(sizeof(S)), int(sizeof(D))};
  for (std::int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    ChunkWork w = chunk_work(rows, n_rows, c);
    const TensorRow& r = rows[w.row];
    const bool vec = row_aligned(r, bytes, 2);
    bool bad = false;
    for (std::int64_t i = w.begin + 4 * threadIdx.x; i < w.end; i += 4 * kThreads) {
      const bool v4 = vec && i + 3 < w.end;
      float x[4];
      load4<S>(reinterpret_cast<const void*>(r.ptr[0]), i, w.end, v4, x);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        bad = bad || !isfinite(x[e]);
        x[e] = x[e] * scale;
      }
      store4<D>(reinterpret_cast<void*>(r.ptr[1]), i, w.end, v4, x);
    }
    if (bad && found_inf != nullptr) *found_inf = 1.f;
  }
}

}  // namespace

double l2norm(std::vector<TensorRow>& rows, int dtype, std::uint64_t per_tensor_out, std::uint64_t sumsq_out,
              Launch launch) {
  static const int required[] = {0};
  resolve_device(rows, launch);
  cudaStream_t stream = prepare(launch);
  const std::int64_t chunks = plan_rows(rows, required, 1);
  float* per_tensor = reinterpret_cast<float*>(static_cast<std::uintptr_t>(per_tensor_out));
  float* out = reinterpret_cast<float*>(static_cast<std::uintptr_t>(sumsq_out));
  if (rows.empty()) return 0.0;
  const std::int64_t n = static_cast<std::int64_t>(rows.size());
  // Scratch: [total double][n per-tensor doubles][chunk float partials].
  const std::size_t bytes = sizeof(double) * (1 + n) + sizeof(float) * (chunks > 0 ? chunks : 1);
  char* buf = static_cast<char*>(scratch(bytes, launch, stream, 1));
  double* total = reinterpret_cast<double*>(buf);
  double* per_sumsq = total + 1;
  float* partials = reinterpret_cast<float*>(per_sumsq + n);
  const TensorRow* table = device_table(rows, launch, stream);
  if (chunks > 0) {
    SF_DISPATCH_DTYPE(dtype, T, {
      sumsq_chunks_kernel<T><<<grid_for(chunks), kThreads, 0, stream>>>(table, n, chunks, partials);
    });
    check_launch("sumsq_chunks_kernel");
  }
  sumsq_tensors_kernel<<<grid_for(n), kThreads, 0, stream>>>(table, n, partials, per_sumsq, per_tensor);
  check_launch("sumsq_tensors_kernel");
  sumsq_total_kernel<<<1, kThreads, 0, stream>>>(per_sumsq, n, total, out);
  check_launch("sumsq_total_kernel");
  if (out != nullptr) return std::numeric_limits<double>::quiet_NaN();
  double host = 0.0;
  check(cudaMemcpyAsync(&host, total, sizeof(double), cudaMemcpyDeviceToHost, stream), "l2norm readback");
  check(cudaStreamSynchronize(stream), "l2norm synchronize");
  return std::sqrt(host);
}

void scale(std::vector<TensorRow>& rows, int src_dtype, int dst_dtype, double scale, std::uint64_t found_inf,
           Launch launch) {
  static const int required[] = {0, 1};
  resolve_device(rows, launch);
  cudaStream_t stream = prepare(launch);
  const std::int64_t chunks = plan_rows(rows, required, 2);
  if (chunks == 0) return;
  const TensorRow* table = device_table(rows, launch, stream);
  float* flag = reinterpret_cast<float*>(static_cast<std::uintptr_t>(found_inf));
  const auto n = static_cast<std::int64_t>(rows.size());
  SF_DISPATCH_DTYPE(src_dtype, S, {
    SF_DISPATCH_DTYPE(dst_dtype, D, {
      scale_kernel<S, D><<<grid_for(chunks), kThreads, 0, stream>>>(table, n, chunks, static_cast<float>(scale),
                                                                    flag);
    });
  });
  check_launch("scale_kernel");
}

}  // namespace stepforge::cuda
