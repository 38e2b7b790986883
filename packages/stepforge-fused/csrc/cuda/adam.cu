// SPDX-License-Identifier: Apache-2.0
//
// Multi-tensor Adam / AdamW: one launch per (param, grad) dtype bucket, any number of tensors, per-tensor steps,
// optional fp32 master weights with a low-precision param copy written in the same pass.
#include "stepforge/adam_math.h"
#include "update_common.cuh"

namespace stepforge::cuda {
namespace {

struct AdamKernelParams {
  double beta1, beta2, eps, weight_decay;
  bool adamw, bias_correction;
};

// P: storage type of list kP (the fp32 master when a copy is written); G: grad storage type.
// At least 4 blocks per SM: unbounded, ptxas gave this kernel 96-100 registers (2 blocks of 256 threads per SM),
// too few loads in flight for the five streams of the master-weight pass (84% of copy bandwidth on an H200).
template <typename P, typename G>
__global__ __launch_bounds__(kThreads, 4) void adam_kernel(UpdateArgs a, AdamKernelParams hp) {
  if (skip_step(a.skip_flag)) return;
  __shared__ AdamConsts s_c;
  const int bytes[kMaxLists] = {int(sizeof(P)), int(sizeof(G)), 4, 4, dtype_bytes(a.copy_dtype), 0};
  for (std::int64_t c = blockIdx.x; c < a.total_chunks; c += gridDim.x) {
    ChunkWork w = chunk_work(a.rows, a.n_rows, c);  // ends with __syncthreads
    const TensorRow& r = a.rows[w.row];
    if (threadIdx.x == 0) {
      s_c = make_adam_consts(load_lr(a), hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.adamw,
                             hp.bias_correction, row_step(a, r, w.row), load_div(a));
    }
    __syncthreads();
    const AdamConsts k = s_c;
    // The step enters the rounding noise, so a caller that keeps one seed still gets fresh noise every step.
    const std::uint64_t seed =
        a.seed ^ (static_cast<std::uint64_t>(row_step(a, r, w.row)) * 0x9e3779b97f4a7c15ULL);
    const bool vec = row_aligned(r, bytes, kMaxLists);
    void* pp = reinterpret_cast<void*>(r.ptr[kP]);
    void* gp = reinterpret_cast<void*>(r.ptr[kG]);
    const bool wb = a.write_grads && k.has_div;
    void* mp = reinterpret_cast<void*>(r.ptr[kM]);
    void* vp = reinterpret_cast<void*>(r.ptr[kV]);
    void* cp = reinterpret_cast<void*>(r.ptr[kCopy]);
    for (std::int64_t i = w.begin + 4 * threadIdx.x; i < w.end; i += 4 * kThreads) {
      const bool v4 = vec && i + 3 < w.end;
      float p[4], g[4], m[4], v[4];
      load4<P>(pp, i, w.end, v4, p);
      load4<G>(gp, i, w.end, v4, g);
      load4<float>(mp, i, w.end, v4, m);
      load4<float>(vp, i, w.end, v4, v);
      if (wb) {
        // torch's fused grad_scale contract: the unscaled grad replaces the scaled one, in the same pass.
#pragma unroll
        for (int e = 0; e < 4; ++e) g[e] = g[e] / k.div;
        store4<G>(gp, i, w.end, v4, g);
#pragma unroll
        for (int e = 0; e < 4; ++e) adam_update_t<false>(p[e], m[e], v[e], g[e], k);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) adam_update(p[e], m[e], v[e], g[e], k);
      }
      store4<float>(mp, i, w.end, v4, m);
      store4<float>(vp, i, w.end, v4, v);
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

int adam(std::vector<TensorRow>& rows, int p_dtype, int g_dtype, int copy_dtype, const Steps& steps,
          const AdamParams& hp, const Common& common, Launch launch) {
  static const int required[] = {kP, kG, kM, kV};
  if (copy_dtype != kNoDType && p_dtype != kFloat32) throw std::invalid_argument("master weights (param copy) need fp32 masters");
  Prepared prep = prepare_update(rows, required, 4, g_dtype, common, hp.lr, &steps.host, copy_dtype, launch);
  if (prep.empty) return (common.check_finite && common.found_inf == 0) ? 0 : kSkipOnDevice;
  if (steps.host.empty()) {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (rows[i].step == 0 && rows[i].numel > 0 && hp.bias_correction) {
        throw std::invalid_argument("adam: no host steps and tensor " + std::to_string(i) +
                                    " has no device step pointer");
      }
    }
  }
  const AdamKernelParams kp{hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.adamw, hp.bias_correction};
  SF_DISPATCH_DTYPE(p_dtype, P, {
    SF_DISPATCH_DTYPE(g_dtype, G, {
      adam_kernel<P, G><<<grid_for(prep.args.total_chunks), kThreads, 0, prep.stream>>>(prep.args, kp);
    });
  });
  check_launch("adam_kernel");
  return finish_update(prep);
}

}  // namespace stepforge::cuda
