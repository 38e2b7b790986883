# SPDX-License-Identifier: Apache-2.0
"""GPU tests of stepforge-mmengine: every test here needs a CUDA device (1 NCCL rank in a spawned process).

The hooks come from stepforge.testing.gpu: without a device the ``gpu`` tests skip with the reason, and under
``STEPFORGE_REQUIRE_CUDA=1`` (``nox -s tests_gpu``, ``tools/gpu/run_all.sh``) such a skip is a failure. The run
helpers of the CPU tests (``../_runs.py``: the example config, the crash and counting hooks) are shared: the
package's ``tests/conftest.py`` puts their folder on ``sys.path``, and the spawned rank inherits it.
"""

from __future__ import annotations

from stepforge.testing.gpu import pytest_collection_modifyitems, pytest_runtest_makereport  # noqa: F401
