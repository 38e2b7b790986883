// SPDX-License-Identifier: Apache-2.0
// The one (param dtype, grad dtype, master weights) dispatch of the per-ISA update kernels (adam_kernel.cpp,
// sgd_kernel.cpp, lamb_kernel.cpp) and the macro that defines an entry point of kernels.h through it. Dtype
// codes come from the caller (ops.cpp has validated them and the master/param combination), never from data;
// masters exist only for 16-bit params, so <float, G, true> is never instantiated. Included only by the kernel
// files compiled once per ISA (internal linkage, see convert.h).
#pragma once

#include <type_traits>

#include "cpu/convert.h"
#include "cpu/kernels.h"
#include "cpu/multi_tensor.h"
#include "stepforge/dtype_dispatch.h"

namespace stepforge::cpu::STEPFORGE_ISA_NS {
namespace {

// Op<P, G, MASTER>::run(L) for the storage types named by L.param_dtype / L.grad_dtype.
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

}  // namespace
}  // namespace stepforge::cpu::STEPFORGE_ISA_NS

// Defines the kernels.h entry point `void ENTRY(const LaunchT&)` of this ISA copy as a dtype dispatch onto the
// template RUN<P, G, MASTER>(const LaunchT&). Use at namespace stepforge::cpu::<isa> scope, after RUN.
#define STEPFORGE_CPU_UPDATE_ENTRY(ENTRY, LaunchT, RUN)                        \
  namespace {                                                                  \
  template <class P, class G, bool M>                                          \
  struct ENTRY##_op {                                                          \
    static void run(const LaunchT& L) { RUN<P, G, M>(L); }                     \
  };                                                                           \
  }                                                                            \
  void ENTRY(const LaunchT& L) { dispatch_pgm<ENTRY##_op>(L); }
