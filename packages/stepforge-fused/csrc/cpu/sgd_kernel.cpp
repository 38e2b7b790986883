// SPDX-License-Identifier: Apache-2.0
// Multi-tensor SGD (torch.optim.SGD semantics, sgd_math.h). Compiled once per ISA (cmake/StepforgeSimd.cmake) into stepforge::cpu::<isa>.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/convert.h"
#include "cpu/kernels.h"
#include "cpu/multi_tensor.h"
#include "stepforge/dtype_dispatch.h"

namespace stepforge::cpu::STEPFORGE_ISA_NS {
namespace {

// ---- SGD -----------------------------------------------------------------------------------------------
// The element update is sgd_update_t (sgd_math.h, shared with CUDA); momentum/nesterov/first step are template
// flags chosen per tensor so the loops vectorise.
// wb (write-back): c.inv_div is 1 and the grads are multiplied by `unscale` and stored back before the update.
template <class P, class G, bool MASTER, bool MOM, bool NEST, bool FIRST>
void sgd_range(const SgdLaunch& L, const SgdConsts& c, bool wb, float unscale, int64_t t, int64_t b, int64_t e) {
  P* p = reinterpret_cast<P*>(L.params[t]);
  const G* g = reinterpret_cast<const G*>(L.grads[t]);
  float* buf = MOM ? reinterpret_cast<float*>(L.bufs[t]) : nullptr;
  float* w = MASTER ? reinterpret_cast<float*>(L.masters[t]) : nullptr;
  if constexpr (MOM && !MASTER && std::is_same_v<P, float> && std::is_same_v<G, float>) {
    // All float32 in place: no block copies.
    if (wb) {
      float* gw = const_cast<float*>(g);
#pragma GCC ivdep
      for (int64_t i = b; i < e; ++i) {
        float pv = p[i], bv = buf[i];
        const float gv = g[i] * unscale;
        gw[i] = gv;
        sgd_update_t<MOM, NEST, FIRST>(pv, bv, gv, c);
        p[i] = pv;
        buf[i] = bv;
      }
      return;
    }
#pragma GCC ivdep
    for (int64_t i = b; i < e; ++i) {
      float pv = p[i], bv = buf[i];
      sgd_update_t<MOM, NEST, FIRST>(pv, bv, g[i], c);
      p[i] = pv;
      buf[i] = bv;
    }
    return;
  }
  alignas(64) float gtmp[kBlock];
  alignas(64) float ptmp[kBlock];
  alignas(64) float btmp[kBlock];
  for (int64_t i0 = b; i0 < e; i0 += kBlock) {
    const int64_t n = std::min(kBlock, e - i0);
    const float* gb = wb ? unscale_block<true>(g + i0, gtmp, n, unscale) : float_view(g + i0, gtmp, n);
    float* pb = ptmp;  // local copy: see adam_block_range
    if constexpr (MASTER) {
      std::memcpy(ptmp, w + i0, size_t(n) * sizeof(float));
    } else {
      to_float(p + i0, ptmp, n);
    }
    float* bb = MOM ? buf + i0 : btmp;
#pragma GCC ivdep
    for (int64_t j = 0; j < n; ++j) sgd_update_t<MOM, NEST, FIRST>(pb[j], bb[j], gb[j], c);
    if constexpr (MASTER) std::memcpy(w + i0, ptmp, size_t(n) * sizeof(float));
    from_float(pb, p + i0, n);
  }
}

template <class P, class G, bool MASTER>
void sgd_run(const SgdLaunch& L) {
  const SgdConsts& k = L.consts;
  const float inv_div = k.inv_div;
  const bool wb = L.write_grads && k.has_div;
  SgdConsts c = k;
  if (wb) c.inv_div = 1.0f;  // the grads are unscaled (and stored back) per block; x * 1 is exact
  parallel_segments(L.mt, [&](int64_t, int64_t t, int64_t b, int64_t e) {
    const bool first = L.first_run != nullptr && L.first_run[t] != 0;
    if (!k.has_momentum) {
      sgd_range<P, G, MASTER, false, false, false>(L, c, wb, inv_div, t, b, e);
    } else if (k.nesterov) {
      if (first)
        sgd_range<P, G, MASTER, true, true, true>(L, c, wb, inv_div, t, b, e);
      else
        sgd_range<P, G, MASTER, true, true, false>(L, c, wb, inv_div, t, b, e);
    } else {
      if (first)
        sgd_range<P, G, MASTER, true, false, true>(L, c, wb, inv_div, t, b, e);
      else
        sgd_range<P, G, MASTER, true, false, false>(L, c, wb, inv_div, t, b, e);
    }
  });
}

// (param, grad) dtype codes from the caller, never inferred from data; masters only for 16-bit params (the
// host side, ops.cpp, rejects the other combinations before getting here).
template <template <class, class, bool> class Op, class LaunchT>
void dispatch_pgm(const LaunchT& L) {
  const bool master = L.masters != nullptr;
  STEPFORGE_DISPATCH_DTYPE(L.param_dtype, P, half_t, bf16_t, return,
    STEPFORGE_DISPATCH_DTYPE(L.grad_dtype, G, half_t, bf16_t, return,
      if (!master) {
        Op<P, G, false>::run(L);
      } else if constexpr (!std::is_same_v<P, float>) {
        Op<P, G, true>::run(L);
      }))
}

template <class P, class G, bool M>
struct SgdOp {
  static void run(const SgdLaunch& L) { sgd_run<P, G, M>(L); }
};

}  // namespace

void sgd(const SgdLaunch& L) { dispatch_pgm<SgdOp>(L); }

}  // namespace stepforge::cpu::STEPFORGE_ISA_NS
