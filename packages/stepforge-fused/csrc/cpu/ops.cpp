// SPDX-License-Identifier: Apache-2.0
// Host side of every CPU kernel (see ops.h): argument validation, per-tensor constants (bias corrections in
// double), offsets, the found_inf protocol, then one call into the active ISA's kernels. Compiled once.
#include "cpu/ops.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/isa.h"
#include "cpu/kernels.h"

namespace stepforge::cpu {
namespace {

void check_dtype(int code, const char* what) {
  if (!is_dtype_code(code))
    throw std::invalid_argument(std::string(what) + ": unknown dtype code " + std::to_string(code) + " (must be " +
                                kDTypeCodesHelp + ")");
}

void check_list(const I64& a, int64_t n, const char* what, const I64& sizes) {
  if (a.size != n)
    throw std::invalid_argument(std::string(what) + " has " + std::to_string(a.size) + " entries, expected " +
                                std::to_string(n) + " (one per tensor)");
  for (int64_t i = 0; i < n; ++i)
    if (a.data[i] == 0 && sizes.data[i] > 0)
      throw std::invalid_argument(std::string(what) + "[" + std::to_string(i) + "] is a null pointer");
}

std::vector<int64_t> make_offsets(const I64& sizes) {
  std::vector<int64_t> off(size_t(sizes.size) + 1, 0);
  for (int64_t i = 0; i < sizes.size; ++i) {
    if (sizes.data[i] < 0) throw std::invalid_argument("sizes[" + std::to_string(i) + "] is negative");
    off[size_t(i) + 1] = off[size_t(i)] + sizes.data[i];
  }
  return off;
}

float* found_inf(int64_t ptr) { return reinterpret_cast<float*>(ptr); }

// true if the call must be skipped (flag already set, or non-finite grads found and reported).
bool overflow_gate(const MultiTensor& mt, const I64& grads, int grad_dtype, double divisor, int64_t found_ptr,
                   bool check_finite) {
  float* fi = found_inf(found_ptr);
  if (fi && *fi != 0.0f) return true;
  if (check_finite && active_table().any_non_finite(mt, grads.data, grad_dtype, divisor)) {
    if (fi) *fi = 1.0f;
    return true;
  }
  return false;
}

}  // namespace

// The lists and scalars Adam and LAMB share: one entry per tensor everywhere, masters only for 16-bit params.
static void check_moment_lists(I64 params, I64 grads, I64 exp_avgs, I64 exp_avg_sqs, I64 masters, I64 sizes,
                               I64 steps, int param_dtype, double grad_divisor) {
  const int64_t n = sizes.size;
  check_list(params, n, "params", sizes);
  check_list(grads, n, "grads", sizes);
  check_list(exp_avgs, n, "exp_avgs", sizes);
  check_list(exp_avg_sqs, n, "exp_avg_sqs", sizes);
  if (masters.present()) {
    if (param_dtype == kFloat32)
      throw std::invalid_argument("masters are only for float16/bfloat16 params (param_dtype is float32)");
    check_list(masters, n, "masters", sizes);
  }
  if (steps.size != n) throw std::invalid_argument("steps must have one entry per tensor");
  if (!(grad_divisor > 0.0) || !std::isfinite(grad_divisor))
    throw std::invalid_argument("grad_divisor must be a positive finite number");
}

bool adam(I64 params, I64 grads, I64 exp_avgs, I64 exp_avg_sqs, I64 masters, I64 sizes, I64 steps,
          int param_dtype, int grad_dtype, double lr, double beta1, double beta2, double eps, double weight_decay,
          bool adamw_mode, bool bias_correction, double grad_divisor, int64_t found_inf_ptr, bool check_finite,
          int ctx, bool write_grads) {
  const int64_t n = sizes.size;
  check_dtype(param_dtype, "adam param_dtype");
  check_dtype(grad_dtype, "adam grad_dtype");
  check_moment_lists(params, grads, exp_avgs, exp_avg_sqs, masters, sizes, steps, param_dtype, grad_divisor);
  std::vector<int64_t> off = make_offsets(sizes);
  MultiTensor mt{n, off.data(), sizes.data, resolve_threads(ctx)};
  if (overflow_gate(mt, grads, grad_dtype, grad_divisor, found_inf_ptr, check_finite)) return true;
  std::vector<AdamConsts> consts(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (bias_correction && steps.data[i] < 1)
      throw std::invalid_argument("steps[" + std::to_string(i) + "] must be >= 1 (the step being taken)");
    if (i > 0 && steps.data[i] == steps.data[i - 1]) {
      consts[size_t(i)] = consts[size_t(i) - 1];
    } else {
      consts[size_t(i)] = make_adam_consts(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction,
                                           steps.data[i], grad_divisor);
    }
  }
  AdamLaunch L;
  L.mt = mt;
  L.params = params.data;
  L.grads = grads.data;
  L.exp_avgs = exp_avgs.data;
  L.exp_avg_sqs = exp_avg_sqs.data;
  L.masters = masters.present() ? masters.data : nullptr;
  L.consts = consts.data();
  L.param_dtype = param_dtype;
  L.grad_dtype = grad_dtype;
  L.write_grads = write_grads && grad_divisor != 1.0;
  active_table().adam(L);
  return false;
}

bool sgd(I64 params, I64 grads, I64 momentum_buffers, I64 masters, I64 sizes, I64 first_run, int param_dtype,
         int grad_dtype, double lr, double momentum, double dampening, double weight_decay, bool nesterov,
         bool wd_after_momentum, double grad_divisor, int64_t found_inf_ptr, bool check_finite, int ctx,
         bool write_grads) {
  const int64_t n = sizes.size;
  check_dtype(param_dtype, "sgd param_dtype");
  check_dtype(grad_dtype, "sgd grad_dtype");
  check_list(params, n, "params", sizes);
  check_list(grads, n, "grads", sizes);
  if (momentum != 0.0) {
    check_list(momentum_buffers, n, "momentum_buffers", sizes);
    if (first_run.size != n) throw std::invalid_argument("first_run must have one entry per tensor");
  } else if (momentum_buffers.present()) {
    throw std::invalid_argument("momentum_buffers must be None when momentum == 0");
  }
  if (masters.present()) {
    if (param_dtype == kFloat32)
      throw std::invalid_argument("masters are only for float16/bfloat16 params (param_dtype is float32)");
    check_list(masters, n, "masters", sizes);
  }
  if (!(grad_divisor > 0.0) || !std::isfinite(grad_divisor))
    throw std::invalid_argument("grad_divisor must be a positive finite number");
  std::vector<int64_t> off = make_offsets(sizes);
  MultiTensor mt{n, off.data(), sizes.data, resolve_threads(ctx)};
  if (overflow_gate(mt, grads, grad_dtype, grad_divisor, found_inf_ptr, check_finite)) return true;
  SgdLaunch L;
  L.mt = mt;
  L.params = params.data;
  L.grads = grads.data;
  L.bufs = momentum != 0.0 ? momentum_buffers.data : nullptr;
  L.masters = masters.present() ? masters.data : nullptr;
  L.first_run = momentum != 0.0 ? first_run.data : nullptr;
  L.consts = make_sgd_consts(lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum, grad_divisor);
  L.param_dtype = param_dtype;
  L.grad_dtype = grad_dtype;
  L.write_grads = write_grads && grad_divisor != 1.0;
  active_table().sgd(L);
  return false;
}

bool lamb(I64 params, I64 grads, I64 exp_avgs, I64 exp_avg_sqs, I64 masters, I64 sizes, I64 steps,
          int param_dtype, int grad_dtype, double lr, double beta1, double beta2, double eps, double weight_decay,
          bool adam_w_mode, bool bias_correction, bool grad_averaging, bool use_nvlamb, double trust_clip_min,
          double trust_clip_max, double grad_divisor, int64_t found_inf_ptr, bool check_finite, int ctx,
         bool write_grads, int64_t norms_out_ptr, int64_t norms_in_ptr) {
  const int64_t n = sizes.size;
  check_dtype(param_dtype, "lamb param_dtype");
  check_dtype(grad_dtype, "lamb grad_dtype");
  check_moment_lists(params, grads, exp_avgs, exp_avg_sqs, masters, sizes, steps, param_dtype, grad_divisor);
  if (norms_out_ptr != 0 && norms_in_ptr != 0)
    throw std::invalid_argument("lamb: pass norms_out_ptr (norms pass) or norms_in_ptr (apply pass), not both");
  std::vector<int64_t> off = make_offsets(sizes);
  MultiTensor mt{n, off.data(), sizes.data, resolve_threads(ctx)};
  // The apply pass reads no grads: the finite check and the grad write-back belong to the norms pass.
  if (norms_in_ptr == 0 && overflow_gate(mt, grads, grad_dtype, grad_divisor, found_inf_ptr, check_finite))
    return true;
  std::vector<LambConsts> consts(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (bias_correction && steps.data[i] < 1)
      throw std::invalid_argument("steps[" + std::to_string(i) + "] must be >= 1 (the step being taken)");
    consts[size_t(i)] = make_lamb_consts(beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction,
                                         grad_averaging, steps.data[i], grad_divisor);
  }
  std::vector<double> p_sq(static_cast<size_t>(n), 0.0), u_sq(static_cast<size_t>(n), 0.0);
  std::vector<float> step_scale(static_cast<size_t>(n), 0.0f);
  LambLaunch L;
  L.mt = mt;
  L.params = params.data;
  L.grads = grads.data;
  L.exp_avgs = exp_avgs.data;
  L.exp_avg_sqs = exp_avg_sqs.data;
  L.masters = masters.present() ? masters.data : nullptr;
  L.consts = consts.data();
  L.p_sq = p_sq.data();
  L.u_sq = u_sq.data();
  L.param_dtype = param_dtype;
  L.grad_dtype = grad_dtype;
  L.write_grads = norms_in_ptr == 0 && write_grads && grad_divisor != 1.0;
  if (norms_in_ptr == 0) active_table().lamb_pass1(L);
  if (norms_out_ptr != 0) {  // norms pass: sum p^2 into out[0, n), sum u^2 into out[n, 2n); no update yet
    double* out = reinterpret_cast<double*>(norms_out_ptr);
    for (int64_t i = 0; i < n; ++i) {
      out[i] = p_sq[size_t(i)];
      out[n + i] = u_sq[size_t(i)];
    }
    return false;
  }
  if (norms_in_ptr != 0) {  // apply pass: the (reduced) sums from the caller replace pass 1's
    const double* in = reinterpret_cast<const double*>(norms_in_ptr);
    for (int64_t i = 0; i < n; ++i) {
      p_sq[size_t(i)] = in[i];
      u_sq[size_t(i)] = in[n + i];
    }
  }
  const bool use_ratio = weight_decay != 0.0 || use_nvlamb;
  for (int64_t i = 0; i < n; ++i) {
    const float r = lamb_trust_ratio(std::sqrt(p_sq[size_t(i)]), std::sqrt(u_sq[size_t(i)]), use_ratio,
                                     trust_clip_min, trust_clip_max);
    step_scale[size_t(i)] = float(lr * double(r));
  }
  L.step_scale = step_scale.data();
  active_table().lamb_pass2(L);
  return false;
}

double l2norm(I64 ptrs, I64 sizes, int dtype, int64_t per_tensor_out_ptr, int ctx) {
  const int64_t n = sizes.size;
  check_dtype(dtype, "l2norm dtype");
  check_list(ptrs, n, "tensors", sizes);
  std::vector<int64_t> off = make_offsets(sizes);
  MultiTensor mt{n, off.data(), sizes.data, resolve_threads(ctx)};
  std::vector<double> sq(static_cast<size_t>(n), 0.0);
  if (n > 0) active_table().sum_squares(mt, ptrs.data, dtype, sq.data());
  double total = 0.0;
  float* out = reinterpret_cast<float*>(per_tensor_out_ptr);
  for (int64_t i = 0; i < n; ++i) {
    total += sq[size_t(i)];
    if (out) out[i] = float(std::sqrt(sq[size_t(i)]));
  }
  return std::sqrt(total);
}

bool scale(I64 src, I64 dst, I64 sizes, int src_dtype, int dst_dtype, double s, int64_t found_inf_ptr, int ctx) {
  const int64_t n = sizes.size;
  check_dtype(src_dtype, "scale src_dtype");
  check_dtype(dst_dtype, "scale dst_dtype");
  check_list(src, n, "src", sizes);
  check_list(dst, n, "dst", sizes);
  std::vector<int64_t> off = make_offsets(sizes);
  MultiTensor mt{n, off.data(), sizes.data, resolve_threads(ctx)};
  bool found = n > 0 && active_table().scale(mt, src.data, dst.data, src_dtype, dst_dtype, s);
  if (found) {
    float* fi = found_inf(found_inf_ptr);
    if (fi) *fi = 1.0f;
  }
  return found;
}

}  // namespace stepforge::cpu
