# SPDX-License-Identifier: Apache-2.0
"""ColossalAI's plugin base classes, ``Plugin`` and ``DPPluginBase``, on stepforge's contract: a ColossalAI
plugin subclass (implementing ``configure``, ``no_sync``, ``supported_precisions``...) works with
:class:`~stepforge.strategy.Booster` once its import points here. ``name`` defaults to the class name and
``prepare`` to ``configure``; ``configure`` receives the optimizer already wrapped when the Booster's mixed
precision applies (it wraps first), so check ``isinstance(optimizer, OptimizerWrapper)`` as ColossalAI's own
plugins do."""

from __future__ import annotations

from abc import abstractmethod
from contextlib import AbstractContextManager
from typing import Any

import torch.distributed as dist
from torch import nn

from stepforge.core import BoostedOptimizer
from stepforge.core import Plugin as CorePlugin

from .._env import is_distributed

__all__ = ["Plugin", "DPPluginBase"]


class Plugin(CorePlugin):
    """ColossalAI's ``Plugin``: implement its abstract methods; ``name`` and ``prepare`` come from them."""

    @property
    def name(self) -> str:
        """The class name (ColossalAI's plugins have no registry name)."""
        return type(self).__name__

    @property
    def precision(self) -> str | None:
        """The precision the plugin applies (``None`` unless :meth:`control_precision`); assignable in
        ``__init__`` as in ColossalAI's plugins (an assigned one is explicit)."""
        return self._precision if self.control_precision() else None

    @precision.setter
    def precision(self, value: str | None) -> None:
        self._precision = value
        self._explicit_precision = value is not None

    def prepare(
        self, model: nn.Module, optimizer: Any = None, **kwargs: Any
    ) -> tuple[nn.Module, BoostedOptimizer | None]:
        """:meth:`configure`'s model and optimizer."""
        model, boosted, *_ = self.configure(
            model, optimizer, kwargs.get("criterion"), kwargs.get("dataloader"), kwargs.get("lr_scheduler")
        )
        return model, boosted

    def supports_no_sync(self) -> bool:
        """:meth:`support_no_sync`, ColossalAI's spelling, which a subclass implements."""
        return bool(self.support_no_sync())

    # -- ColossalAI's abstract methods (documented on stepforge.core.Plugin, which has them all) ---------------
    @abstractmethod
    def configure(self, model: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, ...]: ...
    @abstractmethod
    def control_checkpoint_io(self) -> bool: ...
    @abstractmethod
    def get_checkpoint_io(self) -> Any: ...
    @abstractmethod
    def no_sync(self, model: nn.Module | None, optimizer: Any = None) -> AbstractContextManager[Any]: ...
    @abstractmethod
    def supported_devices(self) -> list[str]: ...
    @abstractmethod
    def supported_precisions(self) -> list[str]: ...
    @abstractmethod
    def control_precision(self) -> bool: ...
    @abstractmethod
    def control_device(self) -> bool: ...
    @abstractmethod
    def support_no_sync(self) -> bool: ...


class DPPluginBase(Plugin):
    """ColossalAI's ``DPPluginBase``: :class:`Plugin` with the process group's ``rank`` and ``world_size``, which
    ``prepare_dataloader`` reads; ``RuntimeError`` without a process group."""

    #: the default group's rank and size, set by ``__init__`` (plain attributes, as in ColossalAI)
    rank: int = 0
    world_size: int = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not is_distributed():
            raise RuntimeError(
                f"{type(self).__name__}: torch.distributed is not initialised; call "
                "stepforge.strategy.launch_from_torch() (under torchrun) or torch.distributed.init_process_group "
                "before creating the plugin."
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
