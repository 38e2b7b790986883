# SPDX-License-Identifier: Apache-2.0
"""Every package's CHANGELOG.md keeps the Keep-a-Changelog shape: one '## Unreleased' section first, entries
grouped under the kinds of change (Added, Changed, Deprecated, Removed, Fixed, Security), no issue numbers.
First the checker on made-up changelogs (it must find what it claims to), then the repository's."""

from __future__ import annotations

import os
import pathlib

import pytest

from stepforge.testing.changelogs import changelog_problems

ROOT = pathlib.Path(os.environ.get("STEPFORGE_SOURCE_ROOT") or pathlib.Path(__file__).resolve().parents[4])

GOOD = """# Changelog: stepforge-demo

## Unreleased

### Added

- `Thing(x)`: a new thing,
  with a second line.

### Fixed

- `Thing.step` no longer skips the last window.

## 0.1.0 - 2026-12-01

### Added

- Package created.
"""


def test_a_changelog_in_shape_passes():
    assert changelog_problems(GOOD, "stepforge-demo") == []


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (("# Changelog: stepforge-demo", "# Changelog"), "line 1 must be '# Changelog: stepforge-demo'"),
        (
            ("### Added\n\n- `Thing(x)`", "### Added (new API)\n\n- `Thing(x)`"),
            "line 5: '### Added (new API)' is not a kind",
        ),
        (("### Fixed\n", "### Tests\n"), "line 10: '### Tests' is not a kind"),
        (
            ("## Unreleased\n", "## Unreleased\n\n- loose line\n"),
            "line 5: text outside a '### <kind>' heading",
        ),
        (
            ("### Fixed\n\n- `Thing.step`", "### Added\n\n- `Thing.step`"),
            "line 10: a second '### Added' in the same section",
        ),
        (
            ("### Added\n\n- `Thing(x)`", "### Fixed\n\n- `Thing(x)`"),
            "line 10: a second '### Fixed' in the same section",
        ),
        (
            ("skips the last window.", "skips the last window (issue 18)."),
            "line 12: cites an issue ('issue 18')",
        ),
        (("## 0.1.0 - 2026-12-01", "## 0.1.0 (unreleased)"), "line 14: '## 0.1.0 (unreleased)' is neither"),
        (("## Unreleased\n", "## 0.2.0 - 2026-12-02\n"), "line 3: the first section must be '## Unreleased'"),
        (
            ("### Fixed\n\n- `Thing.step` no longer skips the last window.\n", "### Fixed\n\n"),
            "line 10: '### Fixed' holds no entry",
        ),
        (("  with a second line.", "with a second line."), "line 8: an entry is a '- ' bullet"),
        (("### Fixed\n", "#### Fixed\n"), "line 10: '#### Fixed': only '## ' sections"),
    ],
)
def test_the_checker_names_each_way_out_of_shape(edit, problem):
    old, new = edit
    assert GOOD.count(old) == 1, old
    problems = changelog_problems(GOOD.replace(old, new), "stepforge-demo")
    assert any(p.startswith(problem) for p in problems), problems


def test_kinds_out_of_order_are_named():
    text = GOOD.replace("### Added\n\n- `Thing(x)`", "### Removed\n\n- `Thing(x)`", 1).replace(
        "### Fixed\n\n- `Thing.step`", "### Changed\n\n- `Thing.step`"
    )
    assert changelog_problems(text, "stepforge-demo") == [
        "line 10: '### Changed' must come before '### Removed'"
    ]


CHANGELOGS = sorted((ROOT / "packages").glob("*/CHANGELOG.md"))


def test_every_package_has_a_changelog():
    packages = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))
    assert packages and [c.parent for c in CHANGELOGS] == packages


@pytest.mark.parametrize("changelog", CHANGELOGS, ids=[c.parent.name for c in CHANGELOGS])
def test_package_changelog_keeps_the_shape(changelog):
    assert changelog_problems(changelog.read_text(encoding="utf-8"), changelog.parent.name) == []
