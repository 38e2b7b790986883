// SPDX-License-Identifier: Apache-2.0
// Multi-tensor LAMB, two passes (lamb_math.h): moments + norms, then the trust-ratio update. Compiled once per ISA (cmake/StepforgeSimd.cmake) into stepforge::cpu::<isa>.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/dispatch.h"

namespace stepforge::cpu::STEPFORGE_ISA_NS {
namespace {

// ---- LAMB ----------------------------------------------------------------------------------------------
template <class P, class G, bool MASTER>
void lamb_pass1_run(const LambLaunch& L) {
  ChunkPartials part(L.mt, 2);
  parallel_segments(L.mt, [&](int64_t chunk, int64_t t, int64_t b, int64_t e) {
    LambConsts c = L.consts[t];
    const bool wb = L.write_grads && c.has_div;
    const float unscale = c.inv_div;
    if (wb) c.inv_div = 1.0f;  // grads are unscaled (and stored back) per block below; x * 1 is exact
    const P* p = reinterpret_cast<const P*>(L.params[t]);
    const G* g = reinterpret_cast<const G*>(L.grads[t]);
    float* m = reinterpret_cast<float*>(L.exp_avgs[t]);
    float* v = reinterpret_cast<float*>(L.exp_avg_sqs[t]);
    const float* w = MASTER ? reinterpret_cast<const float*>(L.masters[t]) : nullptr;
    alignas(64) float gtmp[kBlock];
    alignas(64) float ptmp[kBlock];
    double psq = 0.0, usq = 0.0;
    for (int64_t i0 = b; i0 < e; i0 += kBlock) {
      const int64_t k = std::min(kBlock, e - i0);
      const float* gb = wb ? unscale_block<true>(g + i0, gtmp, k, unscale) : float_view(g + i0, gtmp, k);
      const float* pb = MASTER ? w + i0 : float_view(p + i0, ptmp, k);
      float* mb = m + i0;
      float* vb = v + i0;
      alignas(64) float utmp[kBlock];
#pragma GCC ivdep
      for (int64_t j = 0; j < k; ++j) utmp[j] = lamb_moments(pb[j], mb[j], vb[j], gb[j], c);
      double ps = 0.0, us = 0.0;
#pragma omp simd reduction(+ : ps, us)
      for (int64_t j = 0; j < k; ++j) {
        ps += double(pb[j]) * double(pb[j]);
        us += double(utmp[j]) * double(utmp[j]);
      }
      psq += ps;
      usq += us;
    }
    double* slot = part.at(chunk, t);
    slot[0] += psq;
    slot[1] += usq;
  });
  std::vector<double> sums(size_t(L.mt.n) * 2);
  part.combine(sums.data());
  for (int64_t t = 0; t < L.mt.n; ++t) {
    L.p_sq[t] += sums[size_t(t) * 2];
    L.u_sq[t] += sums[size_t(t) * 2 + 1];
  }
}

template <class P, class G, bool MASTER>
void lamb_pass2_run(const LambLaunch& L) {
  parallel_segments(L.mt, [&](int64_t, int64_t t, int64_t b, int64_t e) {
    const LambConsts c = L.consts[t];
    const float scale = L.step_scale[t];
    P* p = reinterpret_cast<P*>(L.params[t]);
    const float* m = reinterpret_cast<const float*>(L.exp_avgs[t]);
    const float* v = reinterpret_cast<const float*>(L.exp_avg_sqs[t]);
    float* w = MASTER ? reinterpret_cast<float*>(L.masters[t]) : nullptr;
    alignas(64) float ptmp[kBlock];
    for (int64_t i0 = b; i0 < e; i0 += kBlock) {
      const int64_t k = std::min(kBlock, e - i0);
      float* pb = ptmp;  // local copy: see adam_block_range
      if constexpr (MASTER) {
        std::memcpy(ptmp, w + i0, size_t(k) * sizeof(float));
      } else {
        to_float(p + i0, ptmp, k);
      }
      const float* mb = m + i0;
      const float* vb = v + i0;
#pragma GCC ivdep
      for (int64_t j = 0; j < k; ++j) pb[j] = pb[j] - scale * lamb_direction(pb[j], mb[j], vb[j], c);
      if constexpr (MASTER) std::memcpy(w + i0, ptmp, size_t(k) * sizeof(float));
      from_float(pb, p + i0, k);
    }
  });
}

}  // namespace

STEPFORGE_CPU_UPDATE_ENTRY(lamb_pass1, LambLaunch, lamb_pass1_run)
STEPFORGE_CPU_UPDATE_ENTRY(lamb_pass2, LambLaunch, lamb_pass2_run)

}  // namespace stepforge::cpu::STEPFORGE_ISA_NS
