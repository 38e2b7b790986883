# SPDX-License-Identifier: Apache-2.0
"""Checks every stepforge distribution passes: metadata, namespace layout and loadable entry points."""

from __future__ import annotations

import importlib
from importlib.metadata import distribution

import stepforge

__all__ = ["check_distribution"]

ENTRY_POINT_GROUPS = ("stepforge.optimizers", "stepforge.plugins", "stepforge.optim_wrappers")


def check_distribution(dist_name: str) -> dict[str, list[str]]:
    """Assert that ``dist_name`` (e.g. ``"stepforge-zero"``) is installed and well formed.

    - its import package ``stepforge.<x>`` imports and its ``__version__`` equals the installed metadata;
    - ``stepforge`` is a PEP 420 namespace (no distribution ships ``stepforge/__init__.py``);
    - it depends on ``stepforge-core`` with a compatible range (core itself excepted);
    - every entry point it declares in a stepforge group loads.

    Returns:
        group -> names of the entry points the distribution declares.
    """
    dist = distribution(dist_name)
    module = importlib.import_module("stepforge." + dist_name.removeprefix("stepforge-"))
    assert module.__version__ == dist.version, (module.__version__, dist.version)
    assert getattr(stepforge, "__file__", None) is None, (
        f"stepforge must be a namespace, found {stepforge.__file__}"
    )
    shipped = [str(f) for f in dist.files or []]
    assert "stepforge/__init__.py" not in shipped, f"{dist_name} ships stepforge/__init__.py"
    if dist_name != "stepforge-core":
        core_reqs = [r for r in dist.requires or [] if r.replace(" ", "").startswith("stepforge-core")]
        assert core_reqs and "<" in core_reqs[0], f"{dist_name} must depend on stepforge-core with a range"
    declared: dict[str, list[str]] = {}
    for ep in dist.entry_points:
        if ep.group in ENTRY_POINT_GROUPS:
            ep.load()
            declared.setdefault(ep.group, []).append(ep.name)
    return declared
