// SPDX-License-Identifier: Apache-2.0
// Python bindings of the CPU kernels: adam, sgd, lamb, l2norm, scale (signatures: csrc/README.md).
// Arguments are converted while holding the GIL; the kernels run with the GIL released.
#include <pybind11/pybind11.h>

#include <limits>

#include "bindings/i64_arg.h"
#include "cpu/ops.h"

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
