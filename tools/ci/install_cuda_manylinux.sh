#!/usr/bin/env bash
# cibuildwheel before-all for the CUDA build variant of stepforge-fused (manylinux_2_28 = AlmaLinux 8, x86_64):
# installs nvcc and the static CUDA runtime (the module links cudart_static: no libcudart.so in the wheel).
set -euo pipefail
version="${STEPFORGE_CUDA_VERSION:-13-0}"
dnf install -y dnf-plugins-core
dnf config-manager --add-repo "https://developer.download.nvidia.com/compute/cuda/repos/rhel8/$(uname -m)/cuda-rhel8.repo"
dnf install -y "cuda-nvcc-${version}" "cuda-cudart-devel-${version}"
/usr/local/cuda/bin/nvcc --version
