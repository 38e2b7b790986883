# SPDX-License-Identifier: Apache-2.0
"""The installed distribution is well formed: version, namespace, core range, entry points."""

from __future__ import annotations

from stepforge.testing.packaging import check_distribution


def test_distribution_is_well_formed():
    declared = check_distribution("stepforge-strategy")
    assert sorted(declared["stepforge.plugins"]) == sorted(
        ["single", "torch_ddp", "ddp", "TorchDDPPlugin", "torch_fsdp", "fsdp", "TorchFSDPPlugin", "gemini",
         "GeminiPlugin"]
    )  # fmt: skip
    assert sorted(declared["stepforge.optim_wrappers"]) == ["AmpOptimWrapper", "ColossalAIOptimWrapper"]
