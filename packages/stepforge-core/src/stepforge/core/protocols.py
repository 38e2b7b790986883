# SPDX-License-Identifier: Apache-2.0
"""Structural interfaces the stepforge packages talk through.

They are ``typing.Protocol`` classes, checkable at run time with ``isinstance``: a class satisfies one by having
the methods, without importing stepforge. ``torch.nn.parallel.DistributedDataParallel`` is a
:class:`NoSyncModel` as it is; an FSDP2 module is a :class:`GradientSyncSwitch`. The plugin contract is an
abstract base class instead (:mod:`stepforge.core.plugin`): a plugin declares itself by subclassing it.
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
    "BackwardOptimizer",
    "ClippingOptimizer",
    "GradScalingOptimizer",
    "BoostedOptimizer",
    "WrappedModel",
    "CachingOptimizer",
    "unwrap_optimizer",
    "optimizer_list",
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
    """An optimizer whose state is split across data-parallel ranks (ZeRO-1/2, FSDP). ``state_dict()`` (collective)
    returns the *full* state in ``torch.optim`` layout, which loads at any world size and into an unsharded
    optimizer; ``no_sync()`` keeps gradients local during accumulation; ``clip_grad_norm_`` clips by the norm over
    all shards and returns it."""

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
class BackwardOptimizer(Protocol):
    """An optimizer that runs the backward itself (ColossalAI's ``OptimizerWrapper``: an AMP wrapper scales the
    loss, a ZeRO optimizer reduces). Gradient accumulation calls these instead of ``loss.backward()``."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None: ...


@runtime_checkable
class ClippingOptimizer(Protocol):
    """An optimizer whose gradients only it can measure (loss-scaled, sharded): ``clip_grad_norm_`` unscales,
    clips by the norm over every rank and shard and returns that norm."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...


@runtime_checkable
class GradScalingOptimizer(Protocol):
    """An optimizer that keeps the gradients it steps with outside ``p.grad`` (ZeRO-2's reduced pieces):
    ``scale_grads_(factor)`` multiplies them (gradient accumulation's window weight)."""

    def scale_grads_(self, factor: float) -> None: ...


@runtime_checkable
class BoostedOptimizer(Protocol):
    """The optimizer every plugin's ``prepare`` returns (ColossalAI's ``OptimizerWrapper`` surface).

    ``backward(loss)`` is the only backward route (the Booster's ``backward(loss, optimizer)``): it applies the
    loss scale and the back-end's gradient reduction. ``unscale_()`` runs once per step (a no-op without
    scaling); ``clip_grad_norm_`` unscales first and returns the norm over every rank and shard; ``step`` skips
    an overflowed update; ``scaler_state_dict()`` (``None`` without a scaler) travels apart from the optimizer's.
    """

    param_groups: list[dict[str, Any]]

    def backward(self, loss: torch.Tensor) -> None: ...

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None: ...

    def unscale_(self) -> None: ...

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...

    def step(self, closure: Callable[[], float] | None = None) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None: ...

    def scaler_state_dict(self) -> dict[str, Any] | None: ...

    def load_scaler_state_dict(self, state: Mapping[str, Any] | None) -> None: ...

    def unwrap(self) -> torch.optim.Optimizer: ...


@runtime_checkable
class WrappedModel(Protocol):
    """A model wrapper with ``unwrap()`` returning the module inside (ColossalAI's ``ModelWrapper``,
    stepforge-zero's ``LowLevelZeroModel``)."""

    def unwrap(self) -> torch.nn.Module: ...


@runtime_checkable
class CachingOptimizer(Protocol):
    """An optimizer that caches views of its parameters (stepforge-fused's bucket cache): whoever replaces the
    parameters of its groups calls ``invalidate_cache()`` afterwards."""

    def invalidate_cache(self) -> None: ...


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under a :class:`BoostedOptimizer` (``optimizer.unwrap()``); anything else is returned
    as it is."""
    return optimizer.unwrap() if isinstance(optimizer, BoostedOptimizer) else optimizer


def optimizer_list(optimizers: Any) -> list[Any]:
    """``optimizers`` (one optimizer, an iterable of them, or ``None``) as a list of torch optimizers."""
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer | BoostedOptimizer):
        return [unwrap_optimizer(optimizers)]
    if isinstance(optimizers, Iterable):
        return [unwrap_optimizer(o) for o in optimizers]
    raise TypeError(
        f"optimizers must be an optimizer or an iterable of optimizers, got {type(optimizers).__name__}."
    )
