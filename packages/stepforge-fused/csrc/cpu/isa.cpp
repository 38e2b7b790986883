// SPDX-License-Identifier: Apache-2.0
// CPU kernel path selection (scalar / AVX2 / AVX-512, chosen at run time from the CPU's features or
// STEPFORGE_CPU_ISA) and the OpenMP thread defaults. Compiled once, without ISA flags.
#include "cpu/isa.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(STEPFORGE_HAVE_OPENMP)
#include <omp.h>
#endif

#include "cpu/kernels.h"

namespace stepforge::cpu {
namespace {

#define STEPFORGE_TABLE(isa)                                                                           \
  KernelTable{#isa, &isa::adam, &isa::sgd, &isa::lamb_pass1, &isa::lamb_pass2, &isa::any_non_finite, \
              &isa::sum_squares, &isa::scale}
const KernelTable kScalar = STEPFORGE_TABLE(scalar);
#if defined(STEPFORGE_HAVE_AVX2)
const KernelTable kAvx2 = STEPFORGE_TABLE(avx2);
#endif
#if defined(STEPFORGE_HAVE_AVX512)
const KernelTable kAvx512 = STEPFORGE_TABLE(avx512);
#endif
#undef STEPFORGE_TABLE


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
      {"avx512", [] { return &kAvx512; }, &x86_avx512},
#endif
#if defined(STEPFORGE_HAVE_AVX2)
      {"avx2", [] { return &kAvx2; }, &x86_avx2},
#endif
      {"scalar", [] { return &kScalar; }, &always},
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
  return &kScalar;
}

}  // namespace

const KernelTable& active_table() {
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
std::string active_isa() { return active_table().name; }

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
  (void)active_table();
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

}  // namespace stepforge::cpu
