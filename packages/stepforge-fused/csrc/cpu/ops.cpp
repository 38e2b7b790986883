// SPDX-License-Identifier: Apache-2.0
// The entry of every CPU kernel, compiled once: its Python binding (register_cpu_kernels: arguments converted
// while holding the GIL, the kernel run with it released; signatures in csrc/README.md), then the host side
// (argument validation, per-tensor constants with bias corrections in double, offsets, the found_inf protocol)
// and one call into the active ISA's kernels.
#include "cpu/ops.h"

#include <pybind11/pybind11.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/i64_arg.h"
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

namespace py = pybind11;
using stepforge::bindings::I64Arg;

namespace stepforge::bindings {

void register_cpu_kernels(py::module_& m) {
  m.def(
      "adam",
      [](py::handle params, py::handle grads, py::handle exp_avgs, py::handle exp_avg_sqs, py::handle masters,
         py::handle sizes, py::handle steps, int param_dtype, int grad_dtype, double lr, double beta1, double beta2,
         double eps, double weight_decay, bool adamw_mode, bool bias_correction, double grad_divisor,
         int64_t found_inf_ptr, bool check_finite, int ctx, bool write_unscaled_grads) {
        I64Arg p(params, "params"), g(grads, "grads"), m1(exp_avgs, "exp_avgs"), m2(exp_avg_sqs, "exp_avg_sqs"),
            w(masters, "masters"), s(sizes, "sizes"), st(steps, "steps");
        py::gil_scoped_release nogil;
        return stepforge::cpu::adam(p.view(), g.view(), m1.view(), m2.view(), w.view(), s.view(), st.view(),
                                    param_dtype, grad_dtype, lr, beta1, beta2, eps, weight_decay, adamw_mode,
                                    bias_correction, grad_divisor, found_inf_ptr, check_finite, ctx,
                                    write_unscaled_grads);
      },
      py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("masters"),
      py::arg("sizes"), py::arg("steps"), py::arg("param_dtype"), py::arg("grad_dtype"), py::arg("lr"),
      py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw_mode"),
      py::arg("bias_correction"), py::arg("grad_divisor") = 1.0, py::arg("found_inf_ptr") = 0,
      py::arg("check_finite") = false, py::arg("ctx") = 0, py::kw_only(), py::arg("write_unscaled_grads") = false,
      "Multi-tensor Adam/AdamW step (torch's fused CPU operation order). Returns True if skipped. "
      "write_unscaled_grads: store grad / grad_divisor back into the grads in the same pass (torch's fused "
      "grad_scale contract; nothing is written when the step is skipped or grad_divisor is 1).");

  m.def(
      "sgd",
      [](py::handle params, py::handle grads, py::handle bufs, py::handle masters, py::handle sizes,
         py::handle first_run, int param_dtype, int grad_dtype, double lr, double momentum, double dampening,
         double weight_decay, bool nesterov, bool wd_after_momentum, double grad_divisor, int64_t found_inf_ptr,
         bool check_finite, int ctx, bool write_unscaled_grads) {
        I64Arg p(params, "params"), g(grads, "grads"), b(bufs, "momentum_buffers"), w(masters, "masters"),
            s(sizes, "sizes"), f(first_run, "first_run");
        py::gil_scoped_release nogil;
        return stepforge::cpu::sgd(p.view(), g.view(), b.view(), w.view(), s.view(), f.view(), param_dtype,
                                   grad_dtype, lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum,
                                   grad_divisor, found_inf_ptr, check_finite, ctx, write_unscaled_grads);
      },
      py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"), py::arg("masters"), py::arg("sizes"),
      py::arg("first_run"), py::arg("param_dtype"), py::arg("grad_dtype"), py::arg("lr"), py::arg("momentum"),
      py::arg("dampening"), py::arg("weight_decay"), py::arg("nesterov"), py::arg("wd_after_momentum"),
      py::arg("grad_divisor") = 1.0, py::arg("found_inf_ptr") = 0, py::arg("check_finite") = false,
      py::arg("ctx") = 0, py::kw_only(), py::arg("write_unscaled_grads") = false,
      "Multi-tensor SGD step (torch.optim.SGD semantics). Returns True if skipped. write_unscaled_grads: as adam.");

  m.def(
      "lamb",
      [](py::handle params, py::handle grads, py::handle exp_avgs, py::handle exp_avg_sqs, py::handle masters,
         py::handle sizes, py::handle steps, int param_dtype, int grad_dtype, double lr, double beta1, double beta2,
         double eps, double weight_decay, bool adam_w_mode, bool bias_correction, bool grad_averaging,
         bool use_nvlamb, double trust_clip_min, double trust_clip_max, double grad_divisor, int64_t found_inf_ptr,
         bool check_finite, int ctx, bool write_unscaled_grads, int64_t norms_out_ptr, int64_t norms_in_ptr) {
        I64Arg p(params, "params"), g(grads, "grads"), m1(exp_avgs, "exp_avgs"), m2(exp_avg_sqs, "exp_avg_sqs"),
            w(masters, "masters"), s(sizes, "sizes"), st(steps, "steps");
        py::gil_scoped_release nogil;
        return stepforge::cpu::lamb(p.view(), g.view(), m1.view(), m2.view(), w.view(), s.view(), st.view(),
                                    param_dtype, grad_dtype, lr, beta1, beta2, eps, weight_decay, adam_w_mode,
                                    bias_correction, grad_averaging, use_nvlamb, trust_clip_min, trust_clip_max,
                                    grad_divisor, found_inf_ptr, check_finite, ctx, write_unscaled_grads,
                                    norms_out_ptr, norms_in_ptr);
      },
      py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("masters"),
      py::arg("sizes"), py::arg("steps"), py::arg("param_dtype"), py::arg("grad_dtype"), py::arg("lr"),
      py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adam_w_mode"),
      py::arg("bias_correction"), py::arg("grad_averaging"), py::arg("use_nvlamb"), py::arg("trust_clip_min") = 0.0,
      py::arg("trust_clip_max") = std::numeric_limits<double>::infinity(), py::arg("grad_divisor") = 1.0,
      py::arg("found_inf_ptr") = 0, py::arg("check_finite") = false, py::arg("ctx") = 0, py::kw_only(),
      py::arg("write_unscaled_grads") = false, py::arg("norms_out_ptr") = 0, py::arg("norms_in_ptr") = 0,
      "Multi-tensor LAMB step (apex FusedLAMB semantics, per-tensor trust ratios). Returns True if skipped. "
      "write_unscaled_grads: as adam. Split use (sharded tensors): norms_out_ptr (2n float64) runs only the "
      "moments pass and writes the per-tensor sums of p^2 then u^2 there; norms_in_ptr (the same layout, e.g. "
      "all-reduced) runs only the apply pass with trust ratios from those sums (no grads read, no check).");

  m.def(
      "l2norm",
      [](py::handle ptrs, py::handle sizes, int dtype, int64_t out_ptr, int ctx) {
        I64Arg p(ptrs, "ptrs"), s(sizes, "sizes");
        py::gil_scoped_release nogil;
        return stepforge::cpu::l2norm(p.view(), s.view(), dtype, out_ptr, ctx);
      },
      py::arg("ptrs"), py::arg("sizes"), py::arg("dtype"), py::arg("per_tensor_out_ptr") = 0, py::arg("ctx") = 0,
      "Global L2 norm of the tensors (double accumulation); per-tensor norms into a float32 buffer if given.");

  m.def(
      "scale",
      [](py::handle src, py::handle dst, py::handle sizes, int src_dtype, int dst_dtype, double s,
         int64_t found_inf_ptr, int ctx) {
        I64Arg a(src, "src"), b(dst, "dst"), n(sizes, "sizes");
        py::gil_scoped_release nogil;
        return stepforge::cpu::scale(a.view(), b.view(), n.view(), src_dtype, dst_dtype, s, found_inf_ptr, ctx);
      },
      py::arg("src"), py::arg("dst"), py::arg("sizes"), py::arg("src_dtype"), py::arg("dst_dtype"),
      py::arg("scale"), py::arg("found_inf_ptr") = 0, py::arg("ctx") = 0,
      "dst = src * scale with dtype conversion; returns True (and sets *found_inf) if any input is inf/NaN.");
}

}  // namespace stepforge::bindings
