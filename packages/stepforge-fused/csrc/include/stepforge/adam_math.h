// SPDX-License-Identifier: Apache-2.0
// Adam / AdamW element update shared by the CPU and CUDA kernels.
//
// The operation order is torch's fused CPU AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, vector body),
// so with FP contraction disabled (-ffp-contract=off; explicit fmaf where torch gets an FMA) the CPU result is
// bit-identical to torch.optim.AdamW(fused=True) / Adam(fused=True) for float32:
//   g = g / div                        (div == 1: no-op, skipped)
//   Adam (L2):  g = fma(p, wd, g)      AdamW: p = p * (1 - lr*wd)   (both only when wd != 0)
//   m = lerp(m, g, 1-b1) = fma(w, g-m, m) if |w| < 0.5 else fma(w-1, g-m, g)      (w = 1-b1)
//   v = fma((1-b2)*g, g, v*b2)
//   p = p + (-(lr/bc1) * m) / (sqrt(v)/sqrt(bc2) + eps)
#pragma once

#include <cmath>

#include "stepforge/common.h"

namespace stepforge {

// Per-tensor constants, computed once per tensor on the host in double (torch does the same) and rounded to
// float exactly where torch rounds them.
struct AdamConsts {
  float lerp_w;       // 1 - beta1 (or 1 - beta1 - 1 when |1-beta1| >= 0.5, see lerp_small)
  bool lerp_small;    // |1 - beta1| < 0.5
  float beta2;        // beta2
  float one_minus_b2; // 1 - beta2
  float wd;           // weight decay (L2 mode)
  float decay;        // 1 - lr*wd in AdamW mode with wd != 0, else exactly 1
  float neg_step;     // -(lr / bc1)
  float bc2_sqrt;     // sqrt(1 - beta2^t) (1 without bias correction)
  float eps;
  float div;          // grad divisor (exactly 1: none)
  bool has_div;
  bool l2;            // Adam (L2) decay
  bool decoupled;     // AdamW decay
};

STEPFORGE_HOST_DEVICE AdamConsts make_adam_consts(double lr, double beta1, double beta2, double eps, double wd,
                                                  bool adamw_mode, bool bias_correction, long long step,
                                                  double grad_divisor) {
  AdamConsts c;
  double bc1 = 1.0, bc2 = 1.0;
  if (bias_correction) {
    bc1 = 1.0 - std::pow(beta1, double(step));
    bc2 = 1.0 - std::pow(beta2, double(step));
  }
  double w = 1.0 - beta1;
  c.lerp_small = std::fabs(float(w)) < 0.5f;
  c.lerp_w = c.lerp_small ? float(w) : float(w) - 1.0f;
  c.beta2 = float(beta2);
  c.one_minus_b2 = float(1.0 - beta2);
  c.wd = float(wd);
  c.decay = (adamw_mode && wd != 0.0) ? float(1.0 - lr * wd) : 1.0f;
  c.neg_step = float(-(lr / bc1));
  c.bc2_sqrt = float(std::sqrt(bc2));
  c.eps = float(eps);
  c.div = float(grad_divisor);
  c.has_div = grad_divisor != 1.0;
  c.l2 = !adamw_mode && wd != 0.0;
  c.decoupled = adamw_mode && wd != 0.0;
  return c;
}

// One element. p is the float32 value being updated (the master when master weights are used).
// kHasDiv = false skips the grad division (exact either way: g / 1 == g); the CPU kernels pick the variant per
// tensor because a vector division costs as much as the memory traffic of an element here.
template <bool kHasDiv>
STEPFORGE_HOST_DEVICE void adam_update_t(float& p, float& m, float& v, float g, const AdamConsts& c) {
  // Branch-free where exact: x * 1 is exact for every x (NaN and inf included), so decay == 1 encodes "off"
  // (GCC does not vectorise the loop with three selects here). The L2 term stays a select: fma(p, 0, g) would
  // turn an inf/NaN param into a NaN grad.
  if constexpr (kHasDiv) g = g / c.div;
  g = c.l2 ? fmaf(p, c.wd, g) : g;
  p = p * c.decay;
  float diff = g - m;
  m = fmaf(c.lerp_w, diff, c.lerp_small ? m : g);
  v = fmaf(c.one_minus_b2 * g, g, v * c.beta2);
  float denom = sqrtf(v) / c.bc2_sqrt + c.eps;
  p = p + (c.neg_step * m) / denom;
}

STEPFORGE_HOST_DEVICE void adam_update(float& p, float& m, float& v, float g, const AdamConsts& c) {
  adam_update_t<true>(p, m, v, g, c);
}

// torch's scalar tail (the last numel % 8 elements of each tensor on CPU, measured with torch 2.13 on AVX-512)
// contracts the second moment the other way round: v = fma(v, beta2, ((1-b2)*g)*g). Everything else is the
// same as adam_update. Used only by the CPU kernels, to stay bit-identical with torch.optim.AdamW(fused=True).
constexpr long long kTorchAdamVecWidth = 8;

STEPFORGE_HOST_DEVICE void adam_update_torch_tail(float& p, float& m, float& v, float g, const AdamConsts& c) {
  g = g / c.div;
  g = c.l2 ? fmaf(p, c.wd, g) : g;
  p = p * c.decay;
  float diff = g - m;
  m = fmaf(c.lerp_w, diff, c.lerp_small ? m : g);
  v = fmaf(v, c.beta2, (c.one_minus_b2 * g) * g);
  float denom = sqrtf(v) / c.bc2_sqrt + c.eps;
  p = p + (c.neg_step * m) / denom;
}

}  // namespace stepforge
