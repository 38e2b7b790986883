// SPDX-License-Identifier: Apache-2.0
//
// The kernel functions of `stepforge.fused._cuda` (adam, sgd, lamb, l2norm, scale): argument conversion on the
// host compiler side, then the plain C++ launchers of csrc/cuda/launch_api.h (nvcc never sees pybind11). Names,
// argument order and meaning follow csrc/README.md, the contract shared with `_cpu`; the trailing keyword-only
// arguments are CUDA extensions (device-side lr / divisor / steps for CUDA graphs, stochastic rounding, device).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "../cuda/launch_api.h"
#include "i64_arg.h"
#include "stepforge/dtype_codes.h"

namespace py = pybind11;
namespace sc = stepforge::cuda;

namespace {

// An int64 list argument, read with the CPU module's converter (bindings/i64_arg.h: a list/tuple of int, any
// 1-D contiguous int64 buffer such as array.array('q') or a numpy int64 array, or None -> empty).
std::vector<std::int64_t> int64_list(const py::handle& obj, const char* name) {
  const stepforge::bindings::I64Arg arg(obj, name);
  const stepforge::cpu::I64& v = arg.view();
  if (v.data == nullptr || v.size == 0) return {};
  return std::vector<std::int64_t>(v.data, v.data + v.size);
}

void check_dtype(int code, const char* name) {
  if (!stepforge::is_dtype_code(code)) {
    throw py::value_error(std::string(name) + " must be " + stepforge::kDTypeCodesHelp + ", got " +
                          std::to_string(code));
  }
}

// Rows from the role lists. `lists[k]` fills TensorRow::ptr[k]; empty optional lists leave zeros.
std::vector<sc::TensorRow> make_rows(const std::vector<std::vector<std::int64_t>*>& lists, const char* const* names,
                                     const std::vector<std::int64_t>& sizes) {
  const std::size_t n = sizes.size();
  std::vector<sc::TensorRow> rows(n);
  for (std::size_t k = 0; k < lists.size(); ++k) {
    const std::vector<std::int64_t>* l = lists[k];
    if (l == nullptr || l->empty()) continue;
    if (l->size() != n) {
      throw py::value_error(std::string(names[k]) + " has " + std::to_string(l->size()) + " entries but sizes has " +
                            std::to_string(n));
    }
    for (std::size_t i = 0; i < n; ++i) rows[i].ptr[k] = static_cast<std::uint64_t>((*l)[i]);
  }
  for (std::size_t i = 0; i < n; ++i) rows[i].numel = sizes[i];
  return rows;
}

void attach_device_steps(std::vector<sc::TensorRow>& rows, const py::handle& step_ptrs) {
  if (step_ptrs.is_none()) return;
  auto ptrs = int64_list(step_ptrs, "step_ptrs");
  if (ptrs.size() != rows.size()) throw py::value_error("step_ptrs must have one entry per tensor");
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i].step = static_cast<std::uint64_t>(ptrs[i]);
}

sc::Launch launch_of(std::int64_t ctx, int device) {
  sc::Launch l;
  l.stream = static_cast<std::uint64_t>(ctx);
  l.device = device;
  return l;
}

sc::Common common_of(double grad_divisor, std::int64_t found_inf_ptr, bool check_finite, std::int64_t lr_ptr,
                     std::int64_t grad_divisor_ptr, bool stochastic_rounding, std::uint64_t seed,
                     bool write_grads) {
  sc::Common c;
  c.grad_divisor = grad_divisor;
  c.found_inf = static_cast<std::uint64_t>(found_inf_ptr);
  c.check_finite = check_finite;
  c.lr_ptr = static_cast<std::uint64_t>(lr_ptr);
  c.grad_divisor_ptr = static_cast<std::uint64_t>(grad_divisor_ptr);
  c.stochastic_rounding = stochastic_rounding;
  c.seed = seed;
  c.write_grads = write_grads;
  return c;
}

// None: the skip decision stays on the device (found_inf); True/False: read back (check_finite, no found_inf).
py::object skipped_result(int r) {
  if (r == sc::kSkipOnDevice) return py::none();
  return py::bool_(r != 0);
}

// Masters given: fp32 masters are updated (list kP) and the low-precision params written as the copy.
struct MasterLayout {
  int p_dtype;
  int copy_dtype;
};
MasterLayout master_layout(bool has_masters, int param_dtype) {
  if (!has_masters) return {param_dtype, stepforge::kNoDType};
  if (param_dtype == stepforge::kFloat32) throw py::value_error("masters given but param_dtype is float32 (masters are for fp16/bf16)");
  return {stepforge::kFloat32, param_dtype};
}

py::object adam(py::handle params, py::handle grads, py::handle exp_avgs, py::handle exp_avg_sqs, py::handle masters,
                py::handle sizes, py::handle steps, int param_dtype, int grad_dtype, double lr, double beta1,
                double beta2, double eps, double weight_decay, bool adamw_mode, bool bias_correction,
                double grad_divisor, std::int64_t found_inf_ptr, bool check_finite, std::int64_t ctx,
                std::int64_t lr_ptr, std::int64_t grad_divisor_ptr, py::handle step_ptrs, bool stochastic_rounding,
                std::uint64_t seed, int device, bool write_unscaled_grads) {
  check_dtype(param_dtype, "param_dtype");
  check_dtype(grad_dtype, "grad_dtype");
  auto p = int64_list(params, "params"), g = int64_list(grads, "grads"), m = int64_list(exp_avgs, "exp_avgs"),
       v = int64_list(exp_avg_sqs, "exp_avg_sqs"), w = int64_list(masters, "masters"),
       n = int64_list(sizes, "sizes");
  sc::Steps st;
  st.host = int64_list(steps, "steps");
  if (st.host.empty() && step_ptrs.is_none() && !n.empty() && bias_correction) {
    throw py::value_error("adam: pass steps (host) or step_ptrs (device float32 step counters)");
  }
  const MasterLayout ml = master_layout(!masters.is_none(), param_dtype);
  static const char* names[] = {"params", "grads", "exp_avgs", "exp_avg_sqs", "params"};
  auto rows = masters.is_none() ? make_rows({&p, &g, &m, &v}, names, n)
                                : make_rows({&w, &g, &m, &v, &p}, names, n);
  if (!masters.is_none() && w.size() != n.size()) throw py::value_error("masters must have one entry per tensor");
  attach_device_steps(rows, step_ptrs);
  sc::AdamParams hp;
  hp.lr = lr;
  hp.beta1 = beta1;
  hp.beta2 = beta2;
  hp.eps = eps;
  hp.weight_decay = weight_decay;
  hp.adamw = adamw_mode;
  hp.bias_correction = bias_correction;
  const auto common =
      common_of(grad_divisor, found_inf_ptr, check_finite, lr_ptr, grad_divisor_ptr, stochastic_rounding, seed,
                write_unscaled_grads);
  int result;
  {
    py::gil_scoped_release nogil;
    result = sc::adam(rows, ml.p_dtype, grad_dtype, ml.copy_dtype, st, hp, common, launch_of(ctx, device));
  }
  return skipped_result(result);
}

py::object sgd(py::handle params, py::handle grads, py::handle momentum_buffers, py::handle masters, py::handle sizes,
               py::handle first_run, int param_dtype, int grad_dtype, double lr, double momentum, double dampening,
               double weight_decay, bool nesterov, bool wd_after_momentum, double grad_divisor,
               std::int64_t found_inf_ptr, bool check_finite, std::int64_t ctx, std::int64_t lr_ptr,
               std::int64_t grad_divisor_ptr, bool stochastic_rounding, std::uint64_t seed, int device,
               bool write_unscaled_grads) {
  check_dtype(param_dtype, "param_dtype");
  check_dtype(grad_dtype, "grad_dtype");
  auto p = int64_list(params, "params"), g = int64_list(grads, "grads"),
       b = int64_list(momentum_buffers, "momentum_buffers"), w = int64_list(masters, "masters"),
       n = int64_list(sizes, "sizes"), first = int64_list(first_run, "first_run");
  if (momentum != 0.0 && momentum_buffers.is_none()) {
    throw py::value_error("sgd: momentum != 0 needs momentum_buffers");
  }
  if (!first.empty() && first.size() != n.size()) throw py::value_error("first_run must have one entry per tensor");
  const MasterLayout ml = master_layout(!masters.is_none(), param_dtype);
  static const char* names[] = {"params", "grads", "momentum_buffers", "unused", "params"};
  std::vector<std::int64_t> none;
  auto rows = masters.is_none() ? make_rows({&p, &g, &b}, names, n) : make_rows({&w, &g, &b, &none, &p}, names, n);
  if (!masters.is_none() && w.size() != n.size()) throw py::value_error("masters must have one entry per tensor");
  for (std::size_t i = 0; i < first.size(); ++i) rows[i].aux = first[i] != 0 ? 1 : 0;
  sc::SgdParams hp;
  hp.lr = lr;
  hp.momentum = momentum;
  hp.dampening = dampening;
  hp.weight_decay = weight_decay;
  hp.nesterov = nesterov;
  hp.wd_after_momentum = wd_after_momentum;
  const auto common =
      common_of(grad_divisor, found_inf_ptr, check_finite, lr_ptr, grad_divisor_ptr, stochastic_rounding, seed,
                write_unscaled_grads);
  int result;
  {
    py::gil_scoped_release nogil;
    result = sc::sgd(rows, ml.p_dtype, grad_dtype, ml.copy_dtype, hp, common, launch_of(ctx, device));
  }
  return skipped_result(result);
}

py::object lamb(py::handle params, py::handle grads, py::handle exp_avgs, py::handle exp_avg_sqs, py::handle masters,
                py::handle sizes, py::handle steps, int param_dtype, int grad_dtype, double lr, double beta1,
                double beta2, double eps, double weight_decay, bool adam_w_mode, bool bias_correction,
                bool grad_averaging, bool use_nvlamb, double trust_clip_min, double trust_clip_max,
                double grad_divisor, std::int64_t found_inf_ptr, bool check_finite, std::int64_t ctx,
                std::int64_t lr_ptr, std::int64_t grad_divisor_ptr, py::handle step_ptrs, bool stochastic_rounding,
                std::uint64_t seed, std::int64_t ratio_out_ptr, int device, bool write_unscaled_grads,
                std::int64_t norms_out_ptr, std::int64_t norms_in_ptr) {
  check_dtype(param_dtype, "param_dtype");
  check_dtype(grad_dtype, "grad_dtype");
  auto p = int64_list(params, "params"), g = int64_list(grads, "grads"), m = int64_list(exp_avgs, "exp_avgs"),
       v = int64_list(exp_avg_sqs, "exp_avg_sqs"), w = int64_list(masters, "masters"),
       n = int64_list(sizes, "sizes");
  sc::Steps st;
  st.host = int64_list(steps, "steps");
  if (st.host.empty() && step_ptrs.is_none() && !n.empty() && bias_correction) {
    throw py::value_error("lamb: pass steps (host) or step_ptrs (device float32 step counters)");
  }
  const MasterLayout ml = master_layout(!masters.is_none(), param_dtype);
  static const char* names[] = {"params", "grads", "exp_avgs", "exp_avg_sqs", "params"};
  auto rows = masters.is_none() ? make_rows({&p, &g, &m, &v}, names, n)
                                : make_rows({&w, &g, &m, &v, &p}, names, n);
  if (!masters.is_none() && w.size() != n.size()) throw py::value_error("masters must have one entry per tensor");
  attach_device_steps(rows, step_ptrs);
  if (trust_clip_min > trust_clip_max) throw py::value_error("trust_clip_min must be <= trust_clip_max");
  sc::LambParams hp;
  hp.lr = lr;
  hp.beta1 = beta1;
  hp.beta2 = beta2;
  hp.eps = eps;
  hp.weight_decay = weight_decay;
  hp.adamw = adam_w_mode;
  hp.bias_correction = bias_correction;
  hp.grad_averaging = grad_averaging;
  hp.use_nvlamb = use_nvlamb;
  hp.trust_min = trust_clip_min;
  hp.trust_max = trust_clip_max;
  const auto common =
      common_of(grad_divisor, found_inf_ptr, check_finite, lr_ptr, grad_divisor_ptr, stochastic_rounding, seed,
                write_unscaled_grads);
  int result;
  {
    py::gil_scoped_release nogil;
    result = sc::lamb(rows, ml.p_dtype, grad_dtype, ml.copy_dtype, st, hp, common,
                      static_cast<std::uint64_t>(ratio_out_ptr), launch_of(ctx, device),
                      static_cast<std::uint64_t>(norms_out_ptr), static_cast<std::uint64_t>(norms_in_ptr));
  }
  return skipped_result(result);
}

py::object l2norm(py::handle ptrs, py::handle sizes, int dtype, std::int64_t per_tensor_out_ptr, std::int64_t ctx,
                  std::int64_t sumsq_out_ptr, int device) {
  check_dtype(dtype, "dtype");
  auto x = int64_list(ptrs, "ptrs"), n = int64_list(sizes, "sizes");
  static const char* names[] = {"ptrs"};
  auto rows = make_rows({&x}, names, n);
  double r;
  {
    py::gil_scoped_release nogil;
    r = sc::l2norm(rows, dtype, static_cast<std::uint64_t>(per_tensor_out_ptr),
                   static_cast<std::uint64_t>(sumsq_out_ptr), launch_of(ctx, device));
  }
  if (sumsq_out_ptr != 0) return py::none();
  return py::float_(r);
}

py::object scale(py::handle src, py::handle dst, py::handle sizes, int src_dtype, int dst_dtype, double scale,
                 std::int64_t found_inf_ptr, std::int64_t ctx, int device) {
  check_dtype(src_dtype, "src_dtype");
  check_dtype(dst_dtype, "dst_dtype");
  auto s = int64_list(src, "src"), d = int64_list(dst, "dst"), n = int64_list(sizes, "sizes");
  static const char* names[] = {"src", "dst"};
  auto rows = make_rows({&s, &d}, names, n);
  {
    py::gil_scoped_release nogil;
    sc::scale(rows, src_dtype, dst_dtype, scale, static_cast<std::uint64_t>(found_inf_ptr), launch_of(ctx, device));
  }
  return py::none();
}

}  // namespace

namespace stepforge::bindings {

void register_cuda_kernels(py::module_& m) {
  using py::arg;

  m.def("adam", &adam, "Multi-tensor Adam/AdamW on CUDA tensors (one dtype bucket); returns None (decision on the device) or, "
        "with check_finite and no found_inf, whether the step was skipped (synchronises)",
        arg("params"), arg("grads"), arg("exp_avgs"), arg("exp_avg_sqs"), arg("masters"), arg("sizes"), arg("steps"),
        arg("param_dtype"), arg("grad_dtype"), arg("lr"), arg("beta1"), arg("beta2"), arg("eps"),
        arg("weight_decay"), arg("adamw_mode"), arg("bias_correction"), arg("grad_divisor"), arg("found_inf_ptr"),
        arg("check_finite"), arg("ctx"), py::kw_only(), arg("lr_ptr") = 0, arg("grad_divisor_ptr") = 0,
        arg("step_ptrs") = py::none(), arg("stochastic_rounding") = false, arg("seed") = 0, arg("device") = -1,
        arg("write_unscaled_grads") = false);
  m.def("sgd", &sgd, "Multi-tensor SGD (momentum, nesterov, wd_after_momentum) on CUDA tensors; returns None or skipped (as adam)",
        arg("params"), arg("grads"), arg("momentum_buffers"), arg("masters"), arg("sizes"), arg("first_run"),
        arg("param_dtype"), arg("grad_dtype"), arg("lr"), arg("momentum"), arg("dampening"), arg("weight_decay"),
        arg("nesterov"), arg("wd_after_momentum"), arg("grad_divisor"), arg("found_inf_ptr"), arg("check_finite"),
        arg("ctx"), py::kw_only(), arg("lr_ptr") = 0, arg("grad_divisor_ptr") = 0,
        arg("stochastic_rounding") = false, arg("seed") = 0, arg("device") = -1, arg("write_unscaled_grads") = false);
  m.def("lamb", &lamb, "Multi-tensor LAMB with per-tensor trust ratios (segmented reduction); returns None or skipped (as adam)",
        arg("params"), arg("grads"), arg("exp_avgs"), arg("exp_avg_sqs"), arg("masters"), arg("sizes"), arg("steps"),
        arg("param_dtype"), arg("grad_dtype"), arg("lr"), arg("beta1"), arg("beta2"), arg("eps"),
        arg("weight_decay"), arg("adam_w_mode"), arg("bias_correction"), arg("grad_averaging"), arg("use_nvlamb"),
        arg("trust_clip_min"), arg("trust_clip_max"), arg("grad_divisor"), arg("found_inf_ptr"),
        arg("check_finite"), arg("ctx"), py::kw_only(), arg("lr_ptr") = 0, arg("grad_divisor_ptr") = 0,
        arg("step_ptrs") = py::none(), arg("stochastic_rounding") = false, arg("seed") = 0,
        arg("ratio_out_ptr") = 0, arg("device") = -1, arg("write_unscaled_grads") = false,
        arg("norms_out_ptr") = 0, arg("norms_in_ptr") = 0);
  m.def("l2norm", &l2norm,
        "Global L2 norm (float, synchronises) and optional per-tensor norms; with sumsq_out_ptr the sum of "
        "squares is added on the device and None is returned without synchronising",
        arg("ptrs"), arg("sizes"), arg("dtype"), arg("per_tensor_out_ptr"), arg("ctx"), py::kw_only(),
        arg("sumsq_out_ptr") = 0, arg("device") = -1);
  m.def("scale", &scale, "dst = src * scale with an inf/NaN flag (AMP unscale); returns None", arg("src"), arg("dst"),
        arg("sizes"), arg("src_dtype"), arg("dst_dtype"), arg("scale"), arg("found_inf_ptr"), arg("ctx"),
        py::kw_only(), arg("device") = -1);
}

}  // namespace stepforge::bindings
