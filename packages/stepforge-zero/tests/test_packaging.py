# SPDX-License-Identifier: Apache-2.0
"""The installed distribution is well formed: version, namespace, core range, entry points."""

from __future__ import annotations

from stepforge.testing.packaging import check_distribution


def test_distribution_is_well_formed():
    declared = check_distribution("stepforge-zero")
    assert declared["stepforge.optimizers"] == ["ZeroRedundancyOptimizer"]
    assert sorted(declared["stepforge.plugins"]) == sorted(
        ["low_level_zero", "lowlevel-zero", "LowLevelZeroPlugin", "zero1", "zero2"]
    )
