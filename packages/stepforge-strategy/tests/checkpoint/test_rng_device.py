# SPDX-License-Identifier: Apache-2.0
"""The saved random states restore when the checkpoint was read onto a device.

``Strategy.resume`` reads the per-rank objects with ``map_location`` = the plugin's device, so on a GPU the
numpy generator's key tensor arrives as a CUDA tensor, and ``Tensor.numpy()`` refuses device tensors. Without a
GPU the same situation is built from a tensor subclass that refuses ``numpy()`` the way a CUDA tensor does
and becomes a plain CPU tensor on ``cpu()``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stepforge.strategy.checkpoint._strategy_ckpt import get_rng_state, set_rng_state


class _DeviceResident(torch.Tensor):
    """A tensor that behaves like one on an accelerator for ``numpy()`` and ``cpu()``."""

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy it first."
        )

    def cpu(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).clone()


def test_numpy_state_restores_from_a_device_resident_key_tensor() -> None:
    np.random.seed(123)
    saved = get_rng_state()
    expected = np.random.random(5)  # what the generator draws after the saved point
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    saved["numpy"] = (kind, keys.as_subclass(_DeviceResident), pos, has_gauss, cached)
    np.random.seed(999)  # move away from the saved state
    assert not np.array_equal(np.random.random(5), expected)
    set_rng_state(saved)
    np.testing.assert_array_equal(np.random.random(5), expected)
