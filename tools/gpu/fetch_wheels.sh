#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run HERE (a machine with network), in the repo root, before tools/gpu/run_all.sh goes to the GPU machine:
# downloads into .whl/ (git-ignored) the pure-Python wheels that machine's image lacks, for Python 3.12:
#   mmengine and its small dependencies (stepforge-mmengine's tests), hatchling (builds the pure stepforge
#   packages there with --no-build-isolation), pybind11 and scikit-build-core at the versions stepforge-fused
#   builds with. Versions from constraints/cpu.txt where pinned there. About 3 MB. Then carry .whl in the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(
    mmengine==0.10.7 addict==2.4.0 termcolor==3.3.0 yapf==0.43.0 platformdirs==4.14.8
    hatchling==1.33.0 trove-classifiers==2026.9.21.13
    pybind11==3.1.0 scikit-build-core==1.1.2
)
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
ls -l .whl
