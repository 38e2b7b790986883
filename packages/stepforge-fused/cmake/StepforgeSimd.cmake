# SPDX-License-Identifier: Apache-2.0
# Compile the per-op CPU kernel files once per ISA (ATen-style) into the static library stepforge_cpu_kernels.
# Each copy gets its own namespace (STEPFORGE_ISA_NS) and flags; csrc/cpu/isa.cpp picks one at run time.
# Never -march=native: wheels must run on any x86-64 CPU. FP contraction is off everywhere so every path (and
# torch's fused AdamW) rounds the same way; FMAs are written explicitly (fmaf) in the math headers.

function(stepforge_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra)
    if(STEPFORGE_WERROR)
      target_compile_options(${target} PRIVATE -Werror)
    endif()
  endif()
endfunction()

set(_sf_common_flags -O3 -ffp-contract=off -fno-math-errno -fno-trapping-math -fno-strict-aliasing -fopenmp-simd)

if(STEPFORGE_OPENMP)
  find_package(OpenMP COMPONENTS CXX)
endif()

set(_sf_isas scalar)
set(_sf_flags_scalar "")
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64|amd64")
  list(APPEND _sf_isas avx2 avx512)
  set(_sf_flags_avx2 -mavx2 -mfma -mf16c -mbmi2)
  set(_sf_flags_avx512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c -mbmi2)
endif()

set(_sf_kernel_sources
  csrc/cpu/adam_kernel.cpp
  csrc/cpu/sgd_kernel.cpp
  csrc/cpu/lamb_kernel.cpp
  csrc/cpu/reduce_kernel.cpp)

add_library(stepforge_cpu_kernels STATIC)
foreach(isa IN LISTS _sf_isas)
  add_library(stepforge_cpu_${isa} OBJECT ${_sf_kernel_sources})
  target_include_directories(stepforge_cpu_${isa} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/csrc/include
                                                         ${CMAKE_CURRENT_SOURCE_DIR}/csrc)
  string(TOUPPER ${isa} _ISA)
  target_compile_definitions(stepforge_cpu_${isa} PRIVATE STEPFORGE_ISA_NS=${isa} STEPFORGE_ISA_${_ISA}=1)
  target_compile_options(stepforge_cpu_${isa} PRIVATE ${_sf_common_flags} ${_sf_flags_${isa}})
  if(OpenMP_CXX_FOUND)
    target_compile_options(stepforge_cpu_${isa} PRIVATE ${OpenMP_CXX_FLAGS})
  endif()
  stepforge_warnings(stepforge_cpu_${isa})
  target_sources(stepforge_cpu_kernels PRIVATE $<TARGET_OBJECTS:stepforge_cpu_${isa}>)
  string(APPEND _sf_isa_defs "STEPFORGE_HAVE_${_ISA}=1;")
endforeach()
# isa.cpp needs to know which copies exist.
target_compile_definitions(stepforge_cpu_kernels PUBLIC ${_sf_isa_defs})
target_include_directories(stepforge_cpu_kernels PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/csrc/include)
set_target_properties(stepforge_cpu_kernels PROPERTIES LINKER_LANGUAGE CXX)
if(OpenMP_CXX_FOUND)
  if(STEPFORGE_OPENMP_RUNTIME STREQUAL "host")
    # Compile flags only: no DT_NEEDED on libgomp; the runtime torch loaded globally provides the symbols.
    target_compile_options(stepforge_cpu_kernels PUBLIC ${OpenMP_CXX_FLAGS})
  elseif(STEPFORGE_OPENMP_RUNTIME STREQUAL "link")
    target_link_libraries(stepforge_cpu_kernels PUBLIC OpenMP::OpenMP_CXX)
  else()
    message(FATAL_ERROR "STEPFORGE_OPENMP_RUNTIME='${STEPFORGE_OPENMP_RUNTIME}': use link or host")
  endif()
  target_compile_definitions(stepforge_cpu_kernels PUBLIC STEPFORGE_HAVE_OPENMP=1)
endif()
