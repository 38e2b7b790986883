// SPDX-License-Identifier: Apache-2.0
// Multi-tensor Adam/AdamW (torch fused CPU operation order, adam_math.h). Compiled once per ISA (cmake/StepforgeSimd.cmake) into stepforge::cpu::<isa>.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/dispatch.h"

namespace stepforge::cpu::STEPFORGE_ISA_NS {
namespace {

// ---- Adam ----------------------------------------------------------------------------------------------
// 16-bit params with float32 masters (the mixed-precision path). The master, m and v are updated where they
// live (restrict pointers let GCC vectorise that; no memcpy of each master block into a temporary and back),
// only the grad is converted into an L1 block, and the rounded bf16 param is written with streaming stores
// from an L1 copy of the new masters (from_float_stream: no write-allocate read of the param lines). The
// loop is DRAM-bound: the streaming stores are what measured faster (~10% on 1x50M), the rest is neutral.
template <class P, class G, bool DIV, bool WB>
void adam_master_range(const AdamLaunch& L, int64_t t, int64_t b, int64_t e) {
  const AdamConsts c = L.consts[t];
  P* __restrict p = reinterpret_cast<P*>(L.params[t]);
  const G* __restrict g = reinterpret_cast<const G*>(L.grads[t]);
  float* __restrict w = reinterpret_cast<float*>(L.masters[t]);
  float* __restrict m = reinterpret_cast<float*>(L.exp_avgs[t]);
  float* __restrict v = reinterpret_cast<float*>(L.exp_avg_sqs[t]);
  alignas(64) float gtmp[kBlock];
  alignas(64) float ptmp[kBlock];
  // The first block ends where the param reaches a 64-byte boundary: every later block streams whole lines.
  const int64_t mis = int64_t((64 - (reinterpret_cast<uintptr_t>(p + b) & 63)) & 63) / int64_t(sizeof(P));
  for (int64_t i0 = b; i0 < e;) {
    const int64_t n = std::min(i0 == b && mis > 0 ? mis : kBlock, e - i0);
    const float* __restrict gb = WB ? unscale_block<false>(g + i0, gtmp, n, c.div) : float_view(g + i0, gtmp, n);
    float* __restrict wb = w + i0;
    float* __restrict mb = m + i0;
    float* __restrict vb = v + i0;
    float* __restrict pb = ptmp;
#pragma GCC ivdep
    for (int64_t j = 0; j < n; ++j) {
      float pv = wb[j], mv = mb[j], vv = vb[j];
      adam_update_t<DIV && !WB>(pv, mv, vv, gb[j], c);
      wb[j] = pv;
      mb[j] = mv;
      vb[j] = vv;
      pb[j] = pv;
    }
    if (i0 == b && mis > 0)
      from_float(ptmp, p + i0, n);
    else
      from_float_stream(ptmp, p + i0, n);
    i0 += n;
  }
  stream_fence();
}

template <class P, class G, bool MASTER, bool DIV, bool WB>
void adam_block_range(const AdamLaunch& L, int64_t t, int64_t b, int64_t e) {
  if constexpr (MASTER) {
    adam_master_range<P, G, DIV, WB>(L, t, b, e);
  } else {
    const AdamConsts c = L.consts[t];
    P* p = reinterpret_cast<P*>(L.params[t]);
    const G* g = reinterpret_cast<const G*>(L.grads[t]);
    float* m = reinterpret_cast<float*>(L.exp_avgs[t]);
    float* v = reinterpret_cast<float*>(L.exp_avg_sqs[t]);
    if constexpr (std::is_same_v<P, float> && std::is_same_v<G, float> && WB) {
      float* gw = const_cast<float*>(g);  // write-back requested: the unscaled grad replaces the scaled one
#pragma GCC ivdep
      for (int64_t i = b; i < e; ++i) {
        float pv = p[i], mv = m[i], vv = v[i];
        const float gv = g[i] / c.div;
        gw[i] = gv;
        adam_update_t<false>(pv, mv, vv, gv, c);
        p[i] = pv;
        m[i] = mv;
        v[i] = vv;
      }
    } else if constexpr (std::is_same_v<P, float> && std::is_same_v<G, float>) {
#pragma GCC ivdep
      for (int64_t i = b; i < e; ++i) {
        float pv = p[i], mv = m[i], vv = v[i];
        adam_update_t<DIV>(pv, mv, vv, g[i], c);
        p[i] = pv;
        m[i] = mv;
        v[i] = vv;
      }
    } else {
      alignas(64) float gtmp[kBlock];
      alignas(64) float ptmp[kBlock];
      for (int64_t i0 = b; i0 < e; i0 += kBlock) {
        const int64_t n = std::min(kBlock, e - i0);
        const float* gb = WB ? unscale_block<false>(g + i0, gtmp, n, c.div) : float_view(g + i0, gtmp, n);
        // Update a local copy: GCC does not vectorise this loop when the value lives in the caller's memory
        // next to converted temporaries (measured 3-4x slower steps).
        float* pb = ptmp;
        to_float(p + i0, ptmp, n);
        float* mb = m + i0;
        float* vb = v + i0;
#pragma GCC ivdep
        for (int64_t j = 0; j < n; ++j) adam_update_t<DIV && !WB>(pb[j], mb[j], vb[j], gb[j], c);
        from_float(pb, p + i0, n);
      }
    }
  }
}

// The last numel % kTorchAdamVecWidth elements of a tensor round like torch's scalar tail (adam_math.h).
template <class P, class G, bool MASTER>
void adam_torch_tail(const AdamLaunch& L, int64_t t, int64_t b, int64_t e) {
  AdamConsts c = L.consts[t];
  P* p = reinterpret_cast<P*>(L.params[t]);
  G* g = reinterpret_cast<G*>(L.grads[t]);
  float* m = reinterpret_cast<float*>(L.exp_avgs[t]);
  float* v = reinterpret_cast<float*>(L.exp_avg_sqs[t]);
  float* w = MASTER ? reinterpret_cast<float*>(L.masters[t]) : nullptr;
  const bool wb = L.write_grads && c.has_div;
  const float div = c.div;
  if (wb) c.div = 1.0f;  // the grad is divided (and stored) below; g / 1 is exact
  for (int64_t i = b; i < e; ++i) {
    float pv = MASTER ? w[i] : load_float(p + i);
    float gv = load_float(g + i);
    if (wb) {
      gv = gv / div;
      store_float(g + i, gv);  // the step itself uses the unrounded float, as torch's does
    }
    adam_update_torch_tail(pv, m[i], v[i], gv, c);
    if constexpr (MASTER) w[i] = pv;
    store_float(p + i, pv);
  }
}

template <class P, class G, bool MASTER>
void adam_segment(const AdamLaunch& L, int64_t t, int64_t b, int64_t e) {
  const int64_t size = L.mt.sizes[t];
  const int64_t body_end = size - size % kTorchAdamVecWidth;
  if (b < body_end) {
    if (L.consts[t].has_div && L.write_grads)
      adam_block_range<P, G, MASTER, true, true>(L, t, b, std::min(e, body_end));
    else if (L.consts[t].has_div)
      adam_block_range<P, G, MASTER, true, false>(L, t, b, std::min(e, body_end));
    else
      adam_block_range<P, G, MASTER, false, false>(L, t, b, std::min(e, body_end));
  }
  if (e > body_end) adam_torch_tail<P, G, MASTER>(L, t, std::max(b, body_end), e);
}

template <class P, class G, bool MASTER>
void adam_run(const AdamLaunch& L) {
  parallel_segments(L.mt, [&](int64_t, int64_t t, int64_t b, int64_t e) { adam_segment<P, G, MASTER>(L, t, b, e); });
}

}  // namespace

STEPFORGE_CPU_UPDATE_ENTRY(adam, AdamLaunch, adam_run)

}  // namespace stepforge::cpu::STEPFORGE_ISA_NS
