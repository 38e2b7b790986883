// SPDX-License-Identifier: Apache-2.0
// The host side of every CPU kernel (ops.cpp): argument validation, per-tensor constants (bias corrections in
// double), offsets, the found_inf protocol, then one call into the active ISA's kernels (isa.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace stepforge::cpu {

// A read-only int64 array (pointer list, sizes, steps); data == nullptr means "absent" (Python None).
struct I64 {
  const int64_t* data = nullptr;
  int64_t size = 0;
  bool present() const { return data != nullptr || size > 0; }
};

bool adam(I64 params, I64 grads, I64 exp_avgs, I64 exp_avg_sqs, I64 masters, I64 sizes, I64 steps,
          int param_dtype, int grad_dtype, double lr, double beta1, double beta2, double eps, double weight_decay,
          bool adamw_mode, bool bias_correction, double grad_divisor, int64_t found_inf_ptr, bool check_finite,
          int ctx, bool write_grads);

bool sgd(I64 params, I64 grads, I64 momentum_buffers, I64 masters, I64 sizes, I64 first_run, int param_dtype,
         int grad_dtype, double lr, double momentum, double dampening, double weight_decay, bool nesterov,
         bool wd_after_momentum, double grad_divisor, int64_t found_inf_ptr, bool check_finite, int ctx,
         bool write_grads);

bool lamb(I64 params, I64 grads, I64 exp_avgs, I64 exp_avg_sqs, I64 masters, I64 sizes, I64 steps,
          int param_dtype, int grad_dtype, double lr, double beta1, double beta2, double eps, double weight_decay,
          bool adam_w_mode, bool bias_correction, bool grad_averaging, bool use_nvlamb, double trust_clip_min,
          double trust_clip_max, double grad_divisor, int64_t found_inf_ptr, bool check_finite, int ctx,
         bool write_grads, int64_t norms_out_ptr = 0, int64_t norms_in_ptr = 0);

double l2norm(I64 ptrs, I64 sizes, int dtype, int64_t per_tensor_out_ptr, int ctx);

bool scale(I64 src, I64 dst, I64 sizes, int src_dtype, int dst_dtype, double scale, int64_t found_inf_ptr,
           int ctx);

}  // namespace stepforge::cpu
