// SPDX-License-Identifier: Apache-2.0
// Host side of the CPU kernels (see dispatch.h). Compiled once, without ISA flags.
#include "cpu/dispatch.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(STEPFORGE_HAVE_OPENMP)
#include <omp.h>
#endif

#include "cpu/kernels.h"

namespace stepforge::cpu {
namespace {

struct IsaEntry {
  const char* name;
  const KernelTable* (*get)();
  bool (*supported)();
};

bool always() { return true; }
#if defined(__x86_64__) || defined(_M_X64)
bool x86_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
         __builtin_cpu_supports("bmi2");
}
bool x86_avx512() {
  return x86_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#endif

const std::vector<IsaEntry>& isa_list() {
  // Ordered from most to least preferred.
  static const std::vector<IsaEntry> list = {
#if defined(STEPFORGE_HAVE_AVX512)
      {"avx512", [] { return &avx512::table(); }, &x86_avx512},
#endif
#if defined(STEPFORGE_HAVE_AVX2)
      {"avx2", [] { return &avx2::table(); }, &x86_avx2},
#endif
      {"scalar", [] { return &scalar::table(); }, &always},
  };
  return list;
}

std::string g_env_isa;
std::atomic<const KernelTable*> g_table{nullptr};
std::atomic<int> g_threads{0};

const KernelTable* pick_initial() {
  const char* env = std::getenv("STEPFORGE_CPU_ISA");
  g_env_isa = env ? env : "";
  if (!g_env_isa.empty() && g_env_isa != "auto") {
    for (const auto& e : isa_list())
      if (g_env_isa == e.name) {
        if (!e.supported())
          throw std::runtime_error("STEPFORGE_CPU_ISA=" + g_env_isa +
                                   " is not supported by this CPU; unset it or pick one of the supported paths "
                                   "(stepforge.fused.cpu_features()['supported'])");
        return e.get();
      }
    throw std::runtime_error("STEPFORGE_CPU_ISA=" + g_env_isa +
                             " is unknown; use scalar, avx2, avx512 or auto (paths compiled into this build)");
  }
  for (const auto& e : isa_list())
    if (e.supported()) return e.get();
  return &scalar::table();
}

const KernelTable& table() {
  const KernelTable* t = g_table.load(std::memory_order_acquire);
  if (!t) {
    t = pick_initial();
    g_table.store(t, std::memory_order_release);
  }
  return *t;
}

int resolve_threads(int ctx) {
  if (ctx > 0) return ctx;
  int d = g_threads.load(std::memory_order_relaxed);
  return d > 0 ? d : max_threads();
}

void check_dtype(int code, const char* what) {
  if (code != kFloat32 && code != kFloat16 && code != kBFloat16)
    throw std::invalid_argument(std::string(what) + ": unknown dtype code " + std::to_string(code) +
                                " (0=float32, 1=float16, 2=bfloat16)");
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
  if (check_finite && table().any_non_finite(mt, grads.data, grad_dtype, divisor)) {
    if (fi) *fi = 1.0f;
    return true;
  }
  return false;
}

}  // namespace

std::string active_isa() { return table().name; }

std::vector<std::string> compiled_isas() {
  std::vector<std::string> out;
  for (const auto& e : isa_list()) out.push_back(e.name);
  return out;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const auto& e : isa_list())
    if (e.supported()) out.push_back(e.name);
  return out;
}

void set_isa(const std::string& name) {
  if (name == "auto") {
    for (const auto& e : isa_list())
      if (e.supported()) {
        g_table.store(e.get(), std::memory_order_release);
        return;
      }
  }
  for (const auto& e : isa_list())
    if (name == e.name) {
      if (!e.supported()) throw std::invalid_argument("ISA '" + name + "' is not supported by this CPU");
      g_table.store(e.get(), std::memory_order_release);
      return;
    }
  throw std::invalid_argument("unknown ISA '" + name + "'; compiled paths: scalar, avx2, avx512 (x86-64 only)");
}

std::string env_isa() {
  (void)table();
  return g_env_isa;
}

bool has_openmp() {
#if defined(STEPFORGE_HAVE_OPENMP)
  return true;
#else
  return false;
#endif
}

int max_threads() {
#if defined(STEPFORGE_HAVE_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

int default_threads() { return resolve_threads(0); }
void set_default_threads(int n) { g_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

bool cpu_has(const char* feature) {
#if defined(__x86_64__) || defined(_M_X64)
  std::string f(feature);
  if (f == "avx2") return __builtin_cpu_supports("avx2");
  if (f == "fma") return __builtin_cpu_supports("fma");
  if (f == "f16c") return __builtin_cpu_supports("f16c");
  if (f == "avx512f") return __builtin_cpu_supports("avx512f");
  if (f == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (f == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (f == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
#endif
  (void)feature;
  return false;
}

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
  table().adam(L);
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
  table().sgd(L);
  return false;
}

bool lamb(I64 params, I64 grads, I64 exp_avgs, I64 exp_avg_sqs, I64 masters, I64 sizes, I64 steps,
          int param_dtype, int grad_dtype, double lr, double beta1, double beta2, double eps, double weight_decay,
          bool adam_w_mode, bool bias_correction, bool grad_averaging, bool use_nvlamb, double trust_clip_min,
          double trust_clip_max, double grad_divisor, int64_t found_inf_ptr, bool check_finite, int ctx,
         bool write_grads) {
  const int64_t n = sizes.size;
  check_dtype(param_dtype, "lamb param_dtype");
  check_dtype(grad_dtype, "lamb grad_dtype");
  check_moment_lists(params, grads, exp_avgs, exp_avg_sqs, masters, sizes, steps, param_dtype, grad_divisor);
  std::vector<int64_t> off = make_offsets(sizes);
  MultiTensor mt{n, off.data(), sizes.data, resolve_threads(ctx)};
  if (overflow_gate(mt, grads, grad_dtype, grad_divisor, found_inf_ptr, check_finite)) return true;
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
  L.write_grads = write_grads && grad_divisor != 1.0;
  table().lamb_pass1(L);
  const bool use_ratio = weight_decay != 0.0 || use_nvlamb;
  for (int64_t i = 0; i < n; ++i) {
    const float r = lamb_trust_ratio(std::sqrt(p_sq[size_t(i)]), std::sqrt(u_sq[size_t(i)]), use_ratio,
                                     trust_clip_min, trust_clip_max);
    step_scale[size_t(i)] = float(lr * double(r));
  }
  L.step_scale = step_scale.data();
  table().lamb_pass2(L);
  return false;
}

double l2norm(I64 ptrs, I64 sizes, int dtype, int64_t per_tensor_out_ptr, int ctx) {
  const int64_t n = sizes.size;
  check_dtype(dtype, "l2norm dtype");
  check_list(ptrs, n, "tensors", sizes);
  std::vector<int64_t> off = make_offsets(sizes);
  MultiTensor mt{n, off.data(), sizes.data, resolve_threads(ctx)};
  std::vector<double> sq(static_cast<size_t>(n), 0.0);
  if (n > 0) table().sum_squares(mt, ptrs.data, dtype, sq.data());
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
  bool found = n > 0 && table().scale(mt, src.data, dst.data, src_dtype, dst_dtype, s);
  if (found) {
    float* fi = found_inf(found_inf_ptr);
    if (fi) *fi = 1.0f;
  }
  return found;
}

}  // namespace stepforge::cpu
