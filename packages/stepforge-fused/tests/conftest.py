# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the stepforge-fused CPU tests: every ISA path this machine supports, one at a time."""

from __future__ import annotations

import pytest
import torch

from stepforge.fused import _backend


def _supported() -> list[str]:
    return list(_backend.cpu_features()["supported"])


@pytest.fixture(params=_supported())
def isa(request: pytest.FixtureRequest):
    """Run the test on one CPU kernel path (switched at call time; CPython caches the extension module)."""
    before = _backend.cpu_module().get_isa()
    _backend.set_cpu_isa(request.param)
    yield request.param
    _backend.set_cpu_isa(before)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)
