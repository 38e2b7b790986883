# SPDX-License-Identifier: Apache-2.0
"""GPU tests of stepforge-fused: every test here needs a CUDA device except those in test_cuda_build.py.

The hooks come from stepforge.testing.gpu: without a device the ``gpu`` tests skip with the reason, and under
``STEPFORGE_REQUIRE_CUDA=1`` (the ``tests_gpu`` nox session) such a skip is a failure.
"""

from __future__ import annotations

import pytest
import torch

from stepforge.testing.gpu import pytest_collection_modifyitems, pytest_runtest_makereport  # noqa: F401


@pytest.fixture(scope="session")
def cuda_mod():
    """The ``_cuda`` extension, after checking it is built and can run (skip/fail with the reason otherwise)."""
    from stepforge.fused import _backend

    if not _backend.cuda_available():
        pytest.skip(f"CUDA kernels unavailable: {_backend.cuda_status()}")
    return _backend.cuda_module()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
