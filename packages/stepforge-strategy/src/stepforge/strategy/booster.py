# SPDX-License-Identifier: Apache-2.0
"""``Booster``: ColossalAI's Booster surface on torch's engines (DDP, FSDP2, DCP, autocast).

::

    booster = Booster(mixed_precision="bf16", plugin="torch_ddp")
    model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(
        model, optimizer, criterion, dataloader, lr_scheduler)
    loss = criterion(model(x), y)
    booster.backward(loss, optimizer)
    optimizer.step(); optimizer.zero_grad()
    booster.save_model(model, "ckpt/model", shard=True)
    booster.save_optimizer(optimizer, "ckpt/optimizer")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from stepforge.core import BoostedOptimizer, Plugin, WrappedModel, build_optimizer, unwrap_optimizer
from stepforge.core.precision import warn_slow_precision

from ._plugin_setup import PendingAutoPlugin, adopt_precision, auto_candidates, build_plugin, resolve_at_boost
from .accelerator import Accelerator
from .boosted_model import ModelWrapper, enable_lora, plugin_module, require_peft
from .boosted_optimizer import OptimizerWrapper
from .checkpoint_io import BoosterCheckpointIO, CheckpointIO, GeneralCheckpointIO
from .compile import apply_compile, compile_config, refuse_compiled_wrapper
from .data import make_stateful
from .lazy import has_meta_tensors, materialize_model
from .memory import AutoChoice
from .mixed_precision import MixedPrecision, precision_name, resolve_mixed_precision

__all__ = ["Booster"]


class Booster:
    """Apply a plugin (parallelism) and a mixed precision to models and optimizers.

    Args:
        mixed_precision: ``None``, ``"fp16"``, ``"bf16"``, ``"fp8"``, ``"fp16_apex"``, a dict
            (``dict(type="fp16", init_scale=2**12)``) or a :class:`~stepforge.strategy.MixedPrecision`.
        plugin: ``None`` (``single`` on one process, ``torch_ddp`` under a process group of several ranks),
            a registry name (``"torch_fsdp"``, ``"gemini"``, ``"low_level_zero"``...), a dict
            (``dict(type="LowLevelZeroPlugin", stage=2, precision="bf16")``) or a
            :class:`stepforge.core.Plugin` instance.
        device: passed to a plugin built here when its constructor takes ``device``; for a plugin that does not
            place the model (``control_device()`` is ``False``) the :class:`Accelerator` ``boost`` moves it to.
        memory_budget: ``dict(device=..., host=..., inputs=..., criterion=..., accumulation_steps=...)``: bytes
            (or ``"70GiB"``) a rank may use (default: the free memory), optionally an example micro-batch and
            the micro-batches per optimizer step. With ``plugin="auto"`` (or ``dict(type="auto",
            candidates=[...])``) ``boost`` takes the fastest plugin whose :func:`~stepforge.strategy.estimate`
            fits (``docs/what-fits.md``); with another plugin it checks that one. What cannot fit raises
            :class:`~stepforge.strategy.MemoryBudgetError` at ``boost``, before any large allocation.

    Attributes:
        checkpoint_io: the :class:`~stepforge.strategy.CheckpointIO` every ``save_*``/``load_*`` goes through
            (see :meth:`_checkpoint_io`).
        accelerator: the :class:`Accelerator`, or ``None`` when the plugin places the model.

    A plugin that controls precision (``plugin.control_precision()``: FSDP2, gemini, ZeRO) adopts
    ``mixed_precision`` unless its precision was set explicitly (``plugin.explicit_precision``); an explicit one
    that differs from ``mixed_precision`` is an error. Plugins without precision get the Booster's mixed
    precision (autocast on the forward, fp16 loss scaling in the :class:`OptimizerWrapper`).

    Raises:
        ValueError: a precision conflict, an unknown precision.
        TypeError: ``plugin`` is not a name, a dict or a :class:`stepforge.core.Plugin`.
        UnknownNameError: an unknown plugin name (with ``pip install ...`` for known ones).
    """

    def __init__(
        self,
        mixed_precision: str | Mapping[str, Any] | MixedPrecision | None = None,
        plugin: str | Mapping[str, Any] | Plugin | None = None,
        *,
        device: str | torch.device | None = None,
        memory_budget: Mapping[str, Any] | None = None,
    ) -> None:
        wanted = precision_name(mixed_precision)
        if mixed_precision is not None and wanted is None:
            resolve_mixed_precision(mixed_precision)  # raises the precise error
        self._spec = (mixed_precision, wanted, device)
        self.memory_budget = memory_budget
        #: the candidates of ``plugin="auto"`` until ``boost`` chose one (``None``: a plugin was given)
        self._auto = auto_candidates(plugin)
        #: what ``plugin="auto"`` chose at ``boost`` (the plugin, the table, the reason), else ``None``
        self.auto_choice: AutoChoice | None = None
        if self._auto is not None:
            self._configure(PendingAutoPlugin(device), general_io=False)
        else:
            self._configure(build_plugin(plugin, device), general_io=plugin is None)

    def _configure(self, plugin: Plugin, *, general_io: bool) -> None:
        """Adopt ``plugin``: the accelerator where it does not place the model, its precision or the Booster's
        mixed precision, the checkpoint IO."""
        mixed_precision, wanted, device = self._spec
        self.plugin: Plugin = plugin
        self.accelerator: Accelerator | None = None
        if not self.plugin.control_device():
            self.accelerator = Accelerator(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.plugin.control_precision():
            adopt_precision(self.plugin, mixed_precision, wanted)
            self.mixed_precision: MixedPrecision | None = None
        else:
            self.mixed_precision = resolve_mixed_precision(mixed_precision)
        self.checkpoint_io: CheckpointIO = self._checkpoint_io(default_plugin=general_io)

    def _checkpoint_io(self, *, default_plugin: bool) -> CheckpointIO:
        """The plugin's ``get_checkpoint_io()`` when it returns one and ``control_checkpoint_io()`` is true (as
        ColossalAI), else a :class:`GeneralCheckpointIO` (which also saves optimizers ``boost`` did not wrap) for
        the default plugin or one that does not control checkpoint IO, else a :class:`BoosterCheckpointIO`."""
        controls = bool(self.plugin.control_checkpoint_io())
        own = self.plugin.get_checkpoint_io() if controls else None
        if own is None:
            general = default_plugin or not controls
            return GeneralCheckpointIO(self.plugin) if general else BoosterCheckpointIO(self.plugin)
        if not isinstance(own, CheckpointIO):
            raise TypeError(
                f"Booster: plugin {self.plugin.name!r} returned a {type(own).__name__} from get_checkpoint_io(); "
                "return a stepforge.strategy.CheckpointIO, or None for the Booster's own."
            )
        return own

    # -- boost ---------------------------------------------------------------------------------------------
    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None,
        criterion: Any = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
        *,
        compile: bool | Mapping[str, Any] | None = False,
        accumulation_steps: int | None = None,
    ) -> tuple[nn.Module, Any, Any, Any, Any]:
        """Wrap the five for the plugin and the mixed precision; returns them in the same order.

        The model comes back as a :class:`ModelWrapper` (``.module``: DDP/FSDP2's module, ``.unwrap()``: yours)
        unless the plugin returns its own :class:`stepforge.core.WrappedModel`; the optimizer as a
        :class:`stepforge.core.BoostedOptimizer` (the plugin's, or an :class:`OptimizerWrapper` with the Booster's
        loss scaling); the dataloader with ``state_dict``/``load_state_dict`` (the data position).

        Keyword only (not in ColossalAI): ``compile``, ``True`` or a dict of ``torch.compile`` arguments with
        optional ``target`` (default ``"forward"``) and ``disable``, compiles the prepared model in place, its
        state-dict keys and checkpoints staying the eager model's (:mod:`stepforge.strategy.compile`);
        ``accumulation_steps`` is the micro-batches per optimizer step for ``plugin="auto"`` and
        ``memory_budget`` (``None``: the budget's, default 1). A model with meta tensors (built under
        :class:`~stepforge.strategy.LazyInitContext`) is materialised where the plugin keeps it, with the values
        of an eager build (:mod:`stepforge.strategy.lazy`).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"Booster.boost: model must be a torch.nn.Module, got {type(model).__name__}.")
        compile_cfg = compile_config(compile, where="Booster.boost")
        if compile_cfg is not None:
            refuse_compiled_wrapper(model, where="Booster.boost")
        if self._auto is not None or self.memory_budget is not None:
            self._fit_memory(model, optimizer, accumulation_steps)
        plugin = self.plugin
        if not plugin.materializes_meta_model and has_meta_tensors(model):
            # a lazy model, whole, where the plugin keeps it (FSDP2's plugins materialise their shards instead)
            materialize_model(
                model, self.accelerator.device if self.accelerator is not None else plugin.device
            )
        if isinstance(optimizer, Mapping) and not plugin.builds_optimizer_config:
            optimizer = build_optimizer(dict(optimizer), model.parameters())
        if optimizer is not None and not isinstance(optimizer, Mapping | torch.optim.Optimizer):
            raise TypeError(
                "Booster.boost: optimizer must be a torch.optim.Optimizer or a build_optimizer config dict, got "
                f"{type(optimizer).__name__}."
            )
        effective = plugin.precision or (
            self.mixed_precision.name if self.mixed_precision is not None else None
        )
        warn_slow_precision(effective, plugin.device, where=f"Booster.boost(plugin={type(plugin).__name__})")
        if self.accelerator is not None:
            model = self.accelerator.configure_model(model)
        if self.mixed_precision is not None:
            self.mixed_precision.configure_model(model, plugin.device)
        if (
            not plugin.control_precision()
            and isinstance(optimizer, torch.optim.Optimizer)
            and not isinstance(optimizer, BoostedOptimizer)
        ):
            # ColossalAI's order: the Booster's mixed precision wraps the optimizer, then the plugin prepares
            optimizer = self._wrap_for_mixed_precision(model, optimizer)
        # ColossalAI's call: a stepforge plugin's configure is its prepare with the other three passed through
        model, boosted, criterion, dataloader, lr_scheduler = plugin.configure(
            model, optimizer, criterion, dataloader, lr_scheduler
        )
        if boosted is not None:
            if not isinstance(boosted, BoostedOptimizer):
                raise TypeError(
                    f"Booster.boost: plugin {plugin.name!r} returned a {type(boosted).__name__} from prepare() "
                    "(or configure()); a plugin must return an optimizer implementing "
                    "stepforge.core.BoostedOptimizer (wrap a torch optimizer in stepforge.strategy.OptimizerWrapper)."
                )
            if isinstance(self.checkpoint_io, BoosterCheckpointIO):
                self.checkpoint_io.register(boosted, model)
        if compile_cfg is not None:
            apply_compile(model, compile_cfg, where="Booster.boost")
        if not isinstance(model, WrappedModel):
            model = ModelWrapper(model)
        if isinstance(boosted, OptimizerWrapper):
            boosted.bind_model(model)
        if dataloader is not None:
            dataloader = make_stateful(dataloader)
        return model, boosted, criterion, dataloader, lr_scheduler

    def _fit_memory(self, model: nn.Module, optimizer: Any, accumulation_steps: int | None) -> None:
        """``auto``: choose the plugin and adopt it; a budget: check the plugin fits (see ``memory_budget``)."""
        precision = self._spec[1] or ("fp32" if self._auto is not None else None)  # one precision for all
        choice = resolve_at_boost(
            self.plugin, self._auto, self.memory_budget, model, optimizer, precision, accumulation_steps
        )
        if choice is not None:
            self._auto = None
            self.auto_choice = choice
            plugin = build_plugin(dict(type=choice.plugin, **choice.settings), self._spec[2])
            if plugin.control_precision() and self._spec[1] is None:
                plugin.set_precision("fp32")  # as estimated, not the plugin's own default (ZeRO's fp16)
            self._configure(plugin, general_io=False)

    def _wrap_for_mixed_precision(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> OptimizerWrapper:
        plugin = self.plugin
        scaler = self.mixed_precision.make_scaler() if self.mixed_precision is not None else None
        return OptimizerWrapper(
            optimizer,
            scaler=scaler,
            max_norm=plugin.max_norm,
            clip_fn=lambda max_norm, norm_type: plugin.clip_grad_norm_(model, optimizer, max_norm, norm_type),
        )

    # -- training ------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: BoostedOptimizer) -> None:
        """``optimizer.backward(loss)``: the plugin's loss scaling and gradient reduction (the one route)."""
        _require_boosted(optimizer, "backward")
        optimizer.backward(loss)

    def supports_no_sync(self) -> bool:
        """Whether the plugin can skip gradient synchronisation (for accumulation)."""
        return self.plugin.supports_no_sync()

    def no_sync(self, model: nn.Module | None = None, optimizer: Any = None) -> AbstractContextManager[Any]:
        """Skip gradient synchronisation for the block (forward and backward inside).

        Raises:
            RuntimeError: the plugin cannot (ColossalAI's gemini, ZeRO-2/3): accumulate without no_sync.
        """
        if not self.plugin.supports_no_sync():
            raise RuntimeError(
                f"Booster.no_sync: plugin {self.plugin.name!r} does not support no_sync; accumulate gradients "
                "without it (every micro-batch synchronises)."
            )
        return self.plugin.no_sync(None if model is None else plugin_module(model), optimizer)

    def clip_grad_norm_(
        self,
        optimizer: BoostedOptimizer,
        max_norm: float,
        norm_type: float = 2.0,
        model: nn.Module | None = None,
    ) -> torch.Tensor:
        """Clip by the global gradient norm over all ranks and shards (after unscaling); return the norm."""
        _require_boosted(optimizer, "clip_grad_norm_")
        return optimizer.clip_grad_norm_(max_norm, norm_type)

    # -- LoRA ------------------------------------------------------------------------------------------------
    def enable_lora(
        self,
        model: nn.Module,
        pretrained_dir: str | os.PathLike[str] | None = None,
        lora_config: Any = None,
        bnb_quantization_config: Any = None,
        quantize: bool = False,
    ) -> nn.Module:
        """Add LoRA adapters with peft before ``boost``: ``lora_config`` (a ``peft.LoraConfig``) for new
        adapters, or ``pretrained_dir`` for saved ones; returns the ``PeftModel`` to boost.

        Raises:
            ImportError: peft is missing (``pip install peft``).
            ValueError: the plugin does not support LoRA (FSDP2's ``torch_fsdp``/``gemini``), quantisation was
                asked for, or neither ``lora_config`` nor ``pretrained_dir`` was given.
        """
        require_peft("Booster.enable_lora")
        self._require_lora("enable_lora")
        if quantize or bnb_quantization_config is not None:
            raise ValueError(
                "Booster.enable_lora: quantize/bnb_quantization_config (bitsandbytes QLoRA) is not supported; "
                "leave them unset."
            )
        return enable_lora(model, pretrained_dir, lora_config)

    def save_lora_as_pretrained(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], use_safetensors: bool = False
    ) -> None:
        """Write the LoRA adapters and config to directory ``checkpoint`` (peft's layout; rank 0 writes)."""
        require_peft("Booster.save_lora_as_pretrained")
        self._require_lora("save_lora_as_pretrained")
        self.checkpoint_io.save_lora_as_pretrained(model, checkpoint, use_safetensors)

    def _require_lora(self, what: str) -> None:
        if not self.plugin.support_lora():
            raise ValueError(
                f"Booster.{what}: plugin {self.plugin.name!r} does not support LoRA (as in ColossalAI); use "
                "'torch_ddp' or 'single'."
            )

    # -- checkpoints (ColossalAI's signatures; see stepforge.strategy.checkpoint_io) --------------------------
    def save_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """:meth:`BoosterCheckpointIO.save_model`: the full model in the HF layout (every rank calls)."""
        self.checkpoint_io.save_model(
            model, checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_safetensors, use_async
        )

    def load_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        strict: bool = True,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """:meth:`BoosterCheckpointIO.load_model` (any world size)."""
        self.checkpoint_io.load_model(model, checkpoint, strict, low_cpu_mem_mode, num_threads)

    def save_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> None:
        """:meth:`BoosterCheckpointIO.save_optimizer` (every rank calls)."""
        self.checkpoint_io.save_optimizer(
            optimizer, checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_async=use_async
        )

    def load_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        prefix: str | None = None,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """:meth:`BoosterCheckpointIO.load_optimizer` (any world size)."""
        self.checkpoint_io.load_optimizer(optimizer, checkpoint, prefix, low_cpu_mem_mode, num_threads)

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        """:meth:`CheckpointIO.save_lr_scheduler` (every rank calls)."""
        self.checkpoint_io.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        """Load a file written by :meth:`save_lr_scheduler`."""
        self.checkpoint_io.load_lr_scheduler(lr_scheduler, checkpoint)

    @staticmethod
    def unwrap_optimizer(optimizer: Any) -> Any:
        """The torch optimizer under a boosted optimizer (``optimizer.unwrap()``)."""
        return unwrap_optimizer(optimizer)

    def __repr__(self) -> str:
        return f"Booster(mixed_precision={self.mixed_precision!r}, plugin={self.plugin!r})"


def _require_boosted(optimizer: Any, what: str) -> None:
    if not isinstance(optimizer, BoostedOptimizer):
        raise TypeError(
            f"Booster.{what}: optimizer must be the boosted optimizer boost() returned (a "
            f"stepforge.core.BoostedOptimizer), got {type(optimizer).__name__}."
        )
