# SPDX-License-Identifier: Apache-2.0
"""The shape every package's ``CHANGELOG.md`` keeps: Keep a Changelog (https://keepachangelog.com/en/1.1.0/).

::

    # Changelog: stepforge-<x>

    ## Unreleased

    ### Added

    - one line (bullet) per change, continued on lines indented by two spaces

    ### Fixed

    - ...

    ## 0.1.0 - 2026-12-01

- the title names the distribution; the first section is the one ``## Unreleased``, every later one a release
  ``## <version> - <YYYY-MM-DD>`` (the version may be in brackets);
- inside a section only the kinds of change ``### Added``, ``### Changed``, ``### Deprecated``, ``### Removed``,
  ``### Fixed``, ``### Security``, each at most once and in that order, each holding at least one bullet, and
  nothing outside them;
- no issue numbers: the entries say what changed for a user of the package, not which ticket asked for it.
"""

from __future__ import annotations

import re

__all__ = ["KINDS", "changelog_problems"]

#: the kinds of change, in the order a section lists them
KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")

_RELEASE = re.compile(r"^## \[?\d+\.\d+\.\d+(?:[.-]?[a-z]+\d*)?\]? - \d{4}-\d{2}-\d{2}$")
_ISSUE = re.compile(r"\bissues? #?\d+|\bdefect \d+", re.IGNORECASE)


def changelog_problems(text: str, distribution: str) -> list[str]:
    """What keeps ``text`` (a ``CHANGELOG.md``) from the shape above; an empty list when it has that shape."""
    lines = text.splitlines()
    problems = []
    if not lines or lines[0] != f"# Changelog: {distribution}":
        problems.append(f"line 1 must be '# Changelog: {distribution}'")
    releases = 0
    kinds: list[str] = []  # the kinds seen in the current release section
    bullets = 0  # bullets under the current kind
    kind_line = 0

    def close_kind() -> None:
        if kinds and bullets == 0:
            problems.append(f"line {kind_line}: '### {kinds[-1]}' holds no entry")

    for number, line in enumerate(lines[1:], start=2):
        cited = _ISSUE.search(line)
        if cited:
            problems.append(f"line {number}: cites an issue ({cited.group(0)!r}); say what changed")
        if line.startswith("## "):
            close_kind()
            kinds, bullets = [], 0
            releases += 1
            if releases == 1 and line != "## Unreleased":
                problems.append(f"line {number}: the first section must be '## Unreleased', got {line!r}")
            elif releases > 1 and not _RELEASE.match(line):
                problems.append(f"line {number}: {line!r} is neither the first '## Unreleased' nor a release "
                                "'## <version> - <YYYY-MM-DD>'")  # fmt: skip
        elif line.startswith("### "):
            close_kind()
            kind, bullets, kind_line = line[4:], 0, number
            if releases == 0:
                problems.append(f"line {number}: {line!r} comes before '## Unreleased'")
            elif kind not in KINDS:
                problems.append(f"line {number}: {line!r} is not a kind of change ({', '.join(KINDS)})")
            elif kind in kinds:
                problems.append(f"line {number}: a second '### {kind}' in the same section")
            elif kinds and kinds[-1] in KINDS and KINDS.index(kind) < KINDS.index(kinds[-1]):
                problems.append(f"line {number}: '### {kind}' must come before '### {kinds[-1]}'")
            kinds.append(kind)
        elif line.startswith("#"):
            problems.append(f"line {number}: {line!r}: only '## ' sections and '### ' kinds of change")
        elif line.strip():
            if not kinds:
                problems.append(f"line {number}: text outside a '### <kind>' heading: {line[:60]!r}")
            elif line.startswith("- "):
                bullets += 1
            elif not line.startswith("  ") or bullets == 0:
                problems.append(
                    f"line {number}: an entry is a '- ' bullet continued by lines indented by two spaces"
                )
    close_kind()
    if releases == 0:
        problems.append("no '## Unreleased' section")
    return problems
