// SPDX-License-Identifier: Apache-2.0
// Block conversions between the storage types and float for the per-ISA CPU kernels (round to nearest even,
// NaN stays NaN), plus the unscaled-grad write-back block. Included only by the kernel files compiled once per
// ISA: everything here has internal linkage in that ISA's namespace, so copies built with different
// instruction sets never meet at link time.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) || defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "cpu/kernels.h"

#ifndef STEPFORGE_ISA_NS
#error "STEPFORGE_ISA_NS must name the ISA copy (scalar, avx2, avx512)"
#endif

namespace stepforge::cpu::STEPFORGE_ISA_NS {
namespace {

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

}  // namespace
}  // namespace stepforge::cpu::STEPFORGE_ISA_NS
