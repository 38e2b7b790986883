# SPDX-License-Identifier: Apache-2.0
"""Registers of the CUDA Adam kernel as ptxas allocates them, for every architecture the wheels ship (no device).

Runs in the ``build_cuda`` nox session (nvcc, no device), beside ``test_cuda_build.py``; the CPU sessions build
stepforge-fused without its CUDA module and skip, and under ``STEPFORGE_EXPECT_CUDA_BUILD=1`` a missing nvcc
fails.

Unbounded, ptxas gave ``adam_kernel`` 96-100 registers: 2 blocks of 256 threads per SM, too few loads in flight
for the five streams of the master-weight pass (84% of the copy bandwidth on an H200). Capped at 4
blocks per SM it reached 90-91% (``benchmarks/results/gpu-runs/gpu-2026-11-26b-h200-runs.md``). This test keeps the cap
(at most 64 registers) and checks that it costs no more than a token spill.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from stepforge.fused import _backend

CUDA_SOURCES = Path(__file__).resolve().parents[2] / "csrc"
ARCHS = ("80", "90")  # STEPFORGE_CUDA_ARCHS' default: what the wheels carry
MAX_REGISTERS = 64  # 65536 registers per SM / (4 blocks x 256 threads)
MAX_SPILL_BYTES = 32


def _nvcc() -> str | None:
    found = os.environ.get("CUDACXX") or shutil.which("nvcc")
    if found is None:
        candidates = sorted(Path("/usr/local").glob("cuda*/bin/nvcc"), reverse=True)
        found = str(candidates[0]) if candidates else None
    return found


def _ptxas_report(nvcc: str, source: Path, arch: str) -> dict[str, tuple[int, int]]:
    """{mangled kernel name: (registers, spill store bytes)} from ``ptxas -v`` for one architecture."""
    out = subprocess.run(
        [nvcc, "-std=c++17", "-O3", "--expt-relaxed-constexpr", f"-arch=sm_{arch}",
         f"-I{CUDA_SOURCES / 'include'}", f"-I{CUDA_SOURCES / 'cuda'}", "-Xptxas", "-v",
         "-c", str(source), "-o", os.devnull],
        capture_output=True, text=True, timeout=300, check=True,
    ).stderr  # fmt: skip
    kernels: dict[str, tuple[int, int]] = {}
    name, spill = None, 0
    for line in out.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            name, spill = m.group(1), 0
        elif m := re.search(r"(\d+) bytes spill stores", line):
            spill = int(m.group(1))
        elif (m := re.search(r"Used (\d+) registers", line)) and name is not None:
            kernels[name] = (int(m.group(1)), spill)
            name = None
    return kernels


NVCC = _nvcc()
EXPECT_BUILD = os.environ.get("STEPFORGE_EXPECT_CUDA_BUILD", "") == "1"
CUDA_BUILT = _backend._load("_cuda")[0] is not None


@pytest.mark.skipif(
    not (CUDA_BUILT or EXPECT_BUILD),
    reason="stepforge-fused was built without its CUDA module (build_cuda runs this)",
)
@pytest.mark.parametrize("arch", ARCHS)
def test_adam_kernel_fits_four_blocks_per_sm(arch):
    assert NVCC is not None, "no nvcc (CUDACXX, PATH or /usr/local/cuda*/bin) beside a CUDA build"
    kernels = _ptxas_report(NVCC, CUDA_SOURCES / "cuda" / "adam.cu", arch)
    adam = {k: v for k, v in kernels.items() if "adam_kernel" in k}
    # 3 param dtypes x 3 grad dtypes
    assert len(adam) == 9, sorted(kernels)
    for kernel, (registers, spill) in adam.items():
        assert registers <= MAX_REGISTERS, f"{kernel} on sm_{arch}: {registers} registers"
        assert spill <= MAX_SPILL_BYTES, f"{kernel} on sm_{arch}: {spill} bytes of spill stores"
