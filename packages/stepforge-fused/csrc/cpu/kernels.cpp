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

// Rounded 16-bit params of the mixed-precision path are only written, never read by the kernel: with
// normal stores every written line is first read from memory (write-allocate), 2 more bytes per element on
// top of the 28 the step needs. Streaming stores skip that read. `d` must be 64-byte aligned (the caller
// splits blocks so); ordering with later readers comes from the sfence at the end of the segment.
inline void from_float_stream(const float* s, bf16_t* d, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BW__)
  uint16_t* d16 = reinterpret_cast<uint16_t*>(d);
  const __m512i round = _mm512_set1_epi32(0x7fff);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf = _mm512_set1_epi32(0x7f800000);
  const __m512i qnan = _mm512_set1_epi32(0x7fc0);
  // The maskz forms (all lanes on) avoid GCC 12's false -Wmaybe-uninitialized on _mm512_undefined_*.
  const __mmask16 all = 0xffff;
  auto rne = [&](__m512i u) {
    const __m512i lsb = _mm512_and_si512(_mm512_maskz_srli_epi32(all, u, 16), one);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, round), lsb);
    r = _mm512_maskz_srli_epi32(all, r, 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    return _mm512_maskz_cvtepi32_epi16(all, _mm512_mask_mov_epi32(r, nan, qnan));
  };
  for (; i + 32 <= n; i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d16 + i), rne(_mm512_loadu_si512(s + i)));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d16 + i + 16), rne(_mm512_loadu_si512(s + i + 16)));
  }
#endif
  from_float(s + i, d + i, n - i);
}
inline void from_float_stream(const float* s, half_t* d, int64_t n) { from_float(s, d, n); }
inline void stream_fence() {
#if defined(__AVX512BW__)
  _mm_sfence();
#endif
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

// Unscaled-grad write-back (torch's fused grad_scale contract): the block of grads divided (or, MUL, multiplied)
// by f, stored back into the grads in their own dtype, and returned as float (the float storage itself when
// the grads are float32). The update then runs on these values with no further division.
template <bool MUL, class G>
inline const float* unscale_block(const G* src, float* tmp, int64_t n, float f) {
  G* g = const_cast<G*>(src);  // grads are read-only unless the caller asked for the write-back
  float* x;
  if constexpr (std::is_same_v<G, float>) {
    (void)tmp;
    x = g;
  } else {
    to_float(g, tmp, n);
    x = tmp;
  }
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] = MUL ? x[j] * f : x[j] / f;
  if constexpr (!std::is_same_v<G, float>) from_float(x, g, n);
  return x;
}

// ---- parallel loop over the concatenated element range ---------------------------------------------------
// The range [0, total) is cut into chunks (a few per thread, multiples of 64 elements) handed out dynamically,
// so a thread slowed down by another process does not hold up the others. f(chunk, tensor, begin, end) with
// [begin, end) local to the tensor. Chunk boundaries depend only on (total, threads), so reductions that keep
// one partial per (chunk, tensor) and combine them in chunk order are deterministic.
struct Chunks {
  int64_t total = 0;
  int64_t size = 0;
  int64_t count = 0;
  int threads = 1;
};

inline Chunks make_chunks(const MultiTensor& mt) {
  Chunks c;
  c.total = mt.n > 0 ? mt.offsets[mt.n] : 0;
  c.threads = (c.total < kMinParallel || mt.num_threads < 1) ? 1 : mt.num_threads;
  const int64_t pieces = c.threads == 1 ? 1 : int64_t(c.threads) * 4;
  int64_t size = (c.total + pieces - 1) / pieces;
  if (c.threads > 1) size = std::max<int64_t>(size, kMinParallel / 2);
  size = (size + kAlign - 1) / kAlign * kAlign;
  c.size = std::max<int64_t>(size, kAlign);
  c.count = c.total == 0 ? 0 : (c.total + c.size - 1) / c.size;
  return c;
}

inline int64_t first_tensor(const MultiTensor& mt, int64_t pos) {
  return int64_t(std::upper_bound(mt.offsets, mt.offsets + mt.n + 1, pos) - mt.offsets) - 1;
}

template <class F>
void run_chunk(const MultiTensor& mt, const Chunks& c, int64_t chunk, F& f) {
  const int64_t b = chunk * c.size;
  const int64_t e = std::min(c.total, b + c.size);
  int64_t t = first_tensor(mt, b);
  int64_t pos = b;
  while (pos < e && t < mt.n) {
    const int64_t seg_end = std::min(e, mt.offsets[t + 1]);
    if (seg_end > pos) f(chunk, t, pos - mt.offsets[t], seg_end - mt.offsets[t]);
    pos = std::max(pos, seg_end);
    ++t;
  }
}

template <class F>
void parallel_segments(const MultiTensor& mt, F&& f) {
  const Chunks c = make_chunks(mt);
  if (c.count == 0) return;
#if defined(_OPENMP)
  if (c.threads > 1 && c.count > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(c.threads)
    for (int64_t chunk = 0; chunk < c.count; ++chunk) run_chunk(mt, c, chunk, f);
    return;
  }
#endif
  for (int64_t chunk = 0; chunk < c.count; ++chunk) run_chunk(mt, c, chunk, f);
}

// Per-(chunk, tensor) partial sums, combined in chunk order (deterministic for a given thread count).
class ChunkPartials {
 public:
  ChunkPartials(const MultiTensor& mt, int width) : n_(mt.n), width_(width) {
    const Chunks c = make_chunks(mt);
    first_.resize(size_t(c.count));
    base_.assign(size_t(c.count) + 1, 0);
    for (int64_t k = 0; k < c.count; ++k) {
      const int64_t b = k * c.size;
      const int64_t e = std::min(c.total, b + c.size);
      const int64_t t0 = first_tensor(mt, b);
      const int64_t t1 = first_tensor(mt, e - 1);
      first_[size_t(k)] = t0;
      base_[size_t(k) + 1] = base_[size_t(k)] + (t1 - t0 + 1);
    }
    data_.assign(size_t(base_.back()) * size_t(width), 0.0);
  }
  double* at(int64_t chunk, int64_t t) {
    return &data_[size_t(base_[size_t(chunk)] + (t - first_[size_t(chunk)])) * size_t(width_)];
  }
  // out[t * width + w] = sum over chunks, in order, of tensor t's partials.
  void combine(double* out) const {
    for (int64_t i = 0; i < n_ * width_; ++i) out[i] = 0.0;
    for (size_t k = 0; k < first_.size(); ++k)
      for (int64_t j = base_[k]; j < base_[k + 1]; ++j) {
        const int64_t t = first_[k] + (j - base_[k]);
        for (int w = 0; w < width_; ++w) out[t * width_ + w] += data_[size_t(j) * size_t(width_) + size_t(w)];
      }
  }

 private:
  int64_t n_;
  int width_;
  std::vector<int64_t> first_;
  std::vector<int64_t> base_;
  std::vector<double> data_;
};

// ---- Adam ----------------------------------------------------------------------------------------------
// 16-bit params with float32 masters (the mixed-precision path). The master, m and v are updated where they
// live (restrict pointers let GCC vectorise that; no memcpy of each master block into a temporary and back),
// only the grad is converted into an L1 block, and the rounded bf16 param is written with streaming stores
// from an L1 copy of the new masters (from_float_stream: no write-allocate read of the param lines). The
// loop is DRAM-bound: the streaming stores are what measured faster (~10% on 1x50M), the rest is neutral.
template <class P, class G, bool DIV, bool WB>
void adam_master_range(const AdamLaunch& L, int64_t t, int64_t b, int64_t e) {
  const AdamConsts c = L.consts[t];
  P* __restrict p = reinterpret_cast<P*>(L.params[t]);
  const G* __restrict g = reinterpret_cast<const G*>(L.grads[t]);
  float* __restrict w = reinterpret_cast<float*>(L.masters[t]);
  float* __restrict m = reinterpret_cast<float*>(L.exp_avgs[t]);
  float* __restrict v = reinterpret_cast<float*>(L.exp_avg_sqs[t]);
  alignas(64) float gtmp[kBlock];
  alignas(64) float ptmp[kBlock];
  // The first block ends where the param reaches a 64-byte boundary: every later block streams whole lines.
  const int64_t mis = int64_t((64 - (reinterpret_cast<uintptr_t>(p + b) & 63)) & 63) / int64_t(sizeof(P));
  for (int64_t i0 = b; i0 < e;) {
    const int64_t n = std::min(i0 == b && mis > 0 ? mis : kBlock, e - i0);
    const float* __restrict gb = WB ? unscale_block<false>(g + i0, gtmp, n, c.div) : float_view(g + i0, gtmp, n);
    float* __restrict wb = w + i0;
    float* __restrict mb = m + i0;
    float* __restrict vb = v + i0;
    float* __restrict pb = ptmp;
#pragma GCC ivdep
    for (int64_t j = 0; j < n; ++j) {
      float pv = wb[j], mv = mb[j], vv = vb[j];
      adam_update_t<DIV && !WB>(pv, mv, vv, gb[j], c);
      wb[j] = pv;
      mb[j] = mv;
      vb[j] = vv;
      pb[j] = pv;
    }
    if (i0 == b && mis > 0)
      from_float(ptmp, p + i0, n);
    else
      from_float_stream(ptmp, p + i0, n);
    i0 += n;
  }
  stream_fence();
}

template <class P, class G, bool MASTER, bool DIV, bool WB>
void adam_block_range(const AdamLaunch& L, int64_t t, int64_t b, int64_t e) {
  if constexpr (MASTER) {
    adam_master_range<P, G, DIV, WB>(L, t, b, e);
  } else {
    const AdamConsts c = L.consts[t];
    P* p = reinterpret_cast<P*>(L.params[t]);
    const G* g = reinterpret_cast<const G*>(L.grads[t]);
    float* m = reinterpret_cast<float*>(L.exp_avgs[t]);
    float* v = reinterpret_cast<float*>(L.exp_avg_sqs[t]);
    if constexpr (std::is_same_v<P, float> && std::is_same_v<G, float> && WB) {
      float* gw = const_cast<float*>(g);  // write-back requested: the unscaled grad replaces the scaled one
#pragma GCC ivdep
      for (int64_t i = b; i < e; ++i) {
        float pv = p[i], mv = m[i], vv = v[i];
        const float gv = g[i] / c.div;
        gw[i] = gv;
        adam_update_t<false>(pv, mv, vv, gv, c);
        p[i] = pv;
        m[i] = mv;
        v[i] = vv;
      }
    } else if constexpr (std::is_same_v<P, float> && std::is_same_v<G, float>) {
#pragma GCC ivdep
      for (int64_t i = b; i < e; ++i) {
        float pv = p[i], mv = m[i], vv = v[i];
        adam_update_t<DIV>(pv, mv, vv, g[i], c);
        p[i] = pv;
        m[i] = mv;
        v[i] = vv;
      }
    } else {
      alignas(64) float gtmp[kBlock];
      alignas(64) float ptmp[kBlock];
      for (int64_t i0 = b; i0 < e; i0 += kBlock) {
        const int64_t n = std::min(kBlock, e - i0);
        const float* gb = WB ? unscale_block<false>(g + i0, gtmp, n, c.div) : float_view(g + i0, gtmp, n);
        // Update a local copy: GCC does not vectorise this loop when the value lives in the caller's memory
        // next to converted temporaries (measured 3-4x slower steps).
        float* pb = ptmp;
        to_float(p + i0, ptmp, n);
        float* mb = m + i0;
        float* vb = v + i0;
#pragma GCC ivdep
        for (int64_t j = 0; j < n; ++j) adam_update_t<DIV && !WB>(pb[j], mb[j], vb[j], gb[j], c);
        from_float(pb, p + i0, n);
      }
    }
  }
}

// The last numel % kTorchAdamVecWidth elements of a tensor round like torch's scalar tail (adam_math.h).
template <class P, class G, bool MASTER>
void adam_torch_tail(const AdamLaunch& L, int64_t t, int64_t b, int64_t e) {
  AdamConsts c = L.consts[t];
  P* p = reinterpret_cast<P*>(L.params[t]);
  G* g = reinterpret_cast<G*>(L.grads[t]);
  float* m = reinterpret_cast<float*>(L.exp_avgs[t]);
  float* v = reinterpret_cast<float*>(L.exp_avg_sqs[t]);
  float* w = MASTER ? reinterpret_cast<float*>(L.masters[t]) : nullptr;
  const bool wb = L.write_grads && c.has_div;
  const float div = c.div;
  if (wb) c.div = 1.0f;  // the grad is divided (and stored) below; g / 1 is exact
  for (int64_t i = b; i < e; ++i) {
    float pv = MASTER ? w[i] : load_float(p + i);
    float gv = load_float(g + i);
    if (wb) {
      gv = gv / div;
      store_float(g + i, gv);  // the step itself uses the unrounded float, as torch's does
    }
    adam_update_torch_tail(pv, m[i], v[i], gv, c);
    if constexpr (MASTER) w[i] = pv;
    store_float(p + i, pv);
  }
}

template <class P, class G, bool MASTER>
void adam_segment(const AdamLaunch& L, int64_t t, int64_t b, int64_t e) {
  const int64_t size = L.mt.sizes[t];
  const int64_t body_end = size - size % kTorchAdamVecWidth;
  if (b < body_end) {
    if (L.consts[t].has_div && L.write_grads)
      adam_block_range<P, G, MASTER, true, true>(L, t, b, std::min(e, body_end));
    else if (L.consts[t].has_div)
      adam_block_range<P, G, MASTER, true, false>(L, t, b, std::min(e, body_end));
    else
      adam_block_range<P, G, MASTER, false, false>(L, t, b, std::min(e, body_end));
  }
  if (e > body_end) adam_torch_tail<P, G, MASTER>(L, t, std::max(b, body_end), e);
}

template <class P, class G, bool MASTER>
void adam_run(const AdamLaunch& L) {
  parallel_segments(L.mt, [&](int64_t, int64_t t, int64_t b, int64_t e) { adam_segment<P, G, MASTER>(L, t, b, e); });
}

// ---- SGD -----------------------------------------------------------------------------------------------
// Branch-free form of sgd_update (sgd_math.h) for the vectoriser: the grad divisor becomes a multiply by its
// inverse (exact for 1), decay terms are fmas with a 0 coefficient when off, momentum/nesterov/first step are
// template flags chosen per tensor.
struct SgdVec {
  float lr, momentum, one_minus_damp, wd_before, wd_after, inv_div;
};

template <bool MOM, bool NEST, bool FIRST>
inline void sgd_elem(float& p, float& buf, float g, const SgdVec& c) {
  g = g * c.inv_div;
  g = fmaf(c.wd_before, p, g);
  float d = g;
  if constexpr (MOM) {
    if constexpr (FIRST) {
      buf = g;
    } else {
      buf = fmaf(c.one_minus_damp, g, buf * c.momentum);  // torch: buf.mul_(momentum).add_(g, alpha=1-dampening)
    }
    if constexpr (NEST) {
      d = fmaf(c.momentum, buf, g);
    } else {
      d = buf;
    }
  }
  d = fmaf(c.wd_after, p, d);
  p = fmaf(-c.lr, d, p);
}

// wb (write-back): c.inv_div is 1 and the grads are multiplied by `unscale` and stored back before the update.
template <class P, class G, bool MASTER, bool MOM, bool NEST, bool FIRST>
void sgd_range(const SgdLaunch& L, const SgdVec& c, bool wb, float unscale, int64_t t, int64_t b, int64_t e) {
  P* p = reinterpret_cast<P*>(L.params[t]);
  const G* g = reinterpret_cast<const G*>(L.grads[t]);
  float* buf = MOM ? reinterpret_cast<float*>(L.bufs[t]) : nullptr;
  float* w = MASTER ? reinterpret_cast<float*>(L.masters[t]) : nullptr;
  if constexpr (MOM && !MASTER && std::is_same_v<P, float> && std::is_same_v<G, float>) {
    // All float32 in place: no block copies.
    if (wb) {
      float* gw = const_cast<float*>(g);
#pragma GCC ivdep
      for (int64_t i = b; i < e; ++i) {
        float pv = p[i], bv = buf[i];
        const float gv = g[i] * unscale;
        gw[i] = gv;
        sgd_elem<MOM, NEST, FIRST>(pv, bv, gv, c);
        p[i] = pv;
        buf[i] = bv;
      }
      return;
    }
#pragma GCC ivdep
    for (int64_t i = b; i < e; ++i) {
      float pv = p[i], bv = buf[i];
      sgd_elem<MOM, NEST, FIRST>(pv, bv, g[i], c);
      p[i] = pv;
      buf[i] = bv;
    }
    return;
  }
  alignas(64) float gtmp[kBlock];
  alignas(64) float ptmp[kBlock];
  alignas(64) float btmp[kBlock];
  for (int64_t i0 = b; i0 < e; i0 += kBlock) {
    const int64_t n = std::min(kBlock, e - i0);
    const float* gb = wb ? unscale_block<true>(g + i0, gtmp, n, unscale) : float_view(g + i0, gtmp, n);
    float* pb = ptmp;  // local copy: see adam_block_range
    if constexpr (MASTER) {
      std::memcpy(ptmp, w + i0, size_t(n) * sizeof(float));
    } else {
      to_float(p + i0, ptmp, n);
    }
    float* bb = MOM ? buf + i0 : btmp;
#pragma GCC ivdep
    for (int64_t j = 0; j < n; ++j) sgd_elem<MOM, NEST, FIRST>(pb[j], bb[j], gb[j], c);
    if constexpr (MASTER) std::memcpy(w + i0, ptmp, size_t(n) * sizeof(float));
    from_float(pb, p + i0, n);
  }
}

template <class P, class G, bool MASTER>
void sgd_run(const SgdLaunch& L) {
  const SgdConsts& k = L.consts;
  const float inv_div = float(1.0 / double(k.div));
  const bool wb = L.write_grads && k.has_div;
  const SgdVec c{k.lr, k.momentum, k.one_minus_damp, k.wd_before ? k.wd : 0.0f, k.wd_after ? k.wd : 0.0f,
                 wb ? 1.0f : inv_div};
  parallel_segments(L.mt, [&](int64_t, int64_t t, int64_t b, int64_t e) {
    const bool first = L.first_run != nullptr && L.first_run[t] != 0;
    if (!k.has_momentum) {
      sgd_range<P, G, MASTER, false, false, false>(L, c, wb, inv_div, t, b, e);
    } else if (k.nesterov) {
      if (first)
        sgd_range<P, G, MASTER, true, true, true>(L, c, wb, inv_div, t, b, e);
      else
        sgd_range<P, G, MASTER, true, true, false>(L, c, wb, inv_div, t, b, e);
    } else {
      if (first)
        sgd_range<P, G, MASTER, true, false, true>(L, c, wb, inv_div, t, b, e);
      else
        sgd_range<P, G, MASTER, true, false, false>(L, c, wb, inv_div, t, b, e);
    }
  });
}

// ---- LAMB ----------------------------------------------------------------------------------------------
template <class P, class G, bool MASTER>
void lamb_pass1_run(const LambLaunch& L) {
  ChunkPartials part(L.mt, 2);
  parallel_segments(L.mt, [&](int64_t chunk, int64_t t, int64_t b, int64_t e) {
    LambConsts c = L.consts[t];
    const bool wb = L.write_grads && c.has_div;
    const float unscale = c.inv_div;
    if (wb) c.inv_div = 1.0f;  // grads are unscaled (and stored back) per block below; x * 1 is exact
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
      const float* gb = wb ? unscale_block<true>(g + i0, gtmp, k, unscale) : float_view(g + i0, gtmp, k);
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
    double* slot = part.at(chunk, t);
    slot[0] += psq;
    slot[1] += usq;
  });
  std::vector<double> sums(size_t(L.mt.n) * 2);
  part.combine(sums.data());
  for (int64_t t = 0; t < L.mt.n; ++t) {
    L.p_sq[t] += sums[size_t(t) * 2];
    L.u_sq[t] += sums[size_t(t) * 2 + 1];
  }
}

template <class P, class G, bool MASTER>
void lamb_pass2_run(const LambLaunch& L) {
  parallel_segments(L.mt, [&](int64_t, int64_t t, int64_t b, int64_t e) {
    const LambConsts c = L.consts[t];
    const float scale = L.step_scale[t];
    P* p = reinterpret_cast<P*>(L.params[t]);
    const float* m = reinterpret_cast<const float*>(L.exp_avgs[t]);
    const float* v = reinterpret_cast<const float*>(L.exp_avg_sqs[t]);
    float* w = MASTER ? reinterpret_cast<float*>(L.masters[t]) : nullptr;
    alignas(64) float ptmp[kBlock];
    for (int64_t i0 = b; i0 < e; i0 += kBlock) {
      const int64_t k = std::min(kBlock, e - i0);
      float* pb = ptmp;  // local copy: see adam_block_range
      if constexpr (MASTER) {
        std::memcpy(ptmp, w + i0, size_t(k) * sizeof(float));
      } else {
        to_float(p + i0, ptmp, k);
      }
      const float* mb = m + i0;
      const float* vb = v + i0;
#pragma GCC ivdep
      for (int64_t j = 0; j < k; ++j) pb[j] = pb[j] - scale * lamb_direction(pb[j], mb[j], vb[j], c);
      if constexpr (MASTER) std::memcpy(w + i0, ptmp, size_t(k) * sizeof(float));
      from_float(pb, p + i0, k);
    }
  });
}

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
