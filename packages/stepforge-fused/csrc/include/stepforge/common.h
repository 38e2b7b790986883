// SPDX-License-Identifier: Apache-2.0
// Shared definitions for the CPU and CUDA kernels of stepforge-fused: the host/device qualifier macro, the dtype
// codes (dtype_codes.h) and float <-> fp16/bf16 conversions that give the same bits on host and device (round to nearest even,
// NaN stays NaN). Included by csrc/cpu/* and csrc/cuda/*; keep it free of pybind11 and of the CUDA runtime API.
#pragma once

#include <cstdint>
#include <cstring>

#include "stepforge/dtype_codes.h"

#if defined(__CUDACC__) || defined(__HIPCC__)
#define STEPFORGE_HOST_DEVICE __host__ __device__ __forceinline__
#define STEPFORGE_DEVICE_CODE 1
#else
// static: every CPU translation unit gets its own copy. The kernel files are compiled once per ISA with
// different instruction sets; with plain `inline` the linker would keep one (say the AVX-512) copy of any
// helper that was not inlined and call it from the scalar path too. always_inline: `inline` is only a hint,
// and GCC kept sgd_update_t out of line in the fp32 momentum loop, a call per element that blocked
// vectorisation (FusedSGD with momentum ran 6x slower than torch); CUDA's __forceinline__ is the same promise.
#if defined(__GNUC__) || defined(__clang__)
#define STEPFORGE_HOST_DEVICE static inline __attribute__((always_inline))
#else
#define STEPFORGE_HOST_DEVICE static inline
#endif
#define STEPFORGE_DEVICE_CODE 0
#endif

namespace stepforge {

// Storage-only 16-bit types: arithmetic always happens in float after load_float().
struct half_t {
  uint16_t x;
};
struct bf16_t {
  uint16_t x;
};

STEPFORGE_HOST_DEVICE uint32_t float_as_bits(float f) {
#if STEPFORGE_DEVICE_CODE && defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

STEPFORGE_HOST_DEVICE float bits_as_float(uint32_t u) {
#if STEPFORGE_DEVICE_CODE && defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// bfloat16 -> float is exact: the bf16 bits are the top half of the float.
STEPFORGE_HOST_DEVICE float bf16_bits_to_float(uint16_t h) { return bits_as_float(uint32_t(h) << 16); }

// float -> bfloat16, round to nearest even; every NaN becomes the canonical quiet NaN 0x7FC0 (the rule of
// c10::BFloat16's scalar conversion; torch's vectorised conversions may keep a NaN's sign and payload).
STEPFORGE_HOST_DEVICE uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_as_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t(0x7fc0u);
  uint32_t lsb = (u >> 16) & 1u;
  return uint16_t((u + 0x7fffu + lsb) >> 16);
}

// IEEE binary16 -> float, exact (subnormals included).
STEPFORGE_HOST_DEVICE float half_bits_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    // Subnormal or zero: mant * 2^-24 is exact in float.
    float mag = float(mant) * 5.9604644775390625e-8f;
    return bits_as_float(float_as_bits(mag) | sign);
  }
  if (exp == 31) return bits_as_float(sign | 0x7f800000u | (mant << 13));
  return bits_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// float -> IEEE binary16, round to nearest even, overflow to inf, NaN -> quiet NaN (same bits as F16C and
// CUDA's __float2half_rn for every non-NaN input).
STEPFORGE_HOST_DEVICE uint16_t float_to_half_bits(float f) {
  uint32_t u = float_as_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) return uint16_t(sign | (u > 0x7f800000u ? 0x7e00u | ((u >> 13) & 0x3ffu) : 0x7c00u));
  if (u >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (u < 0x38800000u) {
    // Below the smallest normal half: adding 0.5f rounds the value to a multiple of 2^-24 (nearest even).
    float r = bits_as_float(u) + 0.5f;
    return uint16_t(sign | uint16_t(float_as_bits(r) - 0x3f000000u));
  }
  uint32_t odd = (u >> 13) & 1u;
  u += 0xc8000fffu + odd;  // rebias exponent (127 -> 15) and round to nearest even
  return uint16_t(sign | uint16_t(u >> 13));
}

// Typed load/store in float, so the update rules are written once for every storage type.
STEPFORGE_HOST_DEVICE float load_float(const float* p) { return *p; }
STEPFORGE_HOST_DEVICE float load_float(const half_t* p) { return half_bits_to_float(p->x); }
STEPFORGE_HOST_DEVICE float load_float(const bf16_t* p) { return bf16_bits_to_float(p->x); }
STEPFORGE_HOST_DEVICE void store_float(float* p, float v) { *p = v; }
STEPFORGE_HOST_DEVICE void store_float(half_t* p, float v) { p->x = float_to_half_bits(v); }
STEPFORGE_HOST_DEVICE void store_float(bf16_t* p, float v) { p->x = float_to_bf16_bits(v); }

STEPFORGE_HOST_DEVICE bool is_finite_float(float v) { return (float_as_bits(v) & 0x7f800000u) != 0x7f800000u; }

}  // namespace stepforge
