# SPDX-License-Identifier: Apache-2.0
"""``Plugin``: the contract between the Booster and a parallelism back-end, as an abstract base class.

ColossalAI's ``Plugin`` is the model (``supported_devices``, ``supported_precisions``, ``control_precision``,
``control_device``, ``support_no_sync``, ``configure``, ``no_sync``, ``control_checkpoint_io``); stepforge adds
what its Booster and Strategy ask of a plugin, so they never probe one:

- ``name``, ``device``, ``world_size``, ``rank``;
- ``precision`` (what the plugin applies itself, ``None`` when the Booster's mixed precision applies),
  ``explicit_precision`` (set by the user, so the Booster must not replace it) and ``set_precision``;
- ``prepare`` (stepforge's two-value form of ``configure``), returning a
  :class:`~stepforge.core.BoostedOptimizer`;
- ``max_norm`` and ``clip_grad_norm_`` (global-norm clipping over every rank and shard);
- ``builds_optimizer_config`` (``prepare`` accepts a ``build_optimizer`` config dict);
- the ``torch.distributed.checkpoint`` pair ``get_state_dict``/``set_state_dict``, ``prepare_dataloader``;
- ``mid_window_save_error``: whether a checkpoint taken inside an accumulation window can be saved;
- ``after_model_load``: what must follow a load of new weights into a prepared model (a ZeRO plugin copies them
  into its optimizers' fp32 masters, as ColossalAI's ``update_master_params``).

Every member is abstract here; :class:`~stepforge.core.PluginBase` implements all but ``name`` and
``prepare``, and every stepforge plugin subclasses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .protocols import BoostedOptimizer

if TYPE_CHECKING:
    from .memory_plan import MemoryPlan

__all__ = ["Plugin"]

Optimizers = torch.optim.Optimizer | BoostedOptimizer | Iterable[torch.optim.Optimizer | BoostedOptimizer]


class Plugin(ABC):
    """A parallelism back-end for :class:`stepforge.strategy.Booster` (``ddp``, ``fsdp``, ``zero2``, ...).

    A subclass that leaves a member unimplemented cannot be instantiated; the ``TypeError`` names the member.
    Subclass :class:`~stepforge.core.PluginBase` to inherit the shared implementation.
    """

    # -- identity and placement ----------------------------------------------------------------------------
    @property
    @abstractmethod
    def name(self) -> str:
        """The registry name (``"torch_ddp"``, ``"low_level_zero"``...); a class attribute in practice."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where ``prepare`` puts the model (the Booster's autocast runs on this device type)."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Ranks in the plugin's data-parallel group (1 without a process group)."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in that group (0 without a process group)."""

    @abstractmethod
    def supported_devices(self) -> list[str]:
        """Device types the plugin runs on (``["cpu", "cuda"]``)."""

    @abstractmethod
    def control_device(self) -> bool:
        """Whether ``prepare`` moves the model to :attr:`device` itself (ColossalAI's meaning)."""

    # -- precision -----------------------------------------------------------------------------------------
    @abstractmethod
    def supported_precisions(self) -> list[str]:
        """Precision names the plugin takes (``"fp32"``, ``"fp16"``, ``"bf16"``...)."""

    @abstractmethod
    def control_precision(self) -> bool:
        """Whether the plugin applies precision itself (then the Booster applies no mixed precision)."""

    @property
    @abstractmethod
    def precision(self) -> str | None:
        """The precision the plugin applies; ``None`` when it does not control precision."""

    @property
    @abstractmethod
    def explicit_precision(self) -> bool:
        """Whether :attr:`precision` was chosen by the user (``False``: a default the Booster may replace)."""

    @abstractmethod
    def set_precision(self, precision: str) -> None:
        """Adopt ``precision`` (the Booster's ``mixed_precision``) in place of a default one.

        Raises:
            ValueError: ``precision`` is not in :meth:`supported_precisions`, or differs from an explicit one.
        """

    # -- preparing ---------------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def builds_optimizer_config(self) -> bool:
        """Whether ``prepare`` accepts a ``build_optimizer`` config dict (built on the prepared parameters)."""

    @abstractmethod
    def prepare(
        self, model: nn.Module, optimizer: Any = None, **kwargs: Any
    ) -> tuple[nn.Module, BoostedOptimizer | None]:
        """Wrap ``model`` and ``optimizer`` for the back-end.

        Args:
            model: the module to train.
            optimizer: a torch optimizer over ``model``'s parameters, a :class:`BoostedOptimizer` already
                wrapped by the Booster's mixed precision, ``None``, or (with :attr:`builds_optimizer_config`)
                a config dict.
            **kwargs: ``criterion``, ``dataloader``, ``lr_scheduler`` as the Booster passes them.

        Returns:
            ``(model, optimizer)``: the optimizer satisfies :class:`~stepforge.core.BoostedOptimizer`
            (``None`` when none was given).
        """

    @abstractmethod
    def configure(
        self,
        model: nn.Module,
        optimizer: Any = None,
        criterion: Any = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[nn.Module, BoostedOptimizer | None, Any, Any, Any]:
        """ColossalAI's five-value form of :meth:`prepare`."""

    @abstractmethod
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
        """A dataloader over this rank's share of ``dataset`` (ColossalAI's signature)."""

    # -- gradient synchronisation and clipping ---------------------------------------------------------------
    @abstractmethod
    def supports_no_sync(self) -> bool:
        """Whether :meth:`no_sync` can skip gradient synchronisation (for accumulation)."""

    @abstractmethod
    def support_no_sync(self) -> bool:
        """ColossalAI's spelling of :meth:`supports_no_sync`."""

    @abstractmethod
    def no_sync(self, model: nn.Module | None, optimizer: Any = None) -> AbstractContextManager[Any]:
        """Skip gradient synchronisation of ``model`` (and a sharded ``optimizer``) for the block.

        ``model`` may be ``None`` (``Booster.no_sync(model=None, optimizer)``, as in ColossalAI) for a plugin
        whose optimizer holds the synchronisation; a plugin that needs the model raises ``TypeError``.

        Raises:
            RuntimeError: the plugin does not support it (:meth:`supports_no_sync` is ``False``).
        """

    @property
    @abstractmethod
    def max_norm(self) -> float:
        """Global-norm clipping applied inside ``optimizer.step()`` (0: off)."""

    @abstractmethod
    def clip_grad_norm_(
        self, model: nn.Module | None, optimizer: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip the gradients of ``optimizer``'s parameters by their global norm (over every rank and shard);
        return that norm (a 0-dim tensor)."""

    def support_lora(self) -> bool:
        """Whether ``Booster.enable_lora`` may add peft LoRA adapters to a model for this plugin (ColossalAI's
        member; ``False`` unless a plugin says otherwise: sharded parameters need peft's support)."""
        return False

    # -- checkpoints -------------------------------------------------------------------------------------------
    @abstractmethod
    def control_checkpoint_io(self) -> bool:
        """Whether the plugin decides what a checkpoint holds (through :meth:`get_state_dict`)."""

    @abstractmethod
    def get_state_dict(
        self, model: nn.Module, optimizers: Optimizers
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Model and optimizer state dicts for ``torch.distributed.checkpoint`` (as torch's
        ``torch.distributed.checkpoint.state_dict.get_state_dict``); ``dcp.load`` fills them in place."""

    @abstractmethod
    def set_state_dict(
        self,
        model: nn.Module,
        optimizers: Optimizers,
        model_state_dict: Mapping[str, Any],
        optim_state_dict: Mapping[str, Any],
    ) -> None:
        """Apply a pair filled by ``dcp.load`` (as :meth:`get_state_dict` returned it)."""

    @abstractmethod
    def after_model_load(self, model: nn.Module, optimizers: Iterable[Any]) -> None:
        """Called by ``Booster.load_model`` after new weights were loaded into the prepared ``model``.

        Args:
            model: the prepared model (what ``prepare`` returned).
            optimizers: the optimizers ``prepare`` returned together with ``model`` (possibly none).

        A plugin whose optimizer keeps its own copy of the weights (fp32 masters of fp16/bf16 parameters)
        refreshes that copy here; without it the next ``step()`` writes the old weights back. Plugins whose
        optimizers step the model's parameters directly do nothing.
        """

    @abstractmethod
    def mid_window_save_error(self, optimizer: Any) -> str | None:
        """Whether a checkpoint may be taken inside a gradient-accumulation window.

        ``None``: the window's gradients are all in the parameters' ``.grad`` (and, for FSDP2, its pending
        unsharded gradients), so a checkpoint can carry them. Otherwise a reason to refuse the save (part of
        the window was already reduced into buffers a checkpoint does not hold).
        """

    # -- memory plan (concrete; plugins override it with their own layout) -----------------------------------
    def memory_plan(
        self,
        model: nn.Module,
        *,
        world_size: int,
        rank: int = 0,
        optimizer: Mapping[str, Any] | None = None,
        backend: str | None = None,
        device: str | torch.device | None = None,
    ) -> MemoryPlan:
        """What one rank would hold and communicate if ``model`` were prepared by this plugin, without
        allocating it (``model`` may live on the meta device; it is not changed).

        Args:
            model: the model as it would be passed to ``boost``.
            world_size: the data-parallel world to plan for (need not be the current one).
            rank: the rank described (0, the default, holds the most where pieces are cut ``torch.chunk``-style).
            optimizer: the ``build_optimizer`` config the run would use (``None``: no optimizer state).
            backend: ``"nccl"``, ``"gloo"``... where the plugin picks settings by backend (``None``: gloo on a
                CPU device, nccl otherwise).
            device: the device the model would be trained on (``None``: the plugin's :attr:`device`); a plan made
                on a CPU machine for a GPU run passes ``"cuda"`` (what moves to the host depends on it).

        Returns:
            A :class:`~stepforge.core.memory_plan.MemoryPlan`. This default is a replicated layout (every rank
            holds every parameter, gradient and optimizer state; nothing is communicated); plugins that shard,
            offload or communicate override it from their own layout code.
        """
        from .memory_plan import replicated_plan

        return replicated_plan(self.name, model, world_size=world_size, rank=rank, optimizer=optimizer)
