# SPDX-License-Identifier: Apache-2.0
"""Rules for the repository's own tests that a GPU-only test would otherwise break on the GPU machine alone."""

from __future__ import annotations

import os
import pathlib
import re

ROOT = pathlib.Path(os.environ.get("STEPFORGE_SOURCE_ROOT") or pathlib.Path(__file__).resolve().parents[4])


def test_no_test_asks_for_record_property() -> None:
    # With --junitxml (tools/gpu/run_all.sh writes one) pytest warns that record_property does not fit the xunit2
    # junit family, its default, and the suite's filterwarnings = error makes that a setup error: the first H200 run
    # lost its ulp test to it. record_testsuite_property works under xunit2.
    tests = sorted((ROOT / "packages").glob("*/tests/**/*.py"))
    assert tests, f"no test files under {ROOT / 'packages'}"
    asks = re.compile(r"def \w+\([^)]*\brecord_property\b", re.DOTALL)  # the fixture as a parameter
    offenders = [str(path.relative_to(ROOT)) for path in tests if asks.search(path.read_text())]
    assert offenders == []
