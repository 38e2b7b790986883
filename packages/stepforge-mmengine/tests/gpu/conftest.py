# SPDX-License-Identifier: Apache-2.0
"""GPU tests of stepforge-mmengine: every test here needs a CUDA device (1 NCCL rank in a spawned process).

The hooks come from stepforge.testing.gpu: without a device the ``gpu`` tests skip with the reason, and under
``STEPFORGE_REQUIRE_CUDA=1`` (``nox -s tests_gpu``, ``tools/gpu/run_all.sh``) such a skip is a failure. The run
helpers of the CPU tests (``../_runs.py``: the example config, the crash and counting hooks) are shared: their
folder goes on ``sys.path`` here, and the spawned rank inherits it.
"""

from __future__ import annotations

import os
import sys

from stepforge.testing.gpu import pytest_collection_modifyitems, pytest_runtest_makereport  # noqa: F401

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
