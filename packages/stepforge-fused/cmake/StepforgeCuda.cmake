# SPDX-License-Identifier: Apache-2.0
#
# Optional CUDA module `stepforge.fused._cuda`, included by CMakeLists.txt once the CUDA language is enabled
# (STEPFORGE_CUDA=ON, or AUTO with nvcc found through PATH/CUDACXX). Defines the targets:
#   stepforge_cuda_kernels  static library: csrc/cuda/*.cu (kernels + plain C++ launchers, no pybind11)
#   _cuda                   pybind11 module: csrc/bindings/module_cuda.cpp + register_cuda_kernels.cpp (host
#                           compiler only)
#
# Architectures: STEPFORGE_CUDA_ARCHS (default "80;90"; "native"/"all" refused: build machines have nvcc but
# no GPU and wheels must be portable). Each plain number N becomes "N-real" (a cubin) and the newest one also
# "N-virtual" (PTX that newer GPUs JIT-compile), so the module runs on sm_80, sm_90 and newer. An explicit
# CMAKE_CUDA_ARCHITECTURES different from STEPFORGE_CUDA_ARCHS (a user override) is used as given.
#
# The CUDA runtime is linked statically (CUDA::cudart_static): the module imports on machines without
# libcudart.so or without a driver, and stepforge.fused._backend.cuda_status() says why it cannot run there.

include_guard(GLOBAL)

if(NOT CMAKE_CUDA_COMPILER)
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    message(FATAL_ERROR "StepforgeCuda.cmake: no CUDA compiler (put nvcc on PATH or set CUDACXX)")
  endif()
  enable_language(CUDA)
endif()
if(NOT TARGET CUDA::cudart_static)
  find_package(CUDAToolkit REQUIRED)
endif()

# ---- architectures ----------------------------------------------------------------------------------------
if(NOT DEFINED STEPFORGE_CUDA_ARCHS OR STEPFORGE_CUDA_ARCHS STREQUAL "")
  set(STEPFORGE_CUDA_ARCHS "80;90")
endif()
set(_sf_archs "")
set(_sf_max 0)
foreach(_a IN LISTS STEPFORGE_CUDA_ARCHS)
  string(STRIP "${_a}" _a)
  if(_a STREQUAL "")
    continue()
  endif()
  if(_a MATCHES "native|all")
    message(FATAL_ERROR "STEPFORGE_CUDA_ARCHS='${STEPFORGE_CUDA_ARCHS}': '${_a}' is not allowed; list SM numbers "
                        "such as 80;90 (build machines have no GPU and wheels must be portable)")
  elseif(_a MATCHES "^([0-9]+)[af]?$")
    list(APPEND _sf_archs "${_a}-real")
    if(CMAKE_MATCH_1 GREATER _sf_max)
      set(_sf_max ${CMAKE_MATCH_1})
    endif()
  elseif(_a MATCHES "^[0-9]+[af]?-(real|virtual)$")
    list(APPEND _sf_archs "${_a}")
  else()
    message(FATAL_ERROR "STEPFORGE_CUDA_ARCHS: cannot parse '${_a}' (expected e.g. 80, 90, 90a, 90-real)")
  endif()
endforeach()
if(_sf_max GREATER 0)
  list(APPEND _sf_archs "${_sf_max}-virtual")
endif()
if(NOT _sf_archs)
  message(FATAL_ERROR "STEPFORGE_CUDA_ARCHS is empty")
endif()
if(DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT "${CMAKE_CUDA_ARCHITECTURES}" STREQUAL "${STEPFORGE_CUDA_ARCHS}")
  set(_sf_archs "${CMAKE_CUDA_ARCHITECTURES}")  # explicit user override
endif()
if("${_sf_archs}" MATCHES "native|all")
  message(FATAL_ERROR "CUDA architectures '${_sf_archs}': 'native'/'all' are not allowed (portable wheels)")
endif()

# ---- targets ----------------------------------------------------------------------------------------------
set(_sf_root "${CMAKE_CURRENT_LIST_DIR}/..")
file(GLOB _sf_cuda_sources CONFIGURE_DEPENDS "${_sf_root}/csrc/cuda/*.cu")
file(GLOB _sf_cuda_bindings CONFIGURE_DEPENDS "${_sf_root}/csrc/bindings/module_cuda.cpp"
     "${_sf_root}/csrc/bindings/register_cuda_*.cpp")

add_library(stepforge_cuda_kernels STATIC ${_sf_cuda_sources})
target_include_directories(stepforge_cuda_kernels PUBLIC "${_sf_root}/csrc/include" "${_sf_root}/csrc/cuda")
set_target_properties(stepforge_cuda_kernels PROPERTIES
  CUDA_ARCHITECTURES "${_sf_archs}"
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  POSITION_INDEPENDENT_CODE ON
  CUDA_SEPARABLE_COMPILATION OFF
  CUDA_RUNTIME_LIBRARY Static
  CUDA_VISIBILITY_PRESET hidden
  CXX_VISIBILITY_PRESET hidden)
# No --use_fast_math: sqrt and division stay IEEE so the GPU update matches the CPU kernels and torch.optim.
target_compile_options(stepforge_cuda_kernels PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo --expt-relaxed-constexpr -Xcompiler=-fvisibility=hidden>)
string(REPLACE ";" "," _sf_arch_csv "${_sf_archs}")
target_compile_definitions(stepforge_cuda_kernels PRIVATE STEPFORGE_CUDA_ARCH_LIST="${_sf_arch_csv}")
target_link_libraries(stepforge_cuda_kernels PUBLIC CUDA::cudart_static)

pybind11_add_module(_cuda MODULE ${_sf_cuda_bindings})
# csrc/: the bindings share bindings/i64_arg.h (and the I64 view of cpu/ops.h) with the CPU module.
target_include_directories(_cuda PRIVATE "${_sf_root}/csrc")
target_link_libraries(_cuda PRIVATE stepforge_cuda_kernels CUDA::cudart_static)
target_compile_definitions(_cuda PRIVATE STEPFORGE_CUDA_TOOLKIT_VERSION="${CUDAToolkit_VERSION}")
if(COMMAND stepforge_warnings)
  stepforge_warnings(_cuda)
endif()
install(TARGETS _cuda LIBRARY DESTINATION stepforge/fused)
message(STATUS "stepforge-fused: _cuda for ${_sf_archs} with CUDA ${CUDAToolkit_VERSION} (static cudart)")
