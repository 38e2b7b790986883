# SPDX-License-Identifier: Apache-2.0
"""The build options as scikit-build-core reads them from pyproject.toml: ``STEPFORGE_CUDA`` picks the CUDA
module and ``STEPFORGE_CUDA_ARCHS`` its architectures, in every combination.

An override table used to replace ``cmake.define`` whole, so ``STEPFORGE_CUDA=ON`` silently dropped the chosen
architectures and built the default ``80;90`` (seen on the first H200 run, ``benchmarks/results/gpu-runs/gpu-2026-11-26-h200-runs.md``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from scikit_build_core.settings.skbuild_read_settings import SettingsReader

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.mark.parametrize(
    ("cuda", "archs", "expected"),
    [
        ("ON", "86", {"STEPFORGE_CUDA": "ON", "STEPFORGE_CUDA_ARCHS": "86"}),
        ("1", None, {"STEPFORGE_CUDA": "ON", "STEPFORGE_CUDA_ARCHS": "80;90"}),
        ("off", "90", {"STEPFORGE_CUDA": "OFF", "STEPFORGE_CUDA_ARCHS": "90"}),
        ("auto", "80;90a", {"STEPFORGE_CUDA": "AUTO", "STEPFORGE_CUDA_ARCHS": "80;90a"}),
        (None, "90", {"STEPFORGE_CUDA": "AUTO", "STEPFORGE_CUDA_ARCHS": "90"}),
        (None, None, {"STEPFORGE_CUDA": "AUTO", "STEPFORGE_CUDA_ARCHS": "80;90"}),
    ],
)
def test_cmake_defines_follow_the_environment(monkeypatch, cuda, archs, expected):
    for name, value in (("STEPFORGE_CUDA", cuda), ("STEPFORGE_CUDA_ARCHS", archs)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert SettingsReader.from_file(PYPROJECT, {}).settings.cmake.define == expected
