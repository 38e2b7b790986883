# SPDX-License-Identifier: Apache-2.0
"""stepforge.strategy.checkpoint._fsdp_window: FSDP2's pending unsharded gradients, saved and restored.

The round trip on a real FSDP2 model inside an accumulation window is covered by strategy/test_resume_distributed.py
(resume mid-window) and, for the torch internals it goes through, by stepforge-core's torch_compat/test_wrappers.py.
"""

from __future__ import annotations

import pytest
import torch

from stepforge.strategy.checkpoint._fsdp_window import fsdp_pending_grads, set_fsdp_pending_grads


def test_fsdp_pending_grads_without_fsdp_and_a_mismatched_checkpoint():
    model = torch.nn.Linear(2, 2)  # no FSDP2 module: nothing pending, and nothing to restore into
    assert fsdp_pending_grads(model) == []
    set_fsdp_pending_grads(model, [])
    with pytest.raises(ValueError, match="window boundary"):
        set_fsdp_pending_grads(model, [torch.zeros(2, 2)])
