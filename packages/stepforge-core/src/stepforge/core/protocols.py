# SPDX-License-Identifier: Apache-2.0
"""Structural interfaces the stepforge packages talk through.

They are ``typing.Protocol`` classes, checkable at run time with ``isinstance``: a class satisfies one by having
the methods, without importing stepforge. ``torch.nn.parallel.DistributedDataParallel`` is a
:class:`NoSyncModel` as it is; an FSDP2 module is a :class:`GradientSyncSwitch`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "NoSyncModel",
    "GradientSyncSwitch",
    "ShardedOptimizer",
    "GradientHandler",
    "Plugin",
]


@runtime_checkable
class NoSyncModel(Protocol):
    """A model whose gradient synchronisation can be skipped for a block (DDP style).

    Gradients produced by forward *and* backward inside ``with model.no_sync():`` stay local; the first
    backward outside the block synchronises everything accumulated so far.
    """

    def no_sync(self) -> AbstractContextManager[Any]: ...


@runtime_checkable
class GradientSyncSwitch(Protocol):
    """A model or optimizer whose gradient synchronisation is a flag (FSDP2 ``fully_shard`` style)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None: ...


@runtime_checkable
class ShardedOptimizer(Protocol):
    """An optimizer whose state is split across data-parallel ranks (ZeRO-1/2, FSDP).

    Beyond the ``torch.optim.Optimizer`` surface:

    - ``state_dict()`` returns the *full*, world-size-independent state in ``torch.optim`` layout (keyed by
      the global parameter index), so it loads at any world size and into an unsharded optimizer.
      It is collective: every rank must call it.
    - ``no_sync()`` keeps gradients local (no reduce-scatter from backward hooks) during accumulation.
    - ``clip_grad_norm_`` clips by the norm over all shards and returns that global norm.
    """

    param_groups: list[dict[str, Any]]

    def step(self, closure: Callable[[], float] | None = None) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None: ...

    def no_sync(self) -> AbstractContextManager[Any]: ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...


@runtime_checkable
class GradientHandler(Protocol):
    """Something that finishes gradients after backward and before the step (ColossalAI's
    ``BaseGradientHandler``: all-reduce for data parallelism, sequence-parallel sums, ...)."""

    def handle_gradient(self) -> None: ...


@runtime_checkable
class Plugin(Protocol):
    """A parallelism back-end for :class:`stepforge.strategy.Strategy` (``ddp``, ``fsdp``, ``zero2``, ...).

    ``prepare`` wraps the model and optimizer; the state-dict pair follows
    ``torch.distributed.checkpoint.state_dict.get_state_dict``/``set_state_dict`` so that checkpoints go
    through DCP with any plugin.
    """

    name: str

    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]: ...

    def supports_no_sync(self) -> bool: ...

    def no_sync(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> AbstractContextManager[Any]: ...

    def get_state_dict(
        self, model: torch.nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]
    ) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def set_state_dict(
        self,
        model: torch.nn.Module,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
        model_state_dict: Mapping[str, Any],
        optim_state_dict: Mapping[str, Any],
    ) -> None: ...
