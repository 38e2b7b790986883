// SPDX-License-Identifier: Apache-2.0
//
// Host-side interface of the CUDA kernels: plain C++ (no CUDA or pybind11 headers), so the single binding
// translation unit (csrc/bindings/module_cuda.cpp) is compiled by the host compiler and nvcc never sees
// pybind11. Everything crosses this boundary as integers: device pointers, element counts, dtype codes, the
// caller's stream handle (torch.cuda.current_stream().cuda_stream) and the device index.
//
// Multi-tensor launches take a *table*: one TensorRow per tensor, built on the host from the pointer lists and
// uploaded once into device memory (cached by content, so an unchanged list costs no copy; see table_cache.cu).
// There is no cap on the number of tensors per launch and no 4 KB kernel-argument limit: one launch per
// (param, grad, state) dtype bucket, whatever the number of tensors.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "stepforge/dtype_codes.h"

namespace stepforge::cuda {

// dtype codes: stepforge::DType in stepforge/dtype_codes.h (kNoDType: no param copy; csrc/README.md).

// Elements handled by one block per chunk. A tensor of n elements owns ceil(n / kChunk) consecutive chunks.
constexpr std::int64_t kChunk = 16384;
constexpr int kMaxLists = 6;

// One tensor of a multi-tensor launch. Field order is the device layout (80 bytes, 16-byte aligned).
struct alignas(16) TensorRow {
  std::uint64_t ptr[kMaxLists];  // role-specific device pointers (p, g, m, v, ...); 0 = absent
  std::int64_t numel;            // elements in this tensor (64-bit: tensors above 2^31 elements are fine)
  std::int64_t chunk_begin;      // global index of this tensor's first chunk (prefix sum, filled by the host)
  std::uint64_t step;            // device float32* of the per-tensor step counter (torch layout), or 0
  std::int64_t aux;              // op-specific per-tensor value (SGD: 1 = momentum buffer is new this step)
};
static_assert(sizeof(TensorRow) == 80, "TensorRow layout is shared with the device code");

// Everything the launchers need to find the device and the caller's stream.
struct Launch {
  int device = -1;           // -1: taken from the first non-null pointer of the call (cudaPointerGetAttributes)
  std::uint64_t stream = 0;  // cudaStream_t as an integer (torch.cuda.current_stream().cuda_stream); 0 = legacy
};

// Options every update kernel shares (csrc/README.md "Conventions").
struct Common {
  std::uint64_t found_inf = 0;         // device float32*, nullable: non-zero on entry -> the call is skipped
  bool check_finite = false;           // pre-pass over the divided grads; any inf/NaN -> nothing is written
  double grad_divisor = 1.0;           // every grad element is divided by this first
  std::uint64_t grad_divisor_ptr = 0;  // device float32*, nullable: further divisor read on the device
  std::uint64_t lr_ptr = 0;            // device float32*, nullable: replaces lr (CUDA-graph capture)
  bool stochastic_rounding = false;    // bf16 params written with stochastic rounding
  std::uint64_t seed = 0;              // stochastic-rounding seed (vary it per step)
  bool write_grads = false;            // store the unscaled grad (g / divisor) back into the grads
};

// Per-tensor step source for Adam/LAMB bias corrections: host steps (already incremented by the caller) or,
// for capturable use, device float32 step counters (TensorRow::step), read but never written by the kernels.
struct Steps {
  std::vector<std::int64_t> host;  // empty -> every row must carry a TensorRow::step device pointer
};

struct AdamParams {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  bool adamw = true;  // decoupled decay (AdamW) vs L2 added to the gradient (Adam)
  bool bias_correction = true;
};

struct SgdParams {
  double lr = 1e-2, momentum = 0.0, dampening = 0.0, weight_decay = 0.0;
  bool nesterov = false, wd_after_momentum = false;
};

struct LambParams {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-6, weight_decay = 0.01;
  bool adamw = true;  // decay inside u (and so inside the trust ratio) vs L2 on the grad
  bool bias_correction = true;
  bool grad_averaging = true;  // m = b1 m + (1-b1) g ; false: m = b1 m + g
  bool use_nvlamb = false;     // apply the trust ratio also when weight_decay == 0
  double trust_min = 0.0, trust_max = 0.0;  // clamp; trust_max = inf for none
};

// Lists (TensorRow::ptr index). Master-weight calls put the fp32 master in kP and the low-precision model
// param in kCopy; plain calls leave kCopy empty and update kP in its own dtype.
enum List : int { kP = 0, kG = 1, kM = 2, kV = 3, kCopy = 4 };

// Update launchers return kSkipOnDevice when the skip decision stays on the device (no synchronisation: the
// caller passed found_inf, or check_finite is off), else 0/1 = applied/skipped: with check_finite and no
// found_inf the launcher reads its internal flag back, which synchronises the stream (contract: CPU-like bool).
constexpr int kSkipOnDevice = -1;

int adam(std::vector<TensorRow>& rows, int p_dtype, int g_dtype, int copy_dtype, const Steps& steps,
          const AdamParams& hp, const Common& common, Launch launch);

// SGD: kM holds momentum_buffer (absent when momentum == 0); rows[i].aux != 0: the buffer is new (buf = d_p).
int sgd(std::vector<TensorRow>& rows, int p_dtype, int g_dtype, int copy_dtype, const SgdParams& hp,
         const Common& common, Launch launch);

// LAMB: per-tensor ||p|| and ||u|| from one segmented reduction over chunk partials, no write into grads.
// `ratio_out` (device float32*, nullable): the trust ratio applied to each tensor.
// Split use (sharded tensors), device float64 buffers of 2n (sum p^2 per tensor, then sum u^2):
// `norms_out` != 0 runs only the moments pass and writes the sums there; `norms_in` != 0 runs only the apply
// pass with trust ratios from the given (e.g. all-reduced) sums. At most one of them.
int lamb(std::vector<TensorRow>& rows, int p_dtype, int g_dtype, int copy_dtype, const Steps& steps,
          const LambParams& hp, const Common& common, std::uint64_t ratio_out, Launch launch,
          std::uint64_t norms_out = 0, std::uint64_t norms_in = 0);

// Global L2 norm of list 0. per_tensor_out (device float32*, nullable): n norms. sumsq_out (device float32*,
// nullable): the global sum of squares is *added* there and the function returns NaN without synchronising;
// otherwise it synchronises the stream and returns the norm. Non-finite values propagate.
double l2norm(std::vector<TensorRow>& rows, int dtype, std::uint64_t per_tensor_out, std::uint64_t sumsq_out,
              Launch launch);

// list 1 = list 0 * scale, with dtype conversion; *found_inf = 1 when an input element is inf/NaN.
void scale(std::vector<TensorRow>& rows, int src_dtype, int dst_dtype, double scale, std::uint64_t found_inf,
           Launch launch);

// Diagnostics.
bool available();                  // a device is usable from this module
std::vector<std::string> built_archs();
int device_count();                // throws std::runtime_error (CUDA error string) without driver/device
int runtime_version();             // cudaRuntimeGetVersion (the statically linked runtime)
int driver_version();              // cudaDriverGetVersion: 0 when no driver is installed
void clear_table_cache();
std::int64_t table_cache_size();   // number of cached device tables (tests)
std::int64_t table_uploads();      // number of uploads since start (tests: unchanged lists do not re-upload)

}  // namespace stepforge::cuda
