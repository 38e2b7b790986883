# SPDX-License-Identifier: Apache-2.0
"""GPU tests of stepforge-zero: every test here needs a CUDA device (1 NCCL rank in a spawned process).

The hooks come from stepforge.testing.gpu: without a device the ``gpu`` tests skip with the reason, and under
``STEPFORGE_REQUIRE_CUDA=1`` (``nox -s tests_gpu``, ``tools/gpu/run_all.sh``) such a skip is a failure.
"""

from __future__ import annotations

from stepforge.testing.gpu import pytest_collection_modifyitems, pytest_runtest_makereport  # noqa: F401
