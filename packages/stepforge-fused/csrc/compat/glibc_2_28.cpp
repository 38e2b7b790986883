// SPDX-License-Identifier: Apache-2.0
// Linked into _cpu only with STEPFORGE_MANYLINUX_2_28=ON (nox -s wheel on a host newer than glibc 2.28).
//
// Built with g++ 12 against glibc 2.36, the module references five symbols whose versions are newer than
// manylinux_2_28 allows (glibc 2.28, GLIBCXX_3.4.25, CXXABI_1.3.11). Each is resolved here through an older,
// equivalent symbol, so auditwheel (which checks exactly these version references) accepts manylinux_2_28.
// libstdc++ stays a shared dependency: linking it statically drags in glibc 2.34-2.36 symbols (arc4random,
// _dl_find_object). cibuildwheel's manylinux_2_28 image links against old versions and never needs this file.

// pow: glibc 2.29 added pow@GLIBC_2.29 (the same implementation, without the SVID error-handling wrapper). The
// module is linked with --wrap=pow, so every reference lands in __wrap_pow, which calls pow@GLIBC_2.2.5: the same
// value for the finite arguments used here (bias corrections beta^step).
extern "C" double stepforge_pow_glibc_2_2_5(double x, double y);
__asm__(".symver stepforge_pow_glibc_2_2_5,pow@GLIBC_2.2.5");

extern "C" {

__attribute__((visibility("hidden"))) double __wrap_pow(double x, double y) {
  return stepforge_pow_glibc_2_2_5(x, y);
}

// __libc_single_threaded (glibc 2.32) is read by libstdc++'s headers to skip atomic reference counting in
// single-threaded processes. This hidden definition satisfies those references locally; 0 means "assume several
// threads", i.e. always the atomic path, which is what glibc < 2.32 gets as well.
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;

// GLIBCXX_3.4.29: g++ >= 11 headers call std::__throw_bad_array_new_length() from new[]-style allocations.
__attribute__((visibility("hidden"), noreturn)) void __wrap__ZSt28__throw_bad_array_new_lengthv();

// CXXABI_1.3.13: g++ >= 12 headers call exception_ptr::_M_addref/_M_release inline (pybind11 copies
// std::exception_ptr). The copy constructor and destructor exported since CXXABI_1.3.3 do exactly one addref /
// one release, so they stand in: a copy made into a scratch slot and never destroyed is an addref; destroying a
// scratch slot holding the same pointer (no addref) is a release.
void stepforge_exception_ptr_copy(void* self, const void* other) __asm__("_ZNSt15__exception_ptr13exception_ptrC1ERKS0_");
void stepforge_exception_ptr_destroy(void* self) __asm__("_ZNSt15__exception_ptr13exception_ptrD1Ev");
__attribute__((visibility("hidden"))) void __wrap__ZNSt15__exception_ptr13exception_ptr9_M_addrefEv(void* self) {
  void* scratch = nullptr;
  stepforge_exception_ptr_copy(&scratch, self);
}
__attribute__((visibility("hidden"))) void __wrap__ZNSt15__exception_ptr13exception_ptr10_M_releaseEv(void* self) {
  void* scratch = *static_cast<void**>(self);
  stepforge_exception_ptr_destroy(&scratch);
}
}

#include <new>

extern "C" void __wrap__ZSt28__throw_bad_array_new_lengthv() { throw std::bad_array_new_length(); }
