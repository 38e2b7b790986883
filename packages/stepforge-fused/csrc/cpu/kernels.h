// SPDX-License-Identifier: Apache-2.0
// Interface between the ISA-independent host code (dispatch.cpp, bindings) and the per-ISA kernel copies
// (kernels.cpp compiled once per ISA into namespace stepforge::cpu::<isa>). Everything here is plain data:
// per-tensor constants are prepared by dispatch.cpp so the kernels only loop.
#pragma once

#include <cstdint>

#include "stepforge/adam_math.h"
#include "stepforge/lamb_math.h"
#include "stepforge/sgd_math.h"

namespace stepforge::cpu {

// n tensors; offsets has n+1 entries (exclusive prefix sum of sizes), so offsets[n] is the total element count.
struct MultiTensor {
  int64_t n = 0;
  const int64_t* offsets = nullptr;
  const int64_t* sizes = nullptr;
  int num_threads = 1;
};

struct AdamLaunch {
  MultiTensor mt;
  const int64_t* params = nullptr;
  const int64_t* grads = nullptr;
  const int64_t* exp_avgs = nullptr;
  const int64_t* exp_avg_sqs = nullptr;
  const int64_t* masters = nullptr;  // nullptr: no master weights
  const AdamConsts* consts = nullptr;  // one per tensor
  int param_dtype = kFloat32;
  int grad_dtype = kFloat32;
  bool write_grads = false;  // store g / divisor back into grads (set only when the divisor is not 1)
};

struct SgdLaunch {
  MultiTensor mt;
  const int64_t* params = nullptr;
  const int64_t* grads = nullptr;
  const int64_t* bufs = nullptr;  // nullptr when momentum == 0
  const int64_t* masters = nullptr;
  const int64_t* first_run = nullptr;
  SgdConsts consts;
  int param_dtype = kFloat32;
  int grad_dtype = kFloat32;
  bool write_grads = false;  // store the unscaled grad back into grads (set only when the divisor is not 1)
};

struct LambLaunch {
  MultiTensor mt;
  const int64_t* params = nullptr;
  const int64_t* grads = nullptr;
  const int64_t* exp_avgs = nullptr;
  const int64_t* exp_avg_sqs = nullptr;
  const int64_t* masters = nullptr;
  const LambConsts* consts = nullptr;  // one per tensor
  double* p_sq = nullptr;              // out of pass 1: per-tensor sum of p^2 (n doubles, zeroed by the caller)
  double* u_sq = nullptr;              // out of pass 1: per-tensor sum of u^2
  const float* step_scale = nullptr;   // in for pass 2: per-tensor lr * trust ratio
  int param_dtype = kFloat32;
  int grad_dtype = kFloat32;
  bool write_grads = false;            // pass 1 stores the unscaled grad back (only when the divisor is not 1)
};

struct KernelTable {
  const char* name;
  void (*adam)(const AdamLaunch&);
  void (*sgd)(const SgdLaunch&);
  void (*lamb_pass1)(const LambLaunch&);
  void (*lamb_pass2)(const LambLaunch&);
  // true if any element of x / divisor is inf or NaN.
  bool (*any_non_finite)(const MultiTensor&, const int64_t* ptrs, int dtype, double divisor);
  // per-tensor sum of squares into out_sq (n doubles, overwritten).
  void (*sum_squares)(const MultiTensor&, const int64_t* ptrs, int dtype, double* out_sq);
  // dst = src * scale (converting); returns true if any *input* element was inf/NaN.
  bool (*scale)(const MultiTensor&, const int64_t* src, const int64_t* dst, int src_dtype, int dst_dtype,
                double scale);
};

#define STEPFORGE_DECLARE_TABLE(isa) \
  namespace isa {                    \
  const KernelTable& table();        \
  }
#if defined(STEPFORGE_HAVE_SCALAR)
STEPFORGE_DECLARE_TABLE(scalar)
#endif
#if defined(STEPFORGE_HAVE_AVX2)
STEPFORGE_DECLARE_TABLE(avx2)
#endif
#if defined(STEPFORGE_HAVE_AVX512)
STEPFORGE_DECLARE_TABLE(avx512)
#endif
#undef STEPFORGE_DECLARE_TABLE

}  // namespace stepforge::cpu
