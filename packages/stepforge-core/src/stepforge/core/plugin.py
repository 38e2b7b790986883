# SPDX-License-Identifier: Apache-2.0
"""``Plugin``: the contract between the Booster and a parallelism back-end (``ddp``, ``fsdp``, ``zero2``, ...).

A new plugin is a class with ``name`` and ``prepare``; every other member has a working default here::

    class MyPlugin(Plugin):
        name = "my_plugin"

        def prepare(self, model, optimizer=None, **kwargs):
            model.to(self.device)
            return model, None if optimizer is None else OptimizerWrapper(optimizer)

The class holds every member the Booster and the Strategy call, so they never probe a plugin with ``getattr``.
ColossalAI's ``Plugin`` is the model; its spellings (``configure``, ``support_no_sync``, ``get_checkpoint_io``)
are concrete aliases in one block at the end.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ._optim_state import load_optimizer_state_dict, optimizer_state_dict
from .errors import HyperParameterError
from .precision import MIXED_PRECISIONS, get_precision
from .protocols import BoostedOptimizer, optimizer_list, unwrap_optimizer
from .sync import no_sync as core_no_sync

if TYPE_CHECKING:
    from .memory_plan import MemoryPlan

__all__ = ["Plugin", "Optimizers", "default_device"]

Optimizers = torch.optim.Optimizer | BoostedOptimizer | Iterable[torch.optim.Optimizer | BoostedOptimizer]


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` (modulo the GPU count) under a process group, the current CUDA device on one
    process, else CPU."""
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        if dist.is_available() and dist.is_initialized():
            index = int(os.environ.get("LOCAL_RANK", index)) % torch.cuda.device_count()
        return torch.device("cuda", index)
    return torch.device("cpu")


class Plugin(ABC):
    """A parallelism back-end for :class:`stepforge.strategy.Booster`: a class with ``name`` and ``prepare``.

    ``name`` is the registry name (a class attribute); ``prepare(model, optimizer, **kwargs)`` wraps the model
    and returns ``(model, optimizer)``, the optimizer as a :class:`~stepforge.core.BoostedOptimizer`. Override
    the rest only where the plugin differs: a plugin that applies precision itself overrides
    :meth:`control_precision` and :meth:`supported_precisions` and passes ``precision``/``default_precision`` to
    ``__init__``; one without ``no_sync`` overrides :meth:`supports_no_sync`; one that reduces gradients into
    buffers of its own overrides :meth:`mid_window_save_refusal`; one whose optimizer keeps fp32 masters overrides
    :meth:`after_model_load`. A subclass without ``name`` or ``prepare`` cannot be instantiated (the
    ``TypeError`` names the member).

    ``device`` defaults to :func:`default_device`; ``precision`` (the user's choice) and ``default_precision``
    (used when ``precision`` is ``None``; the Booster may replace it) only for plugins with
    :meth:`control_precision`, else a :class:`HyperParameterError`, as for one not in
    :meth:`supported_precisions`.
    """

    #: global-norm clipping inside ``optimizer.step()`` (0: off); plugins that take ``max_norm`` set it
    max_norm: float = 0.0
    #: whether ``prepare`` builds a ``build_optimizer`` config dict itself (on the prepared parameters)
    builds_optimizer_config: bool = False
    #: whether ``prepare`` takes a model whose tensors are on the meta device and materialises only what this rank
    #: keeps (FSDP2's shards); otherwise the Booster materialises the whole model on the plugin's device first
    materializes_meta_model: bool = False
    # class-level defaults, so a subclass whose __init__ does not call this one still works
    _device: torch.device | None = None
    _precision: str | None = None
    _explicit_precision: bool = False

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

    # -- what a plugin must say ----------------------------------------------------------------------------
    @property
    @abstractmethod
    def name(self) -> str:
        """The registry name (``"torch_ddp"``, ``"low_level_zero"``...); a class attribute in practice."""

    @abstractmethod
    def prepare(
        self, model: nn.Module, optimizer: Any = None, **kwargs: Any
    ) -> tuple[nn.Module, BoostedOptimizer | None]:
        """Wrap ``model`` and ``optimizer`` (a torch optimizer over ``model``'s parameters, one already wrapped by
        the Booster's mixed precision, ``None``, or with :attr:`builds_optimizer_config` a config dict) for the
        back-end; ``kwargs``: ``criterion``, ``dataloader``, ``lr_scheduler`` as the Booster passes them.
        Returns ``(model, optimizer)``, the optimizer a :class:`~stepforge.core.BoostedOptimizer` (or ``None``).
        """

    # -- identity and placement ----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where ``prepare`` puts the model (the Booster's autocast runs on this device type)."""
        return self._device if self._device is not None else default_device()

    @property
    def world_size(self) -> int:
        """Ranks in the default process group (1 without one)."""
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        """This process's rank in the default process group (0 without one)."""
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def supported_devices(self) -> list[str]:
        """Device types the plugin runs on."""
        return ["cpu", "cuda"]

    def control_device(self) -> bool:
        """Whether ``prepare`` moves the model to :attr:`device` itself (else the Booster's ``Accelerator``
        does, ColossalAI's meaning)."""
        return True

    def bind_device(self) -> None:
        """Make the plugin's CUDA device current (NCCL collectives run on the current device)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # -- precision -----------------------------------------------------------------------------------------
    def supported_precisions(self) -> list[str]:
        """Precision names the plugin takes. Without :meth:`control_precision`: fp32 and every precision the
        Booster's mixed precision offers (:data:`stepforge.core.precision.MIXED_PRECISIONS`)."""
        return ["fp32", *MIXED_PRECISIONS]

    def control_precision(self) -> bool:
        """Whether the plugin applies precision itself (then the Booster applies no mixed precision)."""
        return False

    @property
    def precision(self) -> str | None:
        """The precision the plugin applies; ``None`` when it does not control precision."""
        return self._precision if self.control_precision() else None

    @property
    def explicit_precision(self) -> bool:
        """Whether :attr:`precision` was chosen by the user (``False``: a default the Booster may replace)."""
        return self._explicit_precision

    def set_precision(self, precision: str) -> None:
        """Adopt ``precision`` (the Booster's ``mixed_precision``) in place of the default one.

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

    def _check_precision(self, precision: Any) -> str:  # its canonical name, when supported
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
        """A ``DataLoader`` over this rank's ``DistributedSampler`` share of ``dataset`` (ColossalAI's signature;
        the order depends only on ``seed`` and the epoch); ``kwargs`` go to ``DataLoader``."""
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
        """Whether :meth:`no_sync` can skip gradient synchronisation (for accumulation)."""
        return True

    def no_sync(self, model: nn.Module | None, optimizer: Any = None) -> AbstractContextManager[Any]:
        """Skip gradient synchronisation of ``model`` (``None`` as in ColossalAI's ``Booster.no_sync(None, opt)``)
        and a sharded ``optimizer`` for the block, through :func:`stepforge.core.no_sync`; a ``RuntimeError``
        where :meth:`supports_no_sync` is ``False``."""
        if not self.supports_no_sync():
            raise RuntimeError(f"plugin {self.name!r} does not support no_sync.")
        return core_no_sync(model, optimizer)

    def clip_grad_norm_(
        self, model: nn.Module | None, optimizer: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the gradients of ``optimizer``'s parameters by their global norm and return that norm (a plain
        0-dim tensor; DTensor gradients of FSDP2 give a norm reduced over the mesh)."""
        from torch.distributed.tensor import DTensor

        params = [
            p for g in unwrap_optimizer(optimizer).param_groups for p in g["params"] if p.grad is not None
        ]
        if not params:
            return torch.zeros(())
        norm = nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def support_lora(self) -> bool:
        """Whether ``Booster.enable_lora`` may add peft LoRA adapters to a model for this plugin (ColossalAI's
        member; ``False`` unless a plugin says otherwise: sharded parameters need peft's support)."""
        return False

    # -- checkpoints -------------------------------------------------------------------------------------------
    def control_checkpoint_io(self) -> bool:
        """Whether the plugin decides what a checkpoint holds (through :meth:`get_state_dict`)."""
        return True

    def get_state_dict(
        self, model: nn.Module, optimizers: Optimizers
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Model and optimizer state dicts for ``torch.distributed.checkpoint`` in the layout of torch's
        ``get_state_dict`` (keys by parameter FQN; sharded parameters stay DTensors); ``dcp.load`` fills them
        in place. A never-stepped optimizer is not stepped to make its state: its ``"state"`` is empty."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model), optimizer_state_dict(model, optimizer_list(optimizers))

    def set_state_dict(
        self,
        model: nn.Module,
        optimizers: Optimizers,
        model_state_dict: Mapping[str, Any],
        optim_state_dict: Mapping[str, Any],
    ) -> None:
        """Apply a pair :meth:`get_state_dict` returned, filled by ``dcp.load`` (nothing is stepped)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        optims = optimizer_list(optimizers)
        if optims:
            load_optimizer_state_dict(model, optims, optim_state_dict)
        set_model_state_dict(model, dict(model_state_dict))

    def after_model_load(self, model: nn.Module, optimizers: Iterable[Any]) -> None:  # noqa: B027 (a no-op default)
        """Called by ``Booster.load_model`` after new weights were loaded into the prepared ``model``, with the
        optimizers ``prepare`` returned with it: a plugin whose optimizer keeps fp32 masters refreshes them here
        (ColossalAI's ``update_master_params``), or the next ``step()`` writes the old weights back."""

    def mid_window_save_refusal(self, optimizer: Any) -> str | None:
        """Why a checkpoint taken inside a gradient-accumulation window must be refused (a plugin that reduces
        part of a window into buffers a checkpoint does not hold), or ``None``: the window's gradients are all
        in ``.grad`` (and FSDP2's pending unsharded gradients), so a checkpoint carries them."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r})"

    # -- ColossalAI's spellings ------------------------------------------------------------------------------
    def configure(
        self,
        model: nn.Module,
        optimizer: Any = None,
        criterion: Any = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[nn.Module, BoostedOptimizer | None, Any, Any, Any]:
        """ColossalAI's five-value form of :meth:`prepare`, which ``Booster.boost`` calls: the prepared model and
        optimizer, then criterion, dataloader and scheduler as given."""
        model, boosted = self.prepare(
            model, optimizer, criterion=criterion, dataloader=dataloader, lr_scheduler=lr_scheduler
        )
        return model, boosted, criterion, dataloader, lr_scheduler

    def support_no_sync(self) -> bool:
        """ColossalAI's spelling of :meth:`supports_no_sync`."""
        return self.supports_no_sync()

    def get_checkpoint_io(self) -> Any:
        """ColossalAI's member: the checkpoint IO object the Booster uses when :meth:`control_checkpoint_io`
        is true; ``None`` (the default): the Booster's own."""
        return None

    # -- memory plan (concrete; plugins override it with their own layout) -----------------------------------
    def memory_plan(
        self,
        model: nn.Module,
        *,
        world_size: int,
        rank: int = 0,
        optimizer: Mapping[str, Any] | torch.optim.Optimizer | None = None,
        backend: str | None = None,
        device: str | torch.device | None = None,
        accumulation_steps: int = 1,
    ) -> MemoryPlan:
        """What one rank of ``world_size`` would hold and communicate if ``model`` (as passed to ``boost``; it
        may live on the meta device and is not changed) were prepared by this plugin, without allocating it.

        ``optimizer``: the ``build_optimizer`` config or the instance the run would use (read, never stepped;
        ``None``: no optimizer state). ``backend`` (``None``: gloo on a CPU device, nccl otherwise) and
        ``device`` (``None``: :attr:`device`; a plan made on a CPU machine for a GPU run passes ``"cuda"``) are
        where the plugin picks settings by them. With ``accumulation_steps`` > 1 the plan describes a window as
        ``ColossalAIOptimWrapper`` runs it (every micro-batch but the last under :meth:`no_sync`): the gradients
        it keeps (:data:`~stepforge.core.memory_plan.LIFETIMES` ``"window"``, ``"accumulated"``) and the
        collectives of the whole optimizer step. This default is a replicated layout (nothing is communicated);
        plugins that shard, offload or communicate override it from their own layout code.
        """
        from .memory_plan import replicated_plan

        return replicated_plan(
            self.name,
            model,
            world_size=world_size,
            rank=rank,
            optimizer=optimizer,
            accumulation_steps=accumulation_steps,
        )
