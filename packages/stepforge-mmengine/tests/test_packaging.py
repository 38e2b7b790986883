# SPDX-License-Identifier: Apache-2.0
"""The installed distribution is well formed: version, namespace, core range, typed."""

from __future__ import annotations

from importlib.metadata import distribution

from stepforge.testing.packaging import check_distribution


def test_distribution_is_well_formed():
    assert check_distribution("stepforge-mmengine") == {}  # no stepforge entry points: it fills mmengine's
    files = [str(f) for f in distribution("stepforge-mmengine").files or []]
    assert "stepforge/mmengine/py.typed" in files
    requires = distribution("stepforge-mmengine").requires or []
    assert any(r.replace(" ", "").startswith("mmengine>=") for r in requires)
