# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the stepforge-fused CPU tests: every ISA path this machine supports, one at a time."""

from __future__ import annotations

import pytest
import torch

from stepforge.fused import _backend

# Every kernel path stepforge-fused can have; the ones this build or CPU lacks show up in the skip summary.
KNOWN_ISAS = ("scalar", "avx2", "avx512")


@pytest.fixture(params=KNOWN_ISAS)
def isa(request: pytest.FixtureRequest):
    """Run the test on one CPU kernel path (switched at call time; CPython caches the extension module).

    A path this CPU cannot run (e.g. avx512 on an AVX2-only machine) or this build does not contain (non-x86)
    is skipped with the reason, so `pytest -ra` says which cases did not run instead of silently running fewer.
    """
    info = _backend.cpu_features()
    name = request.param
    if name not in info["compiled"]:
        pytest.skip(
            f"ISA path {name!r} is not compiled into this build (compiled: {', '.join(info['compiled'])})"
        )
    if name not in info["supported"]:
        pytest.skip(
            f"this CPU cannot run the {name!r} kernel path (supported: {', '.join(info['supported'])}); "
            "its cases did not run here"
        )
    before = _backend.cpu_module().get_isa()
    _backend.set_cpu_isa(name)
    yield name
    _backend.set_cpu_isa(before)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)
