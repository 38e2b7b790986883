# SPDX-License-Identifier: Apache-2.0
"""``single``: one process, no process group; the same Booster API as the distributed plugins."""

from __future__ import annotations

from typing import Any

from torch import nn

from stepforge.core import Plugin

from ..boosted_optimizer import OptimizerWrapper, as_boosted
from ..data import StatefulDataLoader

__all__ = ["SinglePlugin", "StatefulLoaderPlugin"]


class StatefulLoaderPlugin(Plugin):
    """The base of this package's plugins: core's ``prepare_dataloader`` returned as a
    :class:`~stepforge.strategy.StatefulDataLoader` (exact mid-epoch resume)."""

    def prepare_dataloader(
        self, dataset: Any, batch_size: int, *args: Any, **kwargs: Any
    ) -> StatefulDataLoader:
        return StatefulDataLoader(super().prepare_dataloader(dataset, batch_size, *args, **kwargs))


class SinglePlugin(StatefulLoaderPlugin):
    """Run on one process: the model is moved to ``device`` (default: the current CUDA device, else CPU) and
    nothing is wrapped; ``no_sync`` (core's) suspends nothing, so accumulation code written for DDP runs unchanged."""

    name = "single"

    def prepare(
        self, model: nn.Module, optimizer: Any = None, **kwargs: Any
    ) -> tuple[nn.Module, OptimizerWrapper | None]:
        """Move ``model`` to the plugin's device; the optimizer comes back boosted (an :class:`OptimizerWrapper`
        unless the Booster's mixed precision wrapped it already)."""
        model.to(self.device)
        return model, as_boosted(optimizer)

    def support_lora(self) -> bool:
        """LoRA through peft is supported (as ColossalAI's plugin)."""
        return True
