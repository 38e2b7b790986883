# SPDX-License-Identifier: Apache-2.0
"""The installed distribution is well formed: version, namespace, core range, typed."""

from __future__ import annotations

from importlib import resources
from importlib.metadata import distribution

from stepforge.testing.packaging import check_distribution


def test_distribution_is_well_formed():
    assert check_distribution("stepforge-mmengine") == {}  # no stepforge entry points: it fills mmengine's
    assert (resources.files("stepforge.mmengine") / "py.typed").is_file()
    requires = distribution("stepforge-mmengine").requires or []
    assert any(r.startswith("mmengine") and ">=0.10" in r and "<0.11" in r for r in requires), requires
