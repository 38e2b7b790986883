// SPDX-License-Identifier: Apache-2.0
// Multi-tensor reductions and conversions: finite check, per-tensor sums of squares, scale. Compiled once per ISA (cmake/StepforgeSimd.cmake) into stepforge::cpu::<isa>.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/convert.h"
#include "cpu/kernels.h"
#include "cpu/multi_tensor.h"
#include "stepforge/dtype_dispatch.h"

namespace stepforge::cpu::STEPFORGE_ISA_NS {
namespace {

// ---- reductions and scale ------------------------------------------------------------------------------
template <class T>
bool any_non_finite_run(const MultiTensor& mt, const int64_t* ptrs, double divisor) {
  std::atomic<bool> found{false};
  const bool has_div = divisor != 1.0;
  const float div = float(divisor);
  parallel_segments(mt, [&](int64_t, int64_t t, int64_t b, int64_t e) {
    const T* x = reinterpret_cast<const T*>(ptrs[t]);
    alignas(64) float tmp[kBlock];
    for (int64_t i0 = b; i0 < e; i0 += kBlock) {
      if (found.load(std::memory_order_relaxed)) return;
      const int64_t k = std::min(kBlock, e - i0);
      const float* xb = float_view(x + i0, tmp, k);
      alignas(64) float q[kBlock];
      const float* y = xb;
      if (has_div) {
#pragma GCC ivdep
        for (int64_t j = 0; j < k; ++j) q[j] = xb[j] / div;
        y = q;
      }
      const uint32_t* yb = reinterpret_cast<const uint32_t*>(y);
      uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
      for (int64_t j = 0; j < k; ++j) bad |= uint32_t((yb[j] & 0x7f800000u) == 0x7f800000u);
      if (bad) {
        found.store(true, std::memory_order_relaxed);
        return;
      }
    }
  });
  return found.load();
}

template <class T>
void sum_squares_run(const MultiTensor& mt, const int64_t* ptrs, double* out) {
  ChunkPartials part(mt, 1);
  parallel_segments(mt, [&](int64_t chunk, int64_t t, int64_t b, int64_t e) {
    const T* x = reinterpret_cast<const T*>(ptrs[t]);
    alignas(64) float tmp[kBlock];
    double acc = 0.0;
    for (int64_t i0 = b; i0 < e; i0 += kBlock) {
      const int64_t k = std::min(kBlock, e - i0);
      const float* xb = float_view(x + i0, tmp, k);
      double s = 0.0;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < k; ++j) s += double(xb[j]) * double(xb[j]);
      acc += s;
    }
    *part.at(chunk, t) += acc;
  });
  part.combine(out);
}

template <class S, class D>
bool scale_run(const MultiTensor& mt, const int64_t* src, const int64_t* dst, double scale) {
  std::atomic<bool> found{false};
  const float s = float(scale);
  parallel_segments(mt, [&](int64_t, int64_t t, int64_t b, int64_t e) {
    const S* x = reinterpret_cast<const S*>(src[t]);
    D* y = reinterpret_cast<D*>(dst[t]);
    alignas(64) float in[kBlock];
    alignas(64) float out[kBlock];
    int bad = 0;
    for (int64_t i0 = b; i0 < e; i0 += kBlock) {
      const int64_t k = std::min(kBlock, e - i0);
      const float* xb = float_view(x + i0, in, k);
      const uint32_t* xu = reinterpret_cast<const uint32_t*>(xb);
      uint32_t b2 = 0;
#pragma omp simd reduction(| : b2)
      for (int64_t j = 0; j < k; ++j) {
        b2 |= uint32_t((xu[j] & 0x7f800000u) == 0x7f800000u);
        out[j] = xb[j] * s;
      }
      bad |= int(b2);
      from_float(out, y + i0, k);
    }
    if (bad) found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

}  // namespace

bool any_non_finite(const MultiTensor& mt, const int64_t* ptrs, int dtype, double divisor) {
  STEPFORGE_DISPATCH_DTYPE(dtype, T, half_t, bf16_t, return false, return any_non_finite_run<T>(mt, ptrs, divisor))
  return false;
}

void sum_squares(const MultiTensor& mt, const int64_t* ptrs, int dtype, double* out) {
  STEPFORGE_DISPATCH_DTYPE(dtype, T, half_t, bf16_t, return, sum_squares_run<T>(mt, ptrs, out))
}

bool scale(const MultiTensor& mt, const int64_t* src, const int64_t* dst, int src_dtype, int dst_dtype, double s) {
  STEPFORGE_DISPATCH_DTYPE(src_dtype, S, half_t, bf16_t, return false,
    STEPFORGE_DISPATCH_DTYPE(dst_dtype, D, half_t, bf16_t, return false, return scale_run<S, D>(mt, src, dst, s)))
  return false;
}

}  // namespace stepforge::cpu::STEPFORGE_ISA_NS
