// SPDX-License-Identifier: Apache-2.0
// Multi-tensor SGD (torch.optim.SGD semantics, sgd_math.h). Compiled once per ISA (cmake/StepforgeSimd.cmake) into stepforge::cpu::<isa>.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/dispatch.h"

namespace stepforge::cpu::STEPFORGE_ISA_NS {
namespace {

// ---- SGD -----------------------------------------------------------------------------------------------
// The element update is sgd_update_t (sgd_math.h, shared with CUDA, always inlined); momentum, nesterov and
// "first step" are template flags chosen per tensor, so every loop is branch-free and vectorises. The
// constants travel by value: a reference into the OpenMP closure may alias the float arrays as far as GCC
// knows, which keeps it from holding them in registers.
// wb (write-back): the grads are multiplied by `unscale` and stored back first, and c.inv_div is 1.

// float32 params and grads, no masters: one in-place pass, no block copies. DRAM traffic per element is the
// minimum: with momentum read p, g, buf and write p, buf (20 B; the first step reads no buffer), without it
// read p, g and write p (12 B).
template <bool MOM, bool NEST, bool FIRST, bool WB>
void sgd_f32_range(float* __restrict p, float* __restrict g, float* __restrict buf, const SgdConsts c,
                   float unscale, int64_t b, int64_t e) {
#pragma GCC ivdep
  for (int64_t i = b; i < e; ++i) {
    float pv = p[i];
    float bv = 0.0f;
    if constexpr (MOM && !FIRST) bv = buf[i];
    float gv = g[i];
    if constexpr (WB) {
      gv = gv * unscale;
      g[i] = gv;
    }
    sgd_update_t<MOM, NEST, FIRST>(pv, bv, gv, c);
    p[i] = pv;
    if constexpr (MOM) buf[i] = bv;
  }
}

// 16-bit params or grads, or float32 masters: grads are converted (and unscaled for wb) into an L1 block; a
// master is updated where it lives and its new value rounded into the param; a 16-bit param without master is
// updated in an L1 copy (see adam_block_range for why not in place).
template <class P, class G, bool MASTER, bool MOM, bool NEST, bool FIRST>
void sgd_block_range(P* p, G* g, float* buf, float* w, const SgdConsts c, bool wb, float unscale, int64_t b,
                     int64_t e) {
  alignas(64) float gtmp[kBlock];
  alignas(64) float ptmp[kBlock];
  for (int64_t i0 = b; i0 < e; i0 += kBlock) {
    const int64_t n = std::min(kBlock, e - i0);
    const float* __restrict gb = wb ? unscale_block<true>(g + i0, gtmp, n, unscale) : float_view(g + i0, gtmp, n);
    float* pb = ptmp;                       // no __restrict: without masters src is ptmp too
    float* src = MASTER ? w + i0 : ptmp;
    float* bb = MOM ? buf + i0 : nullptr;
    if constexpr (!MASTER) to_float(p + i0, ptmp, n);
#pragma GCC ivdep
    for (int64_t j = 0; j < n; ++j) {
      float pv = src[j];
      float bv = 0.0f;
      if constexpr (MOM && !FIRST) bv = bb[j];
      sgd_update_t<MOM, NEST, FIRST>(pv, bv, gb[j], c);
      if constexpr (MASTER) src[j] = pv;
      pb[j] = pv;
      if constexpr (MOM) bb[j] = bv;
    }
    from_float(pb, p + i0, n);
  }
}

template <class P, class G, bool MASTER, bool MOM, bool NEST, bool FIRST>
void sgd_range(const SgdLaunch& L, const SgdConsts c, bool wb, float unscale, int64_t t, int64_t b, int64_t e) {
  P* p = reinterpret_cast<P*>(L.params[t]);
  G* g = reinterpret_cast<G*>(L.grads[t]);  // written only with wb
  float* buf = MOM ? reinterpret_cast<float*>(L.bufs[t]) : nullptr;
  float* w = MASTER ? reinterpret_cast<float*>(L.masters[t]) : nullptr;
  if constexpr (!MASTER && std::is_same_v<P, float> && std::is_same_v<G, float>) {
    if (wb)
      sgd_f32_range<MOM, NEST, FIRST, true>(p, g, buf, c, unscale, b, e);
    else
      sgd_f32_range<MOM, NEST, FIRST, false>(p, g, buf, c, unscale, b, e);
  } else {
    sgd_block_range<P, G, MASTER, MOM, NEST, FIRST>(p, g, buf, w, c, wb, unscale, b, e);
  }
}

template <class P, class G, bool MASTER>
void sgd_run(const SgdLaunch& L) {
  const SgdConsts& k = L.consts;
  const float inv_div = k.inv_div;
  const bool wb = L.write_grads && k.has_div;
  SgdConsts c = k;
  if (wb) c.inv_div = 1.0f;  // the grads are unscaled (and stored back) first; x * 1 is exact
  parallel_segments(L.mt, [&](int64_t, int64_t t, int64_t b, int64_t e) {
    const bool first = L.first_run != nullptr && L.first_run[t] != 0;
    if (!c.has_momentum) {
      sgd_range<P, G, MASTER, false, false, false>(L, c, wb, inv_div, t, b, e);
    } else if (c.nesterov) {
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

}  // namespace

STEPFORGE_CPU_UPDATE_ENTRY(sgd, SgdLaunch, sgd_run)

}  // namespace stepforge::cpu::STEPFORGE_ISA_NS
