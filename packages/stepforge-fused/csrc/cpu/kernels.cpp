// SPDX-License-Identifier: Apache-2.0
// Multi-tensor CPU kernels, compiled once per ISA (cmake/StepforgeSimd.cmake) into stepforge::cpu::<isa>.
//
// Every kernel parallelises over the concatenated element range of all tensors (not per tensor), so thousands
// of small tensors cost what one large tensor costs. 16-bit operands are converted to float in L1-sized blocks,
// the update rule (csrc/include/stepforge/*_math.h) runs in a `#pragma omp simd` loop, and results are rounded
// back (round to nearest even). The math is element-wise and identical in every ISA copy and every block split.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu/kernels.h"

#ifndef STEPFORGE_ISA_NS
#error "STEPFORGE_ISA_NS must name the ISA copy (scalar, avx2, avx512)"
#endif

namespace stepforge::cpu::STEPFORGE_ISA_NS {
namespace {

constexpr int64_t kBlock = 512;             // elements per conversion block (2 KiB of float temporaries)
constexpr int64_t kMinParallel = 1 << 15;   // below this many elements, one thread beats a parallel region
constexpr int64_t kAlign = 64;              // thread ranges start on multiples of 64 elements (cache lines)

// ---- block conversions ---------------------------------------------------------------------------------
inline void to_float(const float* s, float* d, int64_t n) { std::memcpy(d, s, size_t(n) * sizeof(float)); }

inline void to_float(const bf16_t* s, float* d, int64_t n) {
  const uint16_t* s16 = reinterpret_cast<const uint16_t*>(s);
  uint32_t* d32 = reinterpret_cast<uint32_t*>(d);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d32[i] = uint32_t(s16[i]) << 16;
}

inline void to_float(const half_t* s, float* d, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
#endif
  for (; i < n; ++i) d[i] = half_bits_to_float(s[i].x);
}

inline void from_float(const float* s, float* d, int64_t n) { std::memcpy(d, s, size_t(n) * sizeof(float)); }

inline void from_float(const float* s, bf16_t* d, int64_t n) {
  const uint32_t* s32 = reinterpret_cast<const uint32_t*>(s);
  uint16_t* d16 = reinterpret_cast<uint16_t*>(d);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = s32[i];
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    d16[i] = ((u & 0x7fffffffu) > 0x7f800000u) ? uint16_t(0x7fc0u) : uint16_t(r);
  }
}

inline void from_float(const float* s, half_t* d, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) d[i].x = float_to_half_bits(s[i]);
}

// Float view of a block: no copy for float storage, a conversion into `tmp` otherwise.
template <class T>
inline const float* float_view(const T* src, float* tmp, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    (void)tmp;
    (void)n;
    return src;
  } else {
    to_float(src, tmp, n);
    return tmp;
  }
}

// ---- parallel loop over the concatenated element range ---------------------------------------------------
// f(tid, tensor, begin, end) with [begin, end) local to the tensor. Deterministic split for a given thread count.
template <class F>
void parallel_segments(const MultiTensor& mt, F&& f) {
  const int64_t total = mt.n > 0 ? mt.offsets[mt.n] : 0;
  if (total <= 0) return;
  int nt = mt.num_threads < 1 ? 1 : mt.num_threads;
  if (total < kMinParallel) nt = 1;
  auto body = [&](int tid, int nthreads) {
    int64_t chunk = (total + nthreads - 1) / nthreads;
    chunk = (chunk + kAlign - 1) / kAlign * kAlign;
    const int64_t b = std::min<int64_t>(total, int64_t(tid) * chunk);
    const int64_t e = std::min<int64_t>(total, b + chunk);
    if (b >= e) return;
    int64_t t = int64_t(std::upper_bound(mt.offsets, mt.offsets + mt.n + 1, b) - mt.offsets) - 1;
    int64_t pos = b;
    while (pos < e && t < mt.n) {
      const int64_t seg_end = std::min(e, mt.offsets[t + 1]);
      if (seg_end > pos) f(tid, t, pos - mt.offsets[t], seg_end - mt.offsets[t]);
      pos = std::max(pos, seg_end);
      ++t;
    }
  };
#if defined(_OPENMP)
  if (nt > 1) {
#pragma omp parallel num_threads(nt)
    body(omp_get_thread_num(), omp_get_num_threads());
    return;
  }
#endif
  body(0, 1);
}

inline int team_size(const MultiTensor& mt) {
  const int64_t total = mt.n > 0 ? mt.offsets[mt.n] : 0;
  return (total < kMinParallel || mt.num_threads < 1) ? 1 : mt.num_threads;
}

// ---- Adam ----------------------------------------------------------------------------------------------
template <class P, class G, bool MASTER>
void adam_block_range(const AdamLaunch& L, int64_t t, int64_t b, int64_t e) {
  const AdamConsts c = L.consts[t];
  P* p = reinterpret_cast<P*>(L.params[t]);
  const G* g = reinterpret_cast<const G*>(L.grads[t]);
  float* m = reinterpret_cast<float*>(L.exp_avgs[t]);
  float* v = reinterpret_cast<float*>(L.exp_avg_sqs[t]);
  if constexpr (!MASTER && std::is_same_v<P, float> && std::is_same_v<G, float>) {
#pragma GCC ivdep
    for (int64_t i = b; i < e; ++i) {
      float pv = p[i], mv = m[i], vv = v[i];
      adam_update(pv, mv, vv, g[i], c);
      p[i] = pv;
      m[i] = mv;
      v[i] = vv;
    }
  } else {
    float* w = MASTER ? reinterpret_cast<float*>(L.masters[t]) : nullptr;
    alignas(64) float gtmp[kBlock];
    alignas(64) float ptmp[kBlock];
    for (int64_t i0 = b; i0 < e; i0 += kBlock) {
      const int64_t n = std::min(kBlock, e - i0);
      const float* gb = float_view(g + i0, gtmp, n);
      float* pb;
      if constexpr (MASTER) {
        pb = w + i0;
      } else if constexpr (std::is_same_v<P, float>) {
        pb = p + i0;
      } else {
        to_float(p + i0, ptmp, n);
        pb = ptmp;
      }
      float* mb = m + i0;
      float* vb = v + i0;
#pragma GCC ivdep
      for (int64_t j = 0; j < n; ++j) adam_update(pb[j], mb[j], vb[j], gb[j], c);
      if constexpr (MASTER || !std::is_same_v<P, float>) from_float(pb, p + i0, n);
    }
  }
}

// The last numel % kTorchAdamVecWidth elements of a tensor round like torch's scalar tail (adam_math.h).
template <class P, class G, bool MASTER>
void adam_torch_tail(const AdamLaunch& L, int64_t t, int64_t b, int64_t e) {
  const AdamConsts c = L.consts[t];
  P* p = reinterpret_cast<P*>(L.params[t]);
  const G* g = reinterpret_cast<const G*>(L.grads[t]);
  float* m = reinterpret_cast<float*>(L.exp_avgs[t]);
  float* v = reinterpret_cast<float*>(L.exp_avg_sqs[t]);
  float* w = MASTER ? reinterpret_cast<float*>(L.masters[t]) : nullptr;
  for (int64_t i = b; i < e; ++i) {
    float pv = MASTER ? w[i] : load_float(p + i);
    adam_update_torch_tail(pv, m[i], v[i], load_float(g + i), c);
    if constexpr (MASTER) w[i] = pv;
    store_float(p + i, pv);
  }
}

template <class P, class G, bool MASTER>
void adam_segment(const AdamLaunch& L, int64_t t, int64_t b, int64_t e) {
  const int64_t size = L.mt.sizes[t];
  const int64_t body_end = size - size % kTorchAdamVecWidth;
  if (b < body_end) adam_block_range<P, G, MASTER>(L, t, b, std::min(e, body_end));
  if (e > body_end) adam_torch_tail<P, G, MASTER>(L, t, std::max(b, body_end), e);
}

template <class P, class G, bool MASTER>
void adam_run(const AdamLaunch& L) {
  parallel_segments(L.mt, [&](int, int64_t t, int64_t b, int64_t e) { adam_segment<P, G, MASTER>(L, t, b, e); });
}

// ---- SGD -----------------------------------------------------------------------------------------------
template <class P, class G, bool MASTER>
void sgd_segment(const SgdLaunch& L, int64_t t, int64_t b, int64_t e) {
  const SgdConsts c = L.consts;
  const bool first = L.first_run != nullptr && L.first_run[t] != 0;
  P* p = reinterpret_cast<P*>(L.params[t]);
  const G* g = reinterpret_cast<const G*>(L.grads[t]);
  float* buf = L.bufs ? reinterpret_cast<float*>(L.bufs[t]) : nullptr;
  float* w = MASTER ? reinterpret_cast<float*>(L.masters[t]) : nullptr;
  alignas(64) float gtmp[kBlock];
  alignas(64) float ptmp[kBlock];
  alignas(64) float btmp[kBlock];
  for (int64_t i0 = b; i0 < e; i0 += kBlock) {
    const int64_t n = std::min(kBlock, e - i0);
    const float* gb = float_view(g + i0, gtmp, n);
    float* pb;
    if constexpr (MASTER) {
      pb = w + i0;
    } else if constexpr (std::is_same_v<P, float>) {
      pb = p + i0;
    } else {
      to_float(p + i0, ptmp, n);
      pb = ptmp;
    }
    float* bb = buf ? buf + i0 : btmp;
#pragma GCC ivdep
    for (int64_t j = 0; j < n; ++j) sgd_update(pb[j], bb[j], gb[j], first, c);
    if constexpr (MASTER || !std::is_same_v<P, float>) from_float(pb, p + i0, n);
  }
}

template <class P, class G, bool MASTER>
void sgd_run(const SgdLaunch& L) {
  parallel_segments(L.mt, [&](int, int64_t t, int64_t b, int64_t e) { sgd_segment<P, G, MASTER>(L, t, b, e); });
}

// ---- LAMB ----------------------------------------------------------------------------------------------
template <class P, class G, bool MASTER>
void lamb_pass1_run(const LambLaunch& L) {
  const int T = team_size(L.mt);
  const int64_t n = L.mt.n;
  std::vector<double> part(size_t(T) * size_t(n) * 2, 0.0);
  parallel_segments(L.mt, [&](int tid, int64_t t, int64_t b, int64_t e) {
    const LambConsts c = L.consts[t];
    const P* p = reinterpret_cast<const P*>(L.params[t]);
    const G* g = reinterpret_cast<const G*>(L.grads[t]);
    float* m = reinterpret_cast<float*>(L.exp_avgs[t]);
    float* v = reinterpret_cast<float*>(L.exp_avg_sqs[t]);
    const float* w = MASTER ? reinterpret_cast<const float*>(L.masters[t]) : nullptr;
    alignas(64) float gtmp[kBlock];
    alignas(64) float ptmp[kBlock];
    double psq = 0.0, usq = 0.0;
    for (int64_t i0 = b; i0 < e; i0 += kBlock) {
      const int64_t k = std::min(kBlock, e - i0);
      const float* gb = float_view(g + i0, gtmp, k);
      const float* pb = MASTER ? w + i0 : float_view(p + i0, ptmp, k);
      float* mb = m + i0;
      float* vb = v + i0;
      alignas(64) float utmp[kBlock];
#pragma GCC ivdep
      for (int64_t j = 0; j < k; ++j) utmp[j] = lamb_moments(pb[j], mb[j], vb[j], gb[j], c);
      double ps = 0.0, us = 0.0;
#pragma omp simd reduction(+ : ps, us)
      for (int64_t j = 0; j < k; ++j) {
        ps += double(pb[j]) * double(pb[j]);
        us += double(utmp[j]) * double(utmp[j]);
      }
      psq += ps;
      usq += us;
    }
    part[(size_t(tid) * size_t(n) + size_t(t)) * 2] += psq;
    part[(size_t(tid) * size_t(n) + size_t(t)) * 2 + 1] += usq;
  });
  for (int tid = 0; tid < T; ++tid)
    for (int64_t t = 0; t < n; ++t) {
      L.p_sq[t] += part[(size_t(tid) * size_t(n) + size_t(t)) * 2];
      L.u_sq[t] += part[(size_t(tid) * size_t(n) + size_t(t)) * 2 + 1];
    }
}

template <class P, class G, bool MASTER>
void lamb_pass2_run(const LambLaunch& L) {
  parallel_segments(L.mt, [&](int, int64_t t, int64_t b, int64_t e) {
    const LambConsts c = L.consts[t];
    const float scale = L.step_scale[t];
    P* p = reinterpret_cast<P*>(L.params[t]);
    const float* m = reinterpret_cast<const float*>(L.exp_avgs[t]);
    const float* v = reinterpret_cast<const float*>(L.exp_avg_sqs[t]);
    float* w = MASTER ? reinterpret_cast<float*>(L.masters[t]) : nullptr;
    alignas(64) float ptmp[kBlock];
    for (int64_t i0 = b; i0 < e; i0 += kBlock) {
      const int64_t k = std::min(kBlock, e - i0);
      float* pb;
      if constexpr (MASTER) {
        pb = w + i0;
      } else if constexpr (std::is_same_v<P, float>) {
        pb = p + i0;
      } else {
        to_float(p + i0, ptmp, k);
        pb = ptmp;
      }
      const float* mb = m + i0;
      const float* vb = v + i0;
#pragma GCC ivdep
      for (int64_t j = 0; j < k; ++j) pb[j] = pb[j] - scale * lamb_direction(pb[j], mb[j], vb[j], c);
      if constexpr (MASTER || !std::is_same_v<P, float>) from_float(pb, p + i0, k);
    }
  });
}

// ---- reductions and scale ------------------------------------------------------------------------------
template <class T>
bool any_non_finite_run(const MultiTensor& mt, const int64_t* ptrs, double divisor) {
  std::atomic<bool> found{false};
  const bool has_div = divisor != 1.0;
  const float div = float(divisor);
  parallel_segments(mt, [&](int, int64_t t, int64_t b, int64_t e) {
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
  const int T_ = team_size(mt);
  const int64_t n = mt.n;
  std::vector<double> part(size_t(T_) * size_t(n), 0.0);
  parallel_segments(mt, [&](int tid, int64_t t, int64_t b, int64_t e) {
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
    part[size_t(tid) * size_t(n) + size_t(t)] += acc;
  });
  for (int64_t t = 0; t < n; ++t) out[t] = 0.0;
  for (int tid = 0; tid < T_; ++tid)
    for (int64_t t = 0; t < n; ++t) out[t] += part[size_t(tid) * size_t(n) + size_t(t)];
}

template <class S, class D>
bool scale_run(const MultiTensor& mt, const int64_t* src, const int64_t* dst, double scale) {
  std::atomic<bool> found{false};
  const float s = float(scale);
  parallel_segments(mt, [&](int, int64_t t, int64_t b, int64_t e) {
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

// ---- dtype dispatch (explicit codes from the caller; never inferred from data) ----------------------------
template <template <class, class, bool> class Op, class LaunchT>
void dispatch_pgm(const LaunchT& L) {
  const bool master = L.masters != nullptr;
#define SF_CASE(PC, PT, GC, GT)                              \
  if (L.param_dtype == PC && L.grad_dtype == GC) {           \
    if (master) {                                            \
      if constexpr (!std::is_same_v<PT, float>) {            \
        Op<PT, GT, true>::run(L);                            \
        return;                                              \
      }                                                      \
    } else {                                                 \
      Op<PT, GT, false>::run(L);                             \
      return;                                                \
    }                                                        \
  }
  SF_CASE(kFloat32, float, kFloat32, float)
  SF_CASE(kFloat32, float, kFloat16, half_t)
  SF_CASE(kFloat32, float, kBFloat16, bf16_t)
  SF_CASE(kFloat16, half_t, kFloat32, float)
  SF_CASE(kFloat16, half_t, kFloat16, half_t)
  SF_CASE(kFloat16, half_t, kBFloat16, bf16_t)
  SF_CASE(kBFloat16, bf16_t, kFloat32, float)
  SF_CASE(kBFloat16, bf16_t, kFloat16, half_t)
  SF_CASE(kBFloat16, bf16_t, kBFloat16, bf16_t)
#undef SF_CASE
  // dispatch.cpp validates codes and rejects masters for float32 params before getting here.
}

template <class P, class G, bool M>
struct AdamOp {
  static void run(const AdamLaunch& L) { adam_run<P, G, M>(L); }
};
template <class P, class G, bool M>
struct SgdOp {
  static void run(const SgdLaunch& L) { sgd_run<P, G, M>(L); }
};
template <class P, class G, bool M>
struct Lamb1Op {
  static void run(const LambLaunch& L) { lamb_pass1_run<P, G, M>(L); }
};
template <class P, class G, bool M>
struct Lamb2Op {
  static void run(const LambLaunch& L) { lamb_pass2_run<P, G, M>(L); }
};

void adam_entry(const AdamLaunch& L) { dispatch_pgm<AdamOp>(L); }
void sgd_entry(const SgdLaunch& L) { dispatch_pgm<SgdOp>(L); }
void lamb1_entry(const LambLaunch& L) { dispatch_pgm<Lamb1Op>(L); }
void lamb2_entry(const LambLaunch& L) { dispatch_pgm<Lamb2Op>(L); }

bool any_non_finite_entry(const MultiTensor& mt, const int64_t* ptrs, int dtype, double divisor) {
  switch (dtype) {
    case kFloat16: return any_non_finite_run<half_t>(mt, ptrs, divisor);
    case kBFloat16: return any_non_finite_run<bf16_t>(mt, ptrs, divisor);
    default: return any_non_finite_run<float>(mt, ptrs, divisor);
  }
}

void sum_squares_entry(const MultiTensor& mt, const int64_t* ptrs, int dtype, double* out) {
  switch (dtype) {
    case kFloat16: sum_squares_run<half_t>(mt, ptrs, out); break;
    case kBFloat16: sum_squares_run<bf16_t>(mt, ptrs, out); break;
    default: sum_squares_run<float>(mt, ptrs, out); break;
  }
}

template <class S>
bool scale_dst(const MultiTensor& mt, const int64_t* src, const int64_t* dst, int dst_dtype, double s) {
  switch (dst_dtype) {
    case kFloat16: return scale_run<S, half_t>(mt, src, dst, s);
    case kBFloat16: return scale_run<S, bf16_t>(mt, src, dst, s);
    default: return scale_run<S, float>(mt, src, dst, s);
  }
}

bool scale_entry(const MultiTensor& mt, const int64_t* src, const int64_t* dst, int src_dtype, int dst_dtype,
                 double s) {
  switch (src_dtype) {
    case kFloat16: return scale_dst<half_t>(mt, src, dst, dst_dtype, s);
    case kBFloat16: return scale_dst<bf16_t>(mt, src, dst, dst_dtype, s);
    default: return scale_dst<float>(mt, src, dst, dst_dtype, s);
  }
}

#define SF_STR2(x) #x
#define SF_STR(x) SF_STR2(x)
const KernelTable kTable = {SF_STR(STEPFORGE_ISA_NS), &adam_entry,        &sgd_entry,         &lamb1_entry,
                            &lamb2_entry,             &any_non_finite_entry, &sum_squares_entry, &scale_entry};

}  // namespace

const KernelTable& table() { return kTable; }

}  // namespace stepforge::cpu::STEPFORGE_ISA_NS
