# SPDX-License-Identifier: Apache-2.0
"""What every plugin of this package shares: process-group facts, the DCP state-dict pair, clipping.

A plugin here implements :class:`stepforge.core.Plugin` plus the optional members of the plugin contract
(``precision``, ``clip_grad_norm_``, ``device``, ``world_size``, ``rank``). Subclasses provide
``prepare`` and, when they can, ``no_sync``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stepforge.core import no_sync as core_no_sync

__all__ = ["PluginBase", "inner_optimizer", "as_optimizer_list"]


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under the Booster's wrappers (``BoostedOptimizer.optim``)."""
    seen = 0
    while hasattr(optimizer, "_stepforge_inner") and seen < 8:
        optimizer = optimizer._stepforge_inner
        seen += 1
    return optimizer


def as_optimizer_list(optimizers: Any) -> list[Any]:
    if optimizers is None:
        return []
    if isinstance(optimizers, Iterable) and not hasattr(optimizers, "param_groups"):
        return [inner_optimizer(o) for o in optimizers]
    return [inner_optimizer(optimizers)]


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        if dist.is_available() and dist.is_initialized():
            import os

            index = int(os.environ.get("LOCAL_RANK", index)) % torch.cuda.device_count()
        return torch.device("cuda", index)
    return torch.device("cpu")


class PluginBase:
    """Shared members of the plugins of stepforge-strategy.

    Attributes:
        name: registry name of the plugin.
        precision: ``None`` when the Booster's mixed precision applies; otherwise the precision the plugin
            itself applies (``"fp32"``, ``"fp16"``, ``"bf16"``).
        max_norm: global-norm clipping applied inside ``optimizer.step`` (0 = off).
    """

    name = "base"
    precision: str | None = None
    max_norm: float = 0.0

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device) if device is not None else _default_device()

    def _bind_device(self) -> None:
        """Make the plugin's CUDA device current (NCCL collectives run on the current device)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # -- process group -------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    # -- no_sync -------------------------------------------------------------------------------------------
    def supports_no_sync(self) -> bool:
        """Whether :meth:`no_sync` can skip gradient synchronisation."""
        return True

    def support_no_sync(self) -> bool:  # ColossalAI's spelling
        return self.supports_no_sync()

    def no_sync(self, model: nn.Module, optimizer: Any = None) -> AbstractContextManager[Any]:
        """Skip gradient synchronisation of ``model`` (and a sharded ``optimizer``) for the block."""
        if not self.supports_no_sync():
            raise RuntimeError(f"plugin {self.name!r} does not support no_sync.")
        return core_no_sync(model, inner_optimizer(optimizer) if optimizer is not None else None)

    # -- data ----------------------------------------------------------------------------------------------
    def prepare_dataloader(
        self,
        dataset: Any,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 1024,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_workers: int = 0,
        distributed_sampler_cls: Any = None,
        **kwargs: Any,
    ) -> Any:
        """ColossalAI's ``prepare_dataloader``: a ``DataLoader`` over this rank's ``DistributedSampler`` share,
        returned as a :class:`~stepforge.strategy.StatefulDataLoader` (exact mid-epoch resume: the sampler's
        order depends only on ``seed`` and the epoch). ``kwargs`` go to ``DataLoader``."""
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        from ..data import StatefulDataLoader

        sampler_cls = distributed_sampler_cls or DistributedSampler
        sampler = sampler_cls(
            dataset,
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            pin_memory=pin_memory and torch.cuda.is_available(),
            num_workers=num_workers,
            **kwargs,
        )
        return StatefulDataLoader(loader)

    # -- clipping ------------------------------------------------------------------------------------------
    def clip_grad_norm_(
        self, model: nn.Module | None, optimizer: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the gradients of ``optimizer``'s parameters by their global norm; return that norm.

        DTensor gradients (FSDP2) are handled by ``torch.nn.utils.clip_grad_norm_``, which reduces the
        norm over the mesh.
        """
        params = [
            p for g in inner_optimizer(optimizer).param_groups for p in g["params"] if p.grad is not None
        ]
        if not params:
            return torch.zeros(())
        norm = nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm

    # -- the DCP state-dict pair ---------------------------------------------------------------------------
    def get_state_dict(self, model: nn.Module, optimizers: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Model and optimizer state dicts for ``torch.distributed.checkpoint`` (keys by parameter FQN)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        optims = as_optimizer_list(optimizers)
        return get_state_dict(model, optims)

    def set_state_dict(
        self,
        model: nn.Module,
        optimizers: Any,
        model_state_dict: Mapping[str, Any],
        optim_state_dict: Mapping[str, Any],
    ) -> None:
        """Apply a pair filled by ``dcp.load`` (as :meth:`get_state_dict` returned it)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        optims = as_optimizer_list(optimizers)
        set_state_dict(
            model,
            optims,
            model_state_dict=dict(model_state_dict),
            optim_state_dict=dict(optim_state_dict),
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r})"
