# SPDX-License-Identifier: Apache-2.0
"""The ``gpu`` tests of stepforge-optim skip with a reason without a device and fail under
``STEPFORGE_REQUIRE_CUDA=1`` (the ``tests_gpu`` nox session)."""

from __future__ import annotations

from stepforge.testing.gpu import pytest_collection_modifyitems, pytest_runtest_makereport  # noqa: F401
