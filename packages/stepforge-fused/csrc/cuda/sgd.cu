// SPDX-License-Identifier: Apache-2.0
//
// Multi-tensor SGD (momentum, dampening, nesterov, wd_after_momentum), per-tensor first-step flags (a new
// momentum buffer starts as the grad, torch semantics, decided per tensor rather than per launch).
#include "stepforge/sgd_math.h"
#include "update_common.cuh"

namespace stepforge::cuda {
namespace {

struct SgdKernelParams {
  double momentum, dampening, weight_decay;
  bool nesterov, wd_after_momentum;
};

template <typename P, typename G>
__global__ __launch_bounds__(kThreads) void sgd_kernel(UpdateArgs a, SgdKernelParams hp) {
  if (skip_step(a.skip_flag)) return;
  __shared__ SgdConsts s_c;
  const int bytes[kMaxLists] = {int(sizeof(P)), int(sizeof(G)), 4, 0, dtype_bytes(a.copy_dtype), 0};
  for (std::int64_t c = blockIdx.x; c < a.total_chunks; c += gridDim.x) {
    ChunkWork w = chunk_work(a.rows, a.n_rows, c);
    const TensorRow& r = a.rows[w.row];
    if (threadIdx.x == 0) {
      s_c = make_sgd_consts(load_lr(a), hp.momentum, hp.dampening, hp.weight_decay, hp.nesterov,
                            hp.wd_after_momentum, load_div(a));
    }
    __syncthreads();
    SgdConsts k = s_c;
    const bool wb = a.write_grads && k.has_div;
    const float unscale = k.inv_div;
    if (wb) k.inv_div = 1.f;  // the grads are unscaled (and stored back) below; x * 1 is exact
    const bool first = r.aux != 0;
    const bool vec = row_aligned(r, bytes, kMaxLists);
    void* pp = reinterpret_cast<void*>(r.ptr[kP]);
    void* gp = reinterpret_cast<void*>(r.ptr[kG]);
    void* bp = reinterpret_cast<void*>(r.ptr[kM]);
    void* cp = reinterpret_cast<void*>(r.ptr[kCopy]);
    const bool has_buf = k.has_momentum && bp != nullptr;
    for (std::int64_t i = w.begin + 4 * threadIdx.x; i < w.end; i += 4 * kThreads) {
      const bool v4 = vec && i + 3 < w.end;
      float p[4], g[4], b[4] = {0.f, 0.f, 0.f, 0.f};
      load4<P>(pp, i, w.end, v4, p);
      load4<G>(gp, i, w.end, v4, g);
      if (has_buf && !first) load4<float>(bp, i, w.end, v4, b);
      if (wb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) g[e] = g[e] * unscale;
        store4<G>(gp, i, w.end, v4, g);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) sgd_update(p[e], b[e], g[e], first, k);
      if (has_buf) store4<float>(bp, i, w.end, v4, b);
      if (a.copy_dtype != kNoDType) {
        store4<P>(pp, i, w.end, v4, p);
        store4_dyn(a.copy_dtype, cp, i, w.end, v4, p, a.sr, a.seed, w.row);
      } else {
        store4_sr<P>(pp, i, w.end, v4, p, a.sr, a.seed, w.row);
      }
    }
  }
}

}  // namespace

int sgd(std::vector<TensorRow>& rows, int p_dtype, int g_dtype, int copy_dtype, const SgdParams& hp,
         const Common& common, Launch launch) {
  static const int required_mom[] = {kP, kG, kM};
  const bool momentum = hp.momentum != 0.0;
  if (copy_dtype != kNoDType && p_dtype != kFloat32) throw std::invalid_argument("master weights (param copy) need fp32 masters");
  Prepared prep =
      prepare_update(rows, required_mom, momentum ? 3 : 2, g_dtype, common, hp.lr, nullptr, copy_dtype, launch);
  if (prep.empty) return (common.check_finite && common.found_inf == 0) ? 0 : kSkipOnDevice;
  const SgdKernelParams kp{hp.momentum, hp.dampening, hp.weight_decay, hp.nesterov, hp.wd_after_momentum};
  SF_DISPATCH_DTYPE(p_dtype, P, {
    SF_DISPATCH_DTYPE(g_dtype, G, {
      sgd_kernel<P, G><<<grid_for(prep.args.total_chunks), kThreads, 0, prep.stream>>>(prep.args, kp);
    });
  });
  check_launch("sgd_kernel");
  return finish_update(prep);
}

}  // namespace stepforge::cuda
