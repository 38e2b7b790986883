// SPDX-License-Identifier: Apache-2.0
// SGD element update (torch.optim.SGD semantics + apex's wd_after_momentum), the one definition used by the CPU
// and CUDA kernels. Branch-free where exact, so the CPU loops vectorise: the grad divisor is a multiply by its
// inverse (exact for 1 and for power-of-two loss scales), each decay term is an fma whose coefficient is 0 when
// that decay is off; momentum, nesterov and "first step" are compile-time flags chosen per tensor.
//   g = g * (1/div)
//   g = fma(wd_before, p, g)                   (wd_before = wd unless wd_after_momentum, else 0)
//   momentum: buf = first ? g : fma(1-dampening, g, buf*momentum);  d = nesterov ? fma(momentum, buf, g) : buf
//   d = fma(wd_after, p, d)                    (wd_after = wd if wd_after_momentum, else 0)
//   p = fma(-lr, d, p)
#pragma once

#include <cmath>

#include "stepforge/common.h"

namespace stepforge {

struct SgdConsts {
  float lr, momentum, one_minus_damp, wd_before, wd_after, inv_div;
  bool has_div;       // the divisor is not 1 (the unscaled-grad write-back has something to store)
  bool has_momentum;  // momentum != 0: a buffer exists
  bool nesterov;
};

STEPFORGE_HOST_DEVICE SgdConsts make_sgd_consts(double lr, double momentum, double dampening, double wd,
                                                bool nesterov, bool wd_after_momentum, double grad_divisor) {
  SgdConsts c;
  c.lr = float(lr);
  c.momentum = float(momentum);
  c.one_minus_damp = float(1.0 - dampening);
  c.wd_before = wd_after_momentum ? 0.0f : float(wd);
  c.wd_after = wd_after_momentum ? float(wd) : 0.0f;
  c.inv_div = float(1.0 / double(float(grad_divisor)));
  c.has_div = grad_divisor != 1.0;
  c.has_momentum = momentum != 0.0;
  c.nesterov = nesterov;
  return c;
}

// One element; `buf` is ignored without momentum. FIRST initialises the buffer with the grad (torch: clone of
// d_p).
template <bool MOM, bool NEST, bool FIRST>
STEPFORGE_HOST_DEVICE void sgd_update_t(float& p, float& buf, float g, const SgdConsts& c) {
  g = g * c.inv_div;
  g = fmaf(c.wd_before, p, g);
  float d = g;
  if constexpr (MOM) {
    if constexpr (FIRST) {
      buf = g;
    } else {
      buf = fmaf(c.one_minus_damp, g, buf * c.momentum);  // torch: buf.mul_(momentum).add_(g, alpha=1-dampening)
    }
    if constexpr (NEST) {
      d = fmaf(c.momentum, buf, g);
    } else {
      d = buf;
    }
  }
  d = fmaf(c.wd_after, p, d);
  p = fmaf(-c.lr, d, p);
}

// The same with the flags chosen at run time (CUDA: uniform per tensor, so the branch does not diverge).
STEPFORGE_HOST_DEVICE void sgd_update(float& p, float& buf, float g, bool first, const SgdConsts& c) {
  if (!c.has_momentum) {
    sgd_update_t<false, false, false>(p, buf, g, c);
  } else if (c.nesterov) {
    if (first) {
      sgd_update_t<true, true, true>(p, buf, g, c);
    } else {
      sgd_update_t<true, true, false>(p, buf, g, c);
    }
  } else if (first) {
    sgd_update_t<true, false, true>(p, buf, g, c);
  } else {
    sgd_update_t<true, false, false>(p, buf, g, c);
  }
}

}  // namespace stepforge
