// SPDX-License-Identifier: Apache-2.0
//
// Multi-tensor LAMB in three launches per dtype bucket, none of which writes into the grads:
//   1. moments: m, v updated; per-chunk partial sums of p^2 and u^2 (u = Adam direction incl. decoupled decay);
//   2. ratio:   one segmented reduction over the chunk partials (a tensor's chunks are contiguous), giving
//               ||p||, ||u|| and the trust ratio per tensor, deterministically (fixed order, double);
//   3. apply:   u recomputed from the stored m, v and the unchanged p; p -= lr * ratio * u.
// Each element is read 7 times and written 3 times (apex: 4 passes plus writing u into p.grad).
#include "stepforge/lamb_math.h"
#include "update_common.cuh"

namespace stepforge::cuda {
namespace {

struct LambKernelParams {
  double beta1, beta2, eps, weight_decay, trust_min, trust_max;
  bool adamw, bias_correction, grad_averaging, use_ratio;
};

__device__ __forceinline__ LambConsts lamb_consts(const UpdateArgs& a, const LambKernelParams& hp,
                                                  const TensorRow& r, std::int64_t row) {
  return make_lamb_consts(hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.adamw, hp.bias_correction,
                          hp.grad_averaging, row_step(a, r, row), load_div(a));
}

template <typename P, typename G>
__global__ __launch_bounds__(kThreads) void lamb_moments_kernel(UpdateArgs a, LambKernelParams hp,
                                                                float* partials) {
  if (skip_step(a.skip_flag)) return;
  __shared__ LambConsts s_c;
  const int bytes[kMaxLists] = {int(sizeof(P)), int(sizeof(G)), 4, 4, 0, 0};
  for (std::int64_t c = blockIdx.x; c < a.total_chunks; c += gridDim.x) {
    ChunkWork w = chunk_work(a.rows, a.n_rows, c);
    const TensorRow& r = a.rows[w.row];
    if (threadIdx.x == 0) s_c = lamb_consts(a, hp, r, w.row);
    __syncthreads();
    LambConsts k = s_c;
    const bool wb = a.write_grads && k.has_div;
    const float unscale = k.inv_div;
    if (wb) k.inv_div = 1.f;  // the grads are unscaled (and stored back) below; x * 1 is exact
    const bool vec = row_aligned(r, bytes, kMaxLists);
    const void* pp = reinterpret_cast<const void*>(r.ptr[kP]);
    void* gp = reinterpret_cast<void*>(r.ptr[kG]);
    void* mp = reinterpret_cast<void*>(r.ptr[kM]);
    void* vp = reinterpret_cast<void*>(r.ptr[kV]);
    float sp = 0.f, su = 0.f;
    for (std::int64_t i = w.begin + 4 * threadIdx.x; i < w.end; i += 4 * kThreads) {
      const bool v4 = vec && i + 3 < w.end;
      float p[4], g[4], m[4], v[4];
      load4<P>(pp, i, w.end, v4, p);
      load4<G>(gp, i, w.end, v4, g);
      load4<float>(mp, i, w.end, v4, m);
      load4<float>(vp, i, w.end, v4, v);
      if (wb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) g[e] = g[e] * unscale;
        store4<G>(gp, i, w.end, v4, g);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (i + e < w.end) {
          const float u = lamb_moments(p[e], m[e], v[e], g[e], k);
          sp += p[e] * p[e];
          su += u * u;
        }
      }
      store4<float>(mp, i, w.end, v4, m);
      store4<float>(vp, i, w.end, v4, v);
    }
    sp = block_sum<float>(sp);
    su = block_sum<float>(su);
    if (threadIdx.x == 0) {
      partials[c] = sp;
      partials[a.total_chunks + c] = su;
    }
  }
}

// norms_in (nullable): per-tensor sums given by the caller instead of the partials (the apply pass of a split
// step); norms_out (nullable): write the per-tensor sums there and stop (the norms pass).
__global__ __launch_bounds__(kThreads) void lamb_ratio_kernel(UpdateArgs a, LambKernelParams hp,
                                                              const float* partials, float* ratio,
                                                              float* ratio_out, const double* norms_in,
                                                              double* norms_out) {
  if (skip_step(a.skip_flag)) return;
  for (std::int64_t t = blockIdx.x; t < a.n_rows; t += gridDim.x) {
    const TensorRow& r = a.rows[t];
    double sp, su;
    if (norms_in != nullptr) {
      sp = norms_in[t];
      su = norms_in[a.n_rows + t];
    } else {
      const std::int64_t n = chunks_of(r.numel);
      sp = segment_sum(partials, r.chunk_begin, n);
      su = segment_sum(partials + a.total_chunks, r.chunk_begin, n);
    }
    if (norms_out != nullptr) {
      if (threadIdx.x == 0) {
        norms_out[t] = sp;
        norms_out[a.n_rows + t] = su;
      }
      continue;
    }
    if (threadIdx.x == 0) {
      const float q = lamb_trust_ratio(sqrt(sp), sqrt(su), hp.use_ratio, hp.trust_min, hp.trust_max);
      ratio[t] = q;
      if (ratio_out != nullptr) ratio_out[t] = q;
    }
  }
}

template <typename P>
__global__ __launch_bounds__(kThreads) void lamb_apply_kernel(UpdateArgs a, LambKernelParams hp,
                                                              const float* ratio) {
  if (skip_step(a.skip_flag)) return;
  __shared__ LambConsts s_c;
  __shared__ float s_step;
  const int bytes[kMaxLists] = {int(sizeof(P)), 0, 4, 4, dtype_bytes(a.copy_dtype), 0};
  for (std::int64_t c = blockIdx.x; c < a.total_chunks; c += gridDim.x) {
    ChunkWork w = chunk_work(a.rows, a.n_rows, c);
    const TensorRow& r = a.rows[w.row];
    if (threadIdx.x == 0) {
      s_c = lamb_consts(a, hp, r, w.row);
      s_step = static_cast<float>(load_lr(a)) * ratio[w.row];
    }
    __syncthreads();
    const LambConsts k = s_c;
    const float step = s_step;
    // The step enters the rounding noise, so a caller that keeps one seed still gets fresh noise every step.
    const std::uint64_t seed =
        a.seed ^ (static_cast<std::uint64_t>(row_step(a, r, w.row)) * 0x9e3779b97f4a7c15ULL);
    const bool vec = row_aligned(r, bytes, kMaxLists);
    void* pp = reinterpret_cast<void*>(r.ptr[kP]);
    const void* mp = reinterpret_cast<const void*>(r.ptr[kM]);
    const void* vp = reinterpret_cast<const void*>(r.ptr[kV]);
    void* cp = reinterpret_cast<void*>(r.ptr[kCopy]);
    for (std::int64_t i = w.begin + 4 * threadIdx.x; i < w.end; i += 4 * kThreads) {
      const bool v4 = vec && i + 3 < w.end;
      float p[4], m[4], v[4];
      load4<P>(pp, i, w.end, v4, p);
      load4<float>(mp, i, w.end, v4, m);
      load4<float>(vp, i, w.end, v4, v);
#pragma unroll
      for (int e = 0; e < 4; ++e) p[e] = p[e] - step * lamb_direction(p[e], m[e], v[e], k);
      if (a.copy_dtype != kNoDType) {
        store4<P>(pp, i, w.end, v4, p);
        store4_dyn(a.copy_dtype, cp, i, w.end, v4, p, a.sr, seed, w.row);
      } else {
        store4_sr<P>(pp, i, w.end, v4, p, a.sr, seed, w.row);
      }
    }
  }
}

}  // namespace

int lamb(std::vector<TensorRow>& rows, int p_dtype, int g_dtype, int copy_dtype, const Steps& steps,
          const LambParams& hp, const Common& common, std::uint64_t ratio_out, Launch launch,
          std::uint64_t norms_out, std::uint64_t norms_in) {
  static const int required[] = {kP, kG, kM, kV};
  if (norms_out != 0 && norms_in != 0)
    throw std::invalid_argument("lamb: pass norms_out_ptr (norms pass) or norms_in_ptr (apply pass), not both");
  if (copy_dtype != kNoDType && p_dtype != kFloat32) throw std::invalid_argument("master weights (param copy) need fp32 masters");
  Prepared prep = prepare_update(rows, required, 4, g_dtype, common, hp.lr, &steps.host, copy_dtype, launch);
  if (prep.empty) return (common.check_finite && common.found_inf == 0) ? 0 : kSkipOnDevice;
  const LambKernelParams kp{hp.beta1,        hp.beta2,        hp.eps,
                            hp.weight_decay, hp.trust_min,    hp.trust_max,
                            hp.adamw,        hp.bias_correction, hp.grad_averaging,
                            hp.weight_decay != 0.0 || hp.use_nvlamb};
  const UpdateArgs& a = prep.args;
  const std::size_t n_part = 2 * static_cast<std::size_t>(a.total_chunks);
  float* partials = static_cast<float*>(scratch((n_part + rows.size()) * sizeof(float), launch, prep.stream, 1));
  float* ratio = partials + n_part;
  const unsigned grid = grid_for(a.total_chunks);
  double* sums_out = reinterpret_cast<double*>(static_cast<std::uintptr_t>(norms_out));
  const double* sums_in = reinterpret_cast<const double*>(static_cast<std::uintptr_t>(norms_in));
  if (sums_in == nullptr) {
    SF_DISPATCH_DTYPE(p_dtype, P, {
      SF_DISPATCH_DTYPE(g_dtype, G, {
        lamb_moments_kernel<P, G><<<grid, kThreads, 0, prep.stream>>>(a, kp, partials);
      });
    });
    check_launch("lamb_moments_kernel");
  }
  lamb_ratio_kernel<<<grid_for(a.n_rows), kThreads, 0, prep.stream>>>(
      a, kp, partials, ratio, reinterpret_cast<float*>(static_cast<std::uintptr_t>(ratio_out)), sums_in,
      sums_out);
  check_launch("lamb_ratio_kernel");
  if (sums_out != nullptr) return finish_update(prep);
  SF_DISPATCH_DTYPE(p_dtype, P, { lamb_apply_kernel<P><<<grid, kThreads, 0, prep.stream>>>(a, kp, ratio); });
  check_launch("lamb_apply_kernel");
  return finish_update(prep);
}

}  // namespace stepforge::cuda
