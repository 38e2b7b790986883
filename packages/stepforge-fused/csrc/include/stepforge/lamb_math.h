// SPDX-License-Identifier: Apache-2.0
// LAMB element math (apex / ColossalAI FusedLAMB semantics), shared by CPU and CUDA. Two passes per tensor:
//   pass 1 (lamb_moments): update m, v, return u (the Adam direction incl. decoupled decay) for the norms;
//   pass 2 (lamb_direction + apply): recompute u from the stored m, v and the pre-update p, then
//           p = p - lr * ratio * u, with ratio = ||p|| / ||u|| (see lamb_trust_ratio).
#pragma once

#include <cmath>

#include "stepforge/common.h"

namespace stepforge {

struct LambConsts {
  float beta1, beta3, beta2, one_minus_b2, eps, wd, inv_bc1, inv_bc2, inv_div;
  bool has_div, l2, decoupled;
};

STEPFORGE_HOST_DEVICE LambConsts make_lamb_consts(double beta1, double beta2, double eps, double wd,
                                                  bool adam_w_mode, bool bias_correction, bool grad_averaging,
                                                  long long step, double grad_divisor) {
  LambConsts c;
  double bc1 = 1.0, bc2 = 1.0;
  if (bias_correction) {
    bc1 = 1.0 - std::pow(beta1, double(step));
    bc2 = 1.0 - std::pow(beta2, double(step));
  }
  c.beta1 = float(beta1);
  c.beta3 = grad_averaging ? float(1.0 - beta1) : 1.0f;
  c.beta2 = float(beta2);
  c.one_minus_b2 = float(1.0 - beta2);
  c.eps = float(eps);
  c.wd = float(wd);
  c.inv_bc1 = float(1.0 / bc1);
  c.inv_bc2 = float(1.0 / bc2);
  c.inv_div = float(1.0 / grad_divisor);
  c.has_div = grad_divisor != 1.0;
  c.l2 = !adam_w_mode && wd != 0.0;
  c.decoupled = adam_w_mode && wd != 0.0;
  return c;
}

STEPFORGE_HOST_DEVICE float lamb_direction(float p, float m, float v, const LambConsts& c) {
  float u = (m * c.inv_bc1) / (sqrtf(v * c.inv_bc2) + c.eps);
  if (c.decoupled) u = u + c.wd * p;
  return u;
}

// Pass 1: updates m and v in place and returns u.
STEPFORGE_HOST_DEVICE float lamb_moments(float p, float& m, float& v, float g, const LambConsts& c) {
  g = g * c.inv_div;  // no bit-exactness contract for LAMB: a multiply (exact for 1) beats a division
  if (c.l2) g = g + c.wd * p;
  m = c.beta1 * m + c.beta3 * g;
  v = c.beta2 * v + c.one_minus_b2 * g * g;
  return lamb_direction(p, m, v, c);
}

// ratio = ||p|| / ||u|| when decay is used (or nvlamb) and both norms are non-zero, else 1; then clamped.
STEPFORGE_HOST_DEVICE float lamb_trust_ratio(double p_norm, double u_norm, bool use_ratio, double clip_min,
                                             double clip_max) {
  double r = 1.0;
  if (use_ratio && p_norm != 0.0 && u_norm != 0.0) r = p_norm / u_norm;
  if (r < clip_min) r = clip_min;
  if (r > clip_max) r = clip_max;
  return float(r);
}

}  // namespace stepforge
