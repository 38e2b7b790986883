# SPDX-License-Identifier: Apache-2.0
"""Fixtures for stepforge-core: real fixture distributions installed into a temporary site directory."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def fixture_site(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Install sf-fixture-alpha and sf-fixture-beta with pip into a fresh directory (not yet on sys.path)."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(FIXTURES / "sf-fixture-alpha"),
            str(FIXTURES / "sf-fixture-beta"),
        ],
        check=True,
    )
    return site


@pytest.fixture
def installed_fixtures(fixture_site: pathlib.Path) -> Iterator[pathlib.Path]:
    """Put the fixture distributions on sys.path for one test, then take them off again."""
    sys.path.insert(0, str(fixture_site))
    try:
        yield fixture_site
    finally:
        sys.path.remove(str(fixture_site))
        for name in [m for m in sys.modules if m.startswith("sf_fixture_")]:
            del sys.modules[name]
