# SPDX-License-Identifier: Apache-2.0
"""``PluginBase``: the shared implementation of :class:`~stepforge.core.Plugin` every stepforge plugin subclasses.

A subclass sets ``name``, implements ``prepare`` and overrides what differs: a plugin that applies precision
itself overrides ``supported_precisions`` and ``control_precision`` and passes ``precision``/``default_precision``
to ``__init__``; a plugin without ``no_sync`` overrides ``supports_no_sync``; a plugin that reduces gradients into
its own buffers overrides ``mid_window_save_error``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import HyperParameterError
from .plugin import Optimizers, Plugin
from .precision import MIXED_PRECISIONS, get_precision
from .protocols import BoostedOptimizer
from .sync import no_sync as core_no_sync

__all__ = ["PluginBase", "default_device", "unwrap_optimizer", "optimizer_list"]


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` (modulo the GPU count) under a process group, the current CUDA device on one
    process, else CPU."""
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        if dist.is_available() and dist.is_initialized():
            index = int(os.environ.get("LOCAL_RANK", index)) % torch.cuda.device_count()
        return torch.device("cuda", index)
    return torch.device("cpu")


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under a :class:`~stepforge.core.BoostedOptimizer` (``optimizer.unwrap()``);
    anything else is returned as it is."""
    return optimizer.unwrap() if isinstance(optimizer, BoostedOptimizer) else optimizer


@contextmanager
def _never_stepped(optimizers: list[Any]) -> Iterator[None]:
    """Keep torch's ``get_state_dict``/``set_state_dict`` from stepping a never-stepped optimizer.

    Both give an optimizer without state its state by a zero-lr ``step()`` on zero gradients (``_init_optim_state``)
    unless some parameter has a gradient. That step is not neutral: Adam's step count becomes 1 before any real
    step, so saving before the first step (or loading into a fresh optimizer) changed the training. A placeholder
    zero gradient on the smallest parameter of each such optimizer, removed afterwards, keeps it unstepped: its
    state dict then holds no state, as it truly has none (a load fills the template from the checkpoint).
    """
    placed = []
    for opt in optimizers:
        params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]
        if opt.state or not params or any(p.grad is not None for p in params):
            continue
        smallest = min(params, key=lambda p: p.numel())
        smallest.grad = torch.zeros_like(smallest)
        placed.append(smallest)
    try:
        yield
    finally:
        for p in placed:
            p.grad = None


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


class PluginBase(Plugin):
    """Shared members of every plugin: process-group facts, device, precision adoption, ``no_sync`` through
    :func:`stepforge.core.no_sync`, ``prepare_dataloader``, global-norm clipping and the DCP state-dict pair.

    Args:
        device: where the model lives (default: :func:`default_device`).
        precision: the precision the user chose (only for plugins with :meth:`control_precision`).
        default_precision: the precision used when ``precision`` is ``None``; the Booster may replace it.

    Raises:
        HyperParameterError: a precision not in :meth:`supported_precisions`, or a precision given to a plugin
            that does not control precision.
    """

    #: global-norm clipping inside ``optimizer.step()`` (0: off); plugins that take ``max_norm`` set it
    max_norm: float = 0.0
    #: whether ``prepare`` builds a ``build_optimizer`` config dict itself (on the prepared parameters)
    builds_optimizer_config: bool = False

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        precision: str | None = None,
        default_precision: str | None = None,
    ) -> None:
        self._device = torch.device(device) if device is not None else default_device()
        chosen = precision if precision is not None else default_precision
        if chosen is not None:
            if not self.control_precision():
                raise HyperParameterError(
                    f"{type(self).__name__}: precision={chosen!r} is given but the plugin does not apply "
                    "precision itself; pass mixed_precision to the Booster instead."
                )
            chosen = self._check_precision(chosen)
        self._precision = chosen
        self._explicit_precision = precision is not None

    # -- identity and placement ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def supported_devices(self) -> list[str]:
        return ["cpu", "cuda"]

    def control_device(self) -> bool:
        return True

    def bind_device(self) -> None:
        """Make the plugin's CUDA device current (NCCL collectives run on the current device)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # -- precision -----------------------------------------------------------------------------------------
    def supported_precisions(self) -> list[str]:
        """Without :meth:`control_precision`: fp32 and every precision the Booster's mixed precision offers
        (:data:`stepforge.core.precision.MIXED_PRECISIONS`)."""
        return ["fp32", *MIXED_PRECISIONS]

    def control_precision(self) -> bool:
        return False

    @property
    def precision(self) -> str | None:
        return self._precision if self.control_precision() else None

    @property
    def explicit_precision(self) -> bool:
        return self._explicit_precision

    def set_precision(self, precision: str) -> None:
        """Adopt ``precision`` in place of the default one (the Booster passes its ``mixed_precision``).

        Raises:
            HyperParameterError: the plugin does not control precision, ``precision`` is not supported, or a
                different precision was set explicitly.
        """
        if not self.control_precision():
            raise HyperParameterError(
                f"{type(self).__name__} does not apply precision itself; the Booster's mixed precision applies."
            )
        precision = self._check_precision(precision)
        if self._explicit_precision and precision != self._precision:
            raise HyperParameterError(
                f"{type(self).__name__}: precision={self._precision!r} was set explicitly; it conflicts with "
                f"{precision!r}. Set one of them, or the same value on both."
            )
        self._precision = precision

    def _check_precision(self, precision: Any) -> str:
        """The canonical name of ``precision`` (any spelling :func:`stepforge.core.precision.get_precision`
        knows, a torch dtype too) when it is one of :meth:`supported_precisions`."""
        supported = self.supported_precisions()
        canonical: Any = precision
        if isinstance(precision, str | torch.dtype) and precision not in supported:
            try:
                canonical = get_precision(precision).name
            except HyperParameterError:
                canonical = precision
        if canonical not in supported:
            raise HyperParameterError(
                f"{type(self).__name__}: precision must be one of {', '.join(map(repr, supported))}, got "
                f"{precision!r}."
            )
        return str(canonical)

    # -- preparing -----------------------------------------------------------------------------------------
    def configure(
        self,
        model: nn.Module,
        optimizer: Any = None,
        criterion: Any = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[nn.Module, BoostedOptimizer | None, Any, Any, Any]:
        """:meth:`prepare`, returning the five in ColossalAI's order (criterion, dataloader and scheduler as
        given)."""
        model, optimizer = self.prepare(
            model, optimizer, criterion=criterion, dataloader=dataloader, lr_scheduler=lr_scheduler
        )
        return model, optimizer, criterion, dataloader, lr_scheduler

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
        """A ``DataLoader`` over this rank's ``DistributedSampler`` share of ``dataset`` (the order depends only
        on ``seed`` and the epoch); ``kwargs`` go to ``DataLoader``."""
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        sampler_cls = distributed_sampler_cls or DistributedSampler
        sampler: Any = sampler_cls(
            dataset,
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            pin_memory=pin_memory and torch.cuda.is_available(),
            num_workers=num_workers,
            **kwargs,
        )

    # -- gradient synchronisation and clipping ---------------------------------------------------------------
    def supports_no_sync(self) -> bool:
        return True

    def support_no_sync(self) -> bool:
        return self.supports_no_sync()

    def no_sync(self, model: nn.Module | None, optimizer: Any = None) -> AbstractContextManager[Any]:
        """:func:`stepforge.core.no_sync` over ``model`` and ``optimizer`` (a DDP model, FSDP2 modules, a
        ZeRO optimizer...)."""
        if not self.supports_no_sync():
            raise RuntimeError(f"plugin {self.name!r} does not support no_sync.")
        return core_no_sync(model, optimizer)

    def clip_grad_norm_(
        self, model: nn.Module | None, optimizer: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over ``optimizer``'s parameters with gradients; DTensor gradients
        (FSDP2) give a norm reduced over the mesh, returned as a plain tensor."""
        from torch.distributed.tensor import DTensor

        params = [
            p for g in unwrap_optimizer(optimizer).param_groups for p in g["params"] if p.grad is not None
        ]
        if not params:
            return torch.zeros(())
        norm = nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # -- checkpoints -------------------------------------------------------------------------------------------
    def control_checkpoint_io(self) -> bool:
        return True

    def get_state_dict(
        self, model: nn.Module, optimizers: Optimizers
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``torch.distributed.checkpoint.state_dict.get_state_dict`` of ``model`` and the torch optimizers
        (keys by parameter FQN; sharded parameters stay DTensors)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        opts = optimizer_list(optimizers)
        with _never_stepped(opts):  # a never-stepped optimizer saves no state, and stays unstepped
            return get_state_dict(model, opts)

    def set_state_dict(
        self,
        model: nn.Module,
        optimizers: Optimizers,
        model_state_dict: Mapping[str, Any],
        optim_state_dict: Mapping[str, Any],
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        opts = optimizer_list(optimizers)
        with _never_stepped(opts):  # the loaded state replaces the optimizer's; no zero-lr step first
            set_state_dict(
                model,
                opts,
                model_state_dict=dict(model_state_dict),
                optim_state_dict=dict(optim_state_dict),
            )

    def mid_window_save_error(self, optimizer: Any) -> str | None:
        """``None``: a plugin built on this base keeps an accumulation window's gradients in ``param.grad``
        (and FSDP2's pending gradients) until the step."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r})"
