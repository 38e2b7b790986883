// SPDX-License-Identifier: Apache-2.0
// stepforge.fused._cpu: CPU kernels (their bindings in cpu/ops.cpp) plus ISA selection and threading controls.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu/isa.h"
#include "stepforge/dtype_codes.h"

namespace py = pybind11;

namespace stepforge::bindings {
void register_cpu_kernels(py::module_& m);

// Marks the 2 MiB-aligned interior of [ptr, ptr + nbytes) for transparent huge pages (what torch's own CPU
// allocator does under THP_MEM_ALLOC_ENABLE=1). The optimizer state is streamed once per step; on 4 KiB pages
// every 4 KiB of every stream costs a TLB miss, and under a hypervisor each miss is a two-level page walk.
// Pages not yet touched are then faulted in as huge pages. Returns the bytes advised (0: nothing to do or
// not supported here).
int64_t advise_huge_pages(int64_t ptr, int64_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  if (ptr == 0 || nbytes <= 0) return 0;
  const uintptr_t begin = (uintptr_t(ptr) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (uintptr_t(ptr) + uintptr_t(nbytes)) & ~(kHuge - 1);
  if (end <= begin) return 0;
  if (madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) != 0) return 0;
  return int64_t(end - begin);
#else
  (void)ptr;
  (void)nbytes;
  return 0;
#endif
}
}  // namespace stepforge::bindings

PYBIND11_MODULE(_cpu, m, py::mod_gil_not_used()) {
  namespace cpu = stepforge::cpu;
  m.doc() = "stepforge-fused CPU kernels (multi-tensor, raw pointers; contract in csrc/README.md)";
  m.attr("DTYPE_FLOAT32") = int(stepforge::kFloat32);
  m.attr("DTYPE_FLOAT16") = int(stepforge::kFloat16);
  m.attr("DTYPE_BFLOAT16") = int(stepforge::kBFloat16);

  m.def(
      "cpu_features",
      [] {
        py::dict d;
        d["isa"] = cpu::active_isa();
        d["supported"] = cpu::supported_isas();
        d["compiled"] = cpu::compiled_isas();
        std::string env = cpu::env_isa();
        d["forced_by_env"] = env.empty() ? py::object(py::none()) : py::object(py::str(env));
        d["openmp"] = cpu::has_openmp();
        d["max_threads"] = cpu::max_threads();
        d["num_threads"] = cpu::default_threads();
        py::dict flags;
        for (const char* f : {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512bf16"})
          flags[f] = cpu::cpu_has(f);
        d["cpu_flags"] = flags;
        return d;
      },
      "The chosen ISA path, the paths this CPU supports, and the threading setup.");
  m.def(
      "set_isa", [](const std::string& name) { cpu::set_isa(name); }, py::arg("name"),
      "Switch the kernel path at call time ('scalar', 'avx2', 'avx512' or 'auto'); ValueError if unsupported.");
  m.def("get_isa", &cpu::active_isa, "Name of the active kernel path.");
  m.def(
      "set_num_threads", [](int n) { cpu::set_default_threads(n); }, py::arg("n"),
      "Default OpenMP thread count for calls that pass ctx <= 0 (n <= 0: the OpenMP default).");
  m.def("get_num_threads", &cpu::default_threads, "Default OpenMP thread count.");

  m.def("advise_huge_pages", &stepforge::bindings::advise_huge_pages, py::arg("ptr"), py::arg("nbytes"),
        "Ask for transparent huge pages on the 2 MiB-aligned interior of [ptr, ptr + nbytes) (Linux "
        "madvise(MADV_HUGEPAGE)); returns the bytes advised, 0 where unsupported. Call before first touch.");

  stepforge::bindings::register_cpu_kernels(m);
}
