// SPDX-License-Identifier: Apache-2.0
// SGD element update (torch.optim.SGD semantics + apex's wd_after_momentum), shared by CPU and CUDA.
//   g = g / div
//   if wd and not wd_after_momentum: g = g + wd*p
//   if momentum: buf = first ? g : momentum*buf + (1-dampening)*g ; d = nesterov ? g + momentum*buf : buf
//   if wd and wd_after_momentum: d = d + wd*p
//   p = p - lr*d
#pragma once

#include "stepforge/common.h"

namespace stepforge {

struct SgdConsts {
  float lr, momentum, one_minus_damp, wd, div;
  bool has_div, has_momentum, nesterov, wd_before, wd_after;
};

STEPFORGE_HOST_DEVICE SgdConsts make_sgd_consts(double lr, double momentum, double dampening, double wd,
                                                bool nesterov, bool wd_after_momentum, double grad_divisor) {
  SgdConsts c;
  c.lr = float(lr);
  c.momentum = float(momentum);
  c.one_minus_damp = float(1.0 - dampening);
  c.wd = float(wd);
  c.div = float(grad_divisor);
  c.has_div = grad_divisor != 1.0;
  c.has_momentum = momentum != 0.0;
  c.nesterov = nesterov;
  c.wd_before = wd != 0.0 && !wd_after_momentum;
  c.wd_after = wd != 0.0 && wd_after_momentum;
  return c;
}

// `buf` is ignored when momentum == 0. `first` initialises the buffer with the grad (torch: clone of d_p).
STEPFORGE_HOST_DEVICE void sgd_update(float& p, float& buf, float g, bool first, const SgdConsts& c) {
  if (c.has_div) g = g / c.div;
  if (c.wd_before) g = g + c.wd * p;
  float d = g;
  if (c.has_momentum) {
    buf = first ? g : c.momentum * buf + c.one_minus_damp * g;
    d = c.nesterov ? g + c.momentum * buf : buf;
  }
  if (c.wd_after) d = d + c.wd * p;
  p = p - c.lr * d;
}

}  // namespace stepforge
