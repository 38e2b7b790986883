# SPDX-License-Identifier: Apache-2.0
"""``LowLevelZeroPlugin``: ZeRO-1/2 for the Booster (``plugin="low_level_zero"``, ``"zero1"``, ``"zero2"``).

ColossalAI's signature. ``prepare`` casts the model to the working dtype, wraps it in
:class:`~.model.LowLevelZeroModel` (floating-point inputs cast to that dtype, as ColossalAI's ``cast_inputs``) and
wraps the optimizer in :class:`~stepforge.zero.low_level.LowLevelZeroOptimizer` with the plugin's
:class:`~stepforge.zero.config.LowLevelZeroConfig` (built once here, passed through unchanged). Unlike ColossalAI, ``no_sync``
works for both stages and checkpoints go through ``torch.distributed.checkpoint`` in the layout every plugin shares
(by parameter name, in each parameter's shape), loadable under any plugin at any world size. LoRA (peft) models are
supported as in ColossalAI (:mod:`.lora`). Device, precision adoption, ``prepare_dataloader`` and ``configure``
come from :class:`stepforge.core.Plugin`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from stepforge.core import BoostedOptimizer, HyperParameterError, Plugin, param_fqns
from stepforge.core.precision import PLUGIN_PRECISIONS, check_plugin_precision, validate_loss_scaler_args

from ..comm.algorithm import COLOSSAL_BUCKET_SIZE
from ..config import LowLevelZeroConfig
from ..low_level import LowLevelZeroOptimizer
from .lora import add_adapters_to_optimizer
from .memory_plan import zero_memory_plan
from .model import PRECISIONS, LowLevelZeroModel, explain_precision_errors, unwrap_prepared

__all__ = ["LowLevelZeroPlugin", "Zero1Plugin", "Zero2Plugin"]


class _DefaultPrecision(str):
    """The default ``"fp16"``, told apart from an explicit ``precision="fp16"`` (the Booster may replace it)."""

    __slots__ = ()


_FP16_DEFAULT = _DefaultPrecision("fp16")
_OWNER = "LowLevelZeroPlugin"


class LowLevelZeroPlugin(Plugin):
    """ZeRO-1/2 (optimizer state, and for stage 2 also gradients, sharded over the data-parallel ranks).

    Args (ColossalAI's ``LowLevelZeroPlugin`` names and defaults; as ``LowLevelZeroOptimizer``'s unless said):
        stage: 1 (state sharded, gradients all-reduced) or 2 (gradients reduce-scattered too).
        precision: ``"fp32"``, ``"fp16"`` (dynamic loss scaling) or ``"bf16"``: the working dtype of the model.
        initial_scale, ..., max_scale: the fp16 dynamic loss scaler (ignored for fp32/bf16).
        max_norm, norm_type: clip the global gradient norm inside ``optimizer.step()`` (0: off; any p > 0 or
            ``inf``, where ColossalAI allows only 2.0).
        reduce_bucket_size_in_m: gradient bucket size in millions of elements; ``None``: 4 on gloo (measured,
            ``stepforge.zero.comm.algorithm.GLOO_BUCKET_SIZE``), ColossalAI's 12 elsewhere.
        overlap_communication, cpu_offload, master_weights, communication_dtype, fp8_communication, verbose.
        overlap_allgather: the updated pieces are gathered while the next forward runs (each module waits for
            its own parameters); the prepared model's ``state_dict``/``load_state_dict``/``unwrap`` wait first.
        cast_inputs: cast floating-point inputs of the forward to the working dtype.
        use_fp8: fp8 matrix multiplies in the forward: only ``False`` (a ``True`` is refused, see the README).
        extra_dp_size: > 1: ColossalAI's ``ProcessGroupMesh(extra_dp_size, world // extra_dp_size)``, a grid of
            every rank: the optimizer shards over the default group (``torch.distributed`` initialised first).

    Raises:
        HyperParameterError: a bad argument (the message names it and the allowed values).
    """

    name = "low_level_zero"

    def __init__(
        self,
        stage: int = 1,
        precision: str = _FP16_DEFAULT,
        initial_scale: float = 2**32,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        reduce_bucket_size_in_m: float | None = None,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = True,
        overlap_allgather: bool = False,
        cpu_offload: bool = False,
        master_weights: bool = True,
        verbose: bool = False,
        cast_inputs: bool = True,
        fp8_communication: bool = False,
        use_fp8: bool = False,
        extra_dp_size: int = 1,
    ) -> None:
        # a precision left at its default may be replaced by the Booster's mixed_precision (set_precision)
        explicit = None if precision is _FP16_DEFAULT else check_plugin_precision(precision, owner=_OWNER)
        super().__init__(precision=explicit, default_precision="fp16")
        size = reduce_bucket_size_in_m
        if size is not None and (isinstance(size, bool) or not isinstance(size, int | float) or not size > 0):
            raise HyperParameterError(
                f"LowLevelZeroPlugin: reduce_bucket_size_in_m must be a number > 0, got {size!r}."
            )
        scaler = validate_loss_scaler_args(
            _OWNER, initial_scale=initial_scale, min_scale=min_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval, hysteresis=hysteresis,
            max_scale=max_scale,
        )  # fmt: skip
        for name, value in (("cast_inputs", cast_inputs), ("use_fp8", use_fp8)):
            if not isinstance(value, bool):
                raise HyperParameterError(f"LowLevelZeroPlugin: {name} must be a bool, got {value!r}.")
        if use_fp8:
            raise HyperParameterError(
                "LowLevelZeroPlugin: use_fp8=True (fp8 matrix multiplies in the forward, ColossalAI's FP8Hook) is "
                "not available in stepforge; set use_fp8=False (fp8_communication=True is: fp8 gradient wire)."
            )
        #: every optimizer's settings, checked here once and passed to each ``LowLevelZeroOptimizer`` unchanged
        self.config = LowLevelZeroConfig(
            stage=stage, default_bucket_size=COLOSSAL_BUCKET_SIZE,
            reduce_bucket_size=None if reduce_bucket_size_in_m is None else int(reduce_bucket_size_in_m * 1024**2),
            communication_dtype=communication_dtype, overlap_communication=overlap_communication,
            overlap_allgather=overlap_allgather, cpu_offload=cpu_offload, master_weights=master_weights,
            max_norm=max_norm, norm_type=norm_type, verbose=verbose, fp8_communication=fp8_communication,
            scaler=scaler, owner=_OWNER,
        )  # fmt: skip
        self.stage, self.max_norm, self.verbose = stage, self.config.max_norm, verbose
        self.cast_inputs, self.use_fp8 = cast_inputs, use_fp8
        if isinstance(extra_dp_size, bool) or not isinstance(extra_dp_size, int) or extra_dp_size < 1:
            raise HyperParameterError(
                "LowLevelZeroPlugin: extra_dp_size must be an int >= 1 (1: no extra data-parallel axis), got "
                f"{extra_dp_size!r}."
            )
        self.extra_dp_size = extra_dp_size
        self._optimizers: list[LowLevelZeroOptimizer] = []
        if extra_dp_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise HyperParameterError(
                    f"LowLevelZeroPlugin: extra_dp_size={extra_dp_size} needs torch.distributed initialised first "
                    "(its 2-D grid is built over the default group); call init_process_group before building the "
                    "plugin."
                )
            if fp8_communication:
                raise HyperParameterError(
                    "LowLevelZeroPlugin: fp8_communication is not supported with extra_dp_size > 1 (as in "
                    "ColossalAI); set fp8_communication=False."
                )
            # ColossalAI's ProcessGroupMesh(extra_dp_size, world // extra_dp_size) spans every rank: the grid it
            # shards over (stepforge.zero.comm.grid) is the default group, so only the shape is checked
            if dist.get_world_size() % extra_dp_size:
                raise HyperParameterError(
                    f"LowLevelZeroPlugin: extra_dp_size={extra_dp_size} must divide the world size "
                    f"{dist.get_world_size()}."
                )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(stage={self.stage}, precision={self.precision!r})"

    # -- precision -----------------------------------------------------------------------------------
    def supported_precisions(self) -> list[str]:
        """``fp32``, ``fp16`` (dynamic loss scaling) and ``bf16``: the working dtype of the model."""
        return list(PLUGIN_PRECISIONS)

    def control_precision(self) -> bool:
        """True: ``prepare`` casts the model and the optimizer scales the loss (the Booster adds no autocast)."""
        return True

    @property
    def precision(self) -> str:
        """The working precision (``"fp32"``, ``"fp16"`` or ``"bf16"``)."""
        return str(super().precision)

    @property
    def dtype(self) -> torch.dtype:
        """The working dtype of the prepared model's parameters."""
        return PRECISIONS[self.precision]

    def set_precision(self, precision: str) -> None:
        """Adopt the Booster's ``mixed_precision`` when ``precision`` was left at its default (before prepare).

        Raises:
            HyperParameterError: an unknown precision, a different explicit one, or a plugin already used.
        """
        canonical = check_plugin_precision(precision, owner=_OWNER)
        if self._optimizers and canonical != self.precision:
            raise HyperParameterError(
                "LowLevelZeroPlugin.set_precision: a model was already prepared in "
                f"{self.precision!r}; set the precision before prepare()."
            )
        super().set_precision(canonical)

    # -- preparing -----------------------------------------------------------------------------------
    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> tuple[torch.nn.Module, BoostedOptimizer | None]:
        """Move and cast ``model`` to the working dtype and wrap ``optimizer`` in ``LowLevelZeroOptimizer``.

        ``optimizer`` must be built over ``model``'s parameters (any ``torch.optim`` or stepforge optimizer);
        its param groups follow the cast (the parameters are converted in place). Other keyword arguments the
        Booster passes (``criterion``, ``dataloader``, ``lr_scheduler``) are not used.

        Returns:
            ``(LowLevelZeroModel, LowLevelZeroOptimizer or None)``; the optimizer is a
            :class:`stepforge.core.BoostedOptimizer` (``backward(loss)`` applies the fp16 loss scale).
        """
        if not isinstance(model, torch.nn.Module):
            raise HyperParameterError(
                f"LowLevelZeroPlugin.prepare: model must be a torch.nn.Module, got {type(model).__name__}."
            )
        if isinstance(model, LowLevelZeroModel):
            raise HyperParameterError(
                "LowLevelZeroPlugin.prepare: this model is already prepared; prepare it once."
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise HyperParameterError(
                "LowLevelZeroPlugin.prepare: optimizer must be a built torch.optim.Optimizer over the model's "
                f"parameters, got {type(optimizer).__name__}; build it first (stepforge.core.build_optimizer)."
            )
        if isinstance(optimizer, LowLevelZeroOptimizer):
            raise HyperParameterError(
                "LowLevelZeroPlugin.prepare: the optimizer is already a LowLevelZeroOptimizer; pass the inner one."
            )
        device = self.device
        self.bind_device()
        module = model.to(device=device, dtype=self.dtype)  # in place: the optimizer keeps its parameters
        wrapped = LowLevelZeroModel(module, self.dtype, self.precision, device, cast_inputs=self.cast_inputs)
        if optimizer is None:
            return wrapped, None
        add_adapters_to_optimizer(module, optimizer)  # LoRA adapters the optimizer does not hold yet
        zero = LowLevelZeroOptimizer.from_config(optimizer, self.config)
        wrapped.bind_optimizer(zero)
        self._optimizers.append(zero)
        return wrapped, zero

    def support_lora(self) -> bool:
        """True (as ColossalAI's plugin): ``Booster.enable_lora`` adds peft adapters before ``boost``; the
        frozen base weights are not sharded, and adapters the optimizer does not hold join their base layer's
        param group (see :mod:`stepforge.zero.plugin.lora`)."""
        return True

    # -- gradient synchronisation and clipping -------------------------------------------------------
    def no_sync(
        self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
    ) -> AbstractContextManager[Any]:
        """Keep gradients local for the block (the optimizer's ``no_sync``); the forward may run inside it."""
        return self._zero(optimizer, "no_sync").no_sync()

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.backward(loss)``: scales the loss for fp16 and reduces gradients as configured."""
        zero = self._zero(optimizer, "backward")
        with explain_precision_errors(self.device, self.precision, "backward"):
            zero.backward(loss)

    def clip_grad_norm_(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
    ) -> torch.Tensor:
        """Clip by the gradient norm over all shards; returns that global norm."""
        return self._zero(optimizer, "clip_grad_norm_").clip_grad_norm_(max_norm, norm_type)

    # -- checkpoints ---------------------------------------------------------------------------------
    def mid_window_save_refusal(self, optimizer: Any) -> str | None:
        """``None`` while the accumulation window's gradients are all in the parameters' ``.grad`` (every
        backward of the window so far ran under ``no_sync``); otherwise the reason a checkpoint cannot carry
        the window: part of it is already reduced into this rank's gradient pieces, which a checkpoint does
        not hold (a synchronised backward ran, at either stage)."""
        zero = self._zero(optimizer, "mid_window_save_refusal")
        if not zero.has_reduced_grads:
            return None
        return (
            f"stage {self.stage} already reduced part of this accumulation window into its gradient shards, which "
            "a checkpoint does not hold (run the window's micro-batches under no_sync, as the optimizer wrapper's "
            "optim_context does)"
        )

    def get_state_dict(
        self,
        model: torch.nn.Module,
        optimizers: torch.optim.Optimizer
        | BoostedOptimizer
        | Iterable[torch.optim.Optimizer | BoostedOptimizer],
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The DCP pair: the model's full state dict (original keys, replicated on every rank) and the
        optimizer's sharded state in the layout every plugin shares (keyed by parameter name as torch's
        ``get_optimizer_state_dict`` names them, each tensor this rank's piece in its parameter's shape:
        ``LowLevelZeroOptimizer.sharded_state_dict``), so it loads under any plugin at any world size; ``{}`` for
        the optimizer when ``optimizers`` is empty (a weights-only save or load)."""
        module = unwrap_prepared(model)
        zero = self._checkpointed(optimizers, "get_state_dict")
        if zero is None:
            return module.state_dict(), {}
        fqns = param_fqns(module)
        return module.state_dict(), zero.sharded_state_dict([fqns[s.param] for s in zero.layout.slots])  # type: ignore[index]

    def set_state_dict(
        self,
        model: torch.nn.Module,
        optimizers: torch.optim.Optimizer
        | BoostedOptimizer
        | Iterable[torch.optim.Optimizer | BoostedOptimizer],
        model_state_dict: Mapping[str, Any],
        optim_state_dict: Mapping[str, Any],
    ) -> None:
        """Apply a pair filled by ``torch.distributed.checkpoint.load`` (saved at any world size, under any plugin,
        or in the index-keyed layout of earlier versions); with
        no optimizers only the model (a weights-only load: refresh the masters with :meth:`after_model_load`)."""
        zero = self._checkpointed(optimizers, "set_state_dict")
        unwrap_prepared(model).load_state_dict(model_state_dict)
        if zero is not None:
            zero.load_sharded_state_dict(optim_state_dict)

    def after_model_load(self, model: torch.nn.Module, optimizers: Iterable[Any]) -> None:
        """Copy the loaded weights into the fp32 master pieces of every ``LowLevelZeroOptimizer`` among
        ``optimizers`` (``update_master_params``, as ColossalAI's checkpoint IO does after a model load);
        without it the next ``step()``, even at lr 0, writes the old weights back. No collective."""
        module = unwrap_prepared(model)
        for optimizer in optimizers:
            if isinstance(optimizer, LowLevelZeroOptimizer):
                optimizer.update_master_params(module)

    # -- memory plan ---------------------------------------------------------------------------------
    memory_plan = zero_memory_plan

    # -- helpers -------------------------------------------------------------------------------------
    def _zero(self, optimizer: Any, what: str) -> LowLevelZeroOptimizer:
        if optimizer is None:
            if len(self._optimizers) != 1:
                raise HyperParameterError(
                    f"LowLevelZeroPlugin.{what}: pass the optimizer returned by prepare() "
                    f"({len(self._optimizers)} prepared so far)."
                )
            return self._optimizers[0]
        if not isinstance(optimizer, LowLevelZeroOptimizer):
            raise HyperParameterError(
                f"LowLevelZeroPlugin.{what}: expected the LowLevelZeroOptimizer returned by prepare(), got "
                f"{type(optimizer).__name__}."
            )
        return optimizer

    def _checkpointed(self, optimizers: Any, what: str) -> LowLevelZeroOptimizer | None:
        """The one optimizer of a checkpoint pair (``None`` given: the one prepared); ``None`` for an empty
        iterable (a weights-only save or load)."""
        one = optimizers is None or isinstance(optimizers, torch.optim.Optimizer)
        items = [optimizers] if one else list(optimizers)
        if not items:
            return None
        if len(items) != 1:
            raise HyperParameterError(
                f"LowLevelZeroPlugin: checkpoints hold one optimizer per model, got {len(items)}; prepare one "
                "optimizer."
            )
        return self._zero(items[0], what)


def _fixed_stage(kwargs: dict[str, Any], stage: int) -> None:
    """Drop ``stage`` from ``kwargs`` of ``Zero1Plugin``/``Zero2Plugin``; a different one is an error."""
    given = kwargs.pop("stage", stage)
    if given != stage:
        raise HyperParameterError(
            f"zero{stage} is LowLevelZeroPlugin(stage={stage}); got stage={given!r}. Use the plugin name "
            f"'zero{given}' or 'low_level_zero' with stage={given!r}."
        )


class Zero1Plugin(LowLevelZeroPlugin):
    """``LowLevelZeroPlugin(stage=1)``: registered as ``zero1``."""

    name = "zero1"

    def __init__(self, precision: str = _FP16_DEFAULT, **kwargs: Any) -> None:
        _fixed_stage(kwargs, 1)
        super().__init__(stage=1, precision=precision, **kwargs)


class Zero2Plugin(LowLevelZeroPlugin):
    """``LowLevelZeroPlugin(stage=2)``: registered as ``zero2``."""

    name = "zero2"

    def __init__(self, precision: str = _FP16_DEFAULT, **kwargs: Any) -> None:
        _fixed_stage(kwargs, 2)
        super().__init__(stage=2, precision=precision, **kwargs)
