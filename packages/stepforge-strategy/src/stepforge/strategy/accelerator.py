# SPDX-License-Identifier: Apache-2.0
"""``Accelerator``: ColossalAI's device object for a Booster whose plugin does not place the model itself
(``plugin.control_device()`` is ``False``); the Booster moves the model to ``device`` in ``boost``."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Accelerator"]

#: device types an Accelerator takes (ColossalAI's ``cpu``/``cuda``)
SUPPORTED_DEVICES = ("cpu", "cuda")


class Accelerator:
    """The training device.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Raises:
        ValueError: another device type.
    """

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        if self.device.type not in SUPPORTED_DEVICES:
            raise ValueError(
                f"Accelerator: device {str(device)!r} is not supported; use one of {', '.join(SUPPORTED_DEVICES)}."
            )

    def bind(self) -> None:
        """Make the device current for this process (CUDA; nothing to do on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def configure_model(self, model: nn.Module) -> nn.Module:
        """``model.to(device)``."""
        return model.to(self.device)

    def __repr__(self) -> str:
        return f"Accelerator({str(self.device)!r})"
