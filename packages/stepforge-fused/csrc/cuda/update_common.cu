// SPDX-License-Identifier: Apache-2.0
//
// Launch preamble shared by the update ops: table upload, per-tensor bias corrections, finite-check pre-pass.
#include "update_common.cuh"

namespace stepforge::cuda {
namespace {

// Sets *flag = 1 when any divided grad element is inf/NaN. Reads only; exits at once when the flag is set.
template <typename G>
__global__ __launch_bounds__(kThreads) void finite_check_kernel(const TensorRow* rows, std::int64_t n_rows,
                                                                std::int64_t total_chunks, float* flag,
                                                                float div, const float* div_ptr) {
  if (skip_step(flag)) return;  // already flagged (found_inf on entry): nothing to check
  const float d = div_ptr ? div * *div_ptr : div;
  for (std::int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    ChunkWork w = chunk_work(rows, n_rows, c);
    const TensorRow& r = rows[w.row];
    const int bytes[2] = {0, static_cast<int>(sizeof(G))};
    const bool vec = row_aligned(r, bytes, 2);
    bool bad = false;
    // A divisor of exactly 1 (no scaler, no clip) skips the IEEE division, which costs more than the load it checks.
    const bool divide = d != 1.f;
    for (std::int64_t i = w.begin + 4 * threadIdx.x; i < w.end; i += 4 * kThreads) {
      float g[4];
      load4<G>(reinterpret_cast<const void*>(r.ptr[kG]), i, w.end, vec && i + 3 < w.end, g);
#pragma unroll
      for (int k = 0; k < 4; ++k) bad |= !isfinite(divide ? g[k] / d : g[k]);
    }
    if (bad) *flag = 1.f;  // racing writers all store the same value
  }
}

}  // namespace

Prepared prepare_update(std::vector<TensorRow>& rows, const int* required, int n_required, int g_dtype,
                        const Common& common, double lr, const std::vector<std::int64_t>* host_steps,
                        int copy_dtype, Launch& launch) {
  Prepared prep{};
  resolve_device(rows, launch);
  prep.stream = prepare(launch);
  const std::int64_t chunks = plan_rows(rows, required, n_required);
  prep.empty = chunks == 0;
  UpdateArgs& a = prep.args;
  a.n_rows = static_cast<std::int64_t>(rows.size());
  a.total_chunks = chunks;
  a.lr = lr;
  a.lr_ptr = reinterpret_cast<const float*>(static_cast<std::uintptr_t>(common.lr_ptr));
  a.grad_div = common.grad_divisor;
  a.grad_div_ptr = reinterpret_cast<const float*>(static_cast<std::uintptr_t>(common.grad_divisor_ptr));
  a.copy_dtype = copy_dtype;
  a.sr = common.stochastic_rounding;
  a.seed = common.seed;
  a.write_grads = common.write_grads;
  a.steps = nullptr;
  a.step = 1;
  if (prep.empty) return prep;
  if (!(common.grad_divisor > 0.0)) {
    throw std::invalid_argument("grad_divisor must be > 0 (got " + std::to_string(common.grad_divisor) + ")");
  }
  a.rows = device_table(rows, launch, prep.stream);

  // Uniform steps (the usual case) travel as one scalar; mixed steps as one small stream-ordered upload, freed
  // in finish_update. Bias corrections are computed from them per tensor in double (stepforge/adam_math.h).
  if (host_steps != nullptr && !host_steps->empty()) {
    if (host_steps->size() != rows.size()) {
      throw std::invalid_argument("steps has " + std::to_string(host_steps->size()) + " entries, expected " +
                                  std::to_string(rows.size()));
    }
    bool uniform = true;
    for (std::int64_t s : *host_steps) {
      if (s < 1) throw std::invalid_argument("steps must be >= 1 (the caller increments before the update)");
      uniform = uniform && s == host_steps->front();
    }
    if (uniform) {
      a.step = host_steps->front();
    } else {
      std::int64_t* dev = nullptr;
      const std::size_t bytes = host_steps->size() * sizeof(std::int64_t);
      check(cudaMallocAsync(reinterpret_cast<void**>(&dev), bytes, prep.stream), "cudaMallocAsync(steps)");
      check(cudaMemcpyAsync(dev, host_steps->data(), bytes, cudaMemcpyHostToDevice, prep.stream),
            "steps upload (mixed host steps cannot be captured in a CUDA graph; use device steps)");
      a.steps = dev;
    }
  }

  float* found_inf = reinterpret_cast<float*>(static_cast<std::uintptr_t>(common.found_inf));
  a.skip_flag = found_inf;
  if (common.check_finite) {
    float* flag = found_inf;
    if (flag == nullptr) {
      flag = static_cast<float*>(scratch(sizeof(float), launch, prep.stream, 0));
      check(cudaMemsetAsync(flag, 0, sizeof(float), prep.stream), "cudaMemsetAsync(flag)");
      prep.internal_flag = flag;
    }
    SF_DISPATCH_DTYPE(g_dtype, G, {
      finite_check_kernel<G><<<grid_for(chunks), kThreads, 0, prep.stream>>>(a.rows, a.n_rows, chunks, flag,
                                                                             static_cast<float>(a.grad_div),
                                                                             a.grad_div_ptr);
    });
    check_launch("finite_check_kernel");
    a.skip_flag = flag;
  }
  return prep;
}

int finish_update(Prepared& prep) {
  if (prep.args.steps != nullptr) {
    check(cudaFreeAsync(const_cast<std::int64_t*>(prep.args.steps), prep.stream), "cudaFreeAsync(steps)");
    prep.args.steps = nullptr;
  }
  if (prep.internal_flag == nullptr) return kSkipOnDevice;
  float host = 0.f;
  check(cudaMemcpyAsync(&host, prep.internal_flag, sizeof(float), cudaMemcpyDeviceToHost, prep.stream),
        "finite-check flag readback");
  check(cudaStreamSynchronize(prep.stream), "finite-check synchronize");
  return host != 0.f ? 1 : 0;
}

}  // namespace stepforge::cuda
