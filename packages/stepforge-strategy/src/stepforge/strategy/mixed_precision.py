# SPDX-License-Identifier: Apache-2.0
"""Mixed precision for the Booster: ``"fp16"``, ``"bf16"``, ``"fp8"`` (torchao), ``"fp16_apex"`` (run as
``fp16``), a dict or an instance; names and dtypes come from :mod:`stepforge.core.precision`. A plugin that
owns precision (FSDP2, ZeRO) does its own."""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stepforge.core import HyperParameterError
from stepforge.core.precision import (
    MIXED_PRECISIONS,
    PRECISIONS,
    DynamicLossScaler,
    Precision,
    get_precision,
    validate_loss_scaler_args,
)

__all__ = [
    "MixedPrecision",
    "FP16TorchMixedPrecision",
    "FP16ApexMixedPrecision",
    "BF16MixedPrecision",
    "FP8MixedPrecision",
    "resolve_mixed_precision",
]

logger = logging.getLogger("stepforge.strategy")


class MixedPrecision:
    """Base class: how the Booster casts the forward (autocast to ``dtype``) and scales the loss (``name`` is the
    precision) for plugins that do not apply precision themselves."""

    name = "fp32"
    dtype: torch.dtype | None = None

    def make_scaler(self, process_group: Any = None) -> DynamicLossScaler | None:
        """The loss scaler (``None`` when the dtype needs none)."""
        return None

    def configure_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        """Make ``model``'s forward run under autocast: ``model.forward`` patched in place (an instance
        attribute, so the state-dict keys stay)."""
        if self.dtype is None:
            return model
        wanted = (device.type, self.dtype)
        marked = getattr(model, "_stepforge_autocast", None)  # our own marker, set below
        if marked is not None:
            if marked != wanted:
                raise ValueError(f"model already runs under autocast {marked}; cannot switch to {wanted}.")
            return model
        original = model.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device.type, dtype=self.dtype):
                return original(*args, **kwargs)

        model.forward = forward
        model._stepforge_autocast = wanted  # type: ignore[assignment]  # mypy: nn.Module attributes are Tensor | Module
        return model

    def configure(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, criterion: Any = None
    ) -> tuple[nn.Module, Any, Any]:
        """ColossalAI's ``configure``: ``model`` in a :class:`~stepforge.strategy.ModelWrapper` whose forward runs under
        autocast, ``optimizer`` in an :class:`~stepforge.strategy.OptimizerWrapper` with this precision's loss scaler,
        ``criterion`` unchanged."""
        from .boosted_model import ModelWrapper
        from .boosted_optimizer import OptimizerWrapper

        first = next(iter(model.parameters()), None)
        self.configure_model(model, first.device if first is not None else torch.device("cpu"))
        wrapped = OptimizerWrapper(optimizer, scaler=self.make_scaler()) if optimizer is not None else None
        return ModelWrapper(model), wrapped, criterion

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FP16TorchMixedPrecision(MixedPrecision):
    """fp16 autocast with dynamic loss scaling (ColossalAI's signature; ``torch.amp.GradScaler`` semantics)."""

    name = "fp16"
    dtype = PRECISIONS["fp16"].autocast_dtype

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        checked = validate_loss_scaler_args(
            "FP16TorchMixedPrecision",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
        )
        self.scaler_kwargs: dict[str, Any] = dict(
            init_scale=checked["initial_scale"],
            growth_factor=checked["growth_factor"],
            backoff_factor=checked["backoff_factor"],
            growth_interval=checked["growth_interval"],
        )

    def make_scaler(self, process_group: Any = None) -> DynamicLossScaler:
        return DynamicLossScaler(**self.scaler_kwargs, process_group=process_group)

    def __repr__(self) -> str:
        return f"FP16TorchMixedPrecision({self.scaler_kwargs})"


_APEX_NOTED = False


class FP16ApexMixedPrecision(FP16TorchMixedPrecision):
    """``"fp16_apex"``: run as torch fp16 autocast with dynamic loss scaling (Apex is not used): ``opt_level``
    ``"O1"``/``"O2"``, ``loss_scale`` ``"dynamic"`` or the initial scale, ``verbosity`` accepted."""

    name = "fp16"

    def __init__(self, opt_level: str = "O1", loss_scale: str | float = "dynamic", verbosity: int = 1,
                 **kwargs: Any) -> None:  # fmt: skip
        if kwargs:
            raise TypeError(
                f"FP16ApexMixedPrecision: argument(s) {', '.join(map(repr, sorted(kwargs)))} have no torch "
                "equivalent here; supported: opt_level, loss_scale, verbosity."
            )
        if opt_level not in ("O1", "O2"):
            raise ValueError(f"FP16ApexMixedPrecision: opt_level must be 'O1' or 'O2', got {opt_level!r}.")
        if loss_scale == "dynamic":
            super().__init__()
        elif isinstance(loss_scale, int | float) and not isinstance(loss_scale, bool):
            super().__init__(init_scale=float(loss_scale))
        else:
            raise ValueError(
                f"FP16ApexMixedPrecision: loss_scale must be 'dynamic' or a number, got {loss_scale!r}."
            )
        global _APEX_NOTED
        if not _APEX_NOTED:
            _APEX_NOTED = True
            logger.warning(
                "mixed_precision='fp16_apex' runs as torch fp16 autocast with dynamic loss scaling "
                "(the same as 'fp16'); NVIDIA Apex is not used."
            )


class BF16MixedPrecision(MixedPrecision):
    """bf16 autocast over fp32 parameters; no loss scaling (bf16 has fp32's exponent range)."""

    name = "bf16"
    dtype = PRECISIONS["bf16"].autocast_dtype


def fp8_requirement_error() -> str | None:
    """Why fp8 training cannot run here, or ``None`` when it can."""
    if importlib.util.find_spec("torchao") is None:
        why = "torchao is not installed (pip install torchao)"
    elif not torch.cuda.is_available():
        why = "no CUDA device is available"
    elif torch.cuda.get_device_capability() < (8, 9):
        why = "this GPU is {}.{}".format(*torch.cuda.get_device_capability())
    else:
        return None
    return (
        "mixed_precision='fp8' needs torchao's float8 training and an NVIDIA GPU of compute capability 8.9 or "
        f"newer (Ada, Hopper); {why}. Use 'bf16' on this machine."
    )


class FP8MixedPrecision(MixedPrecision):
    """fp8 training through torchao (``convert_to_float8_training``) with bf16 autocast around it; a
    ``RuntimeError`` at construction without torchao or a GPU of compute capability >= 8.9."""

    name = "fp8"
    dtype = PRECISIONS["fp8"].autocast_dtype

    def __init__(self, **float8_config: Any) -> None:
        reason = fp8_requirement_error()
        if reason is not None:
            raise RuntimeError(reason)
        self.float8_config = float8_config

    def configure_model(self, model: nn.Module, device: torch.device) -> nn.Module:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(**self.float8_config) if self.float8_config else None
        convert_to_float8_training(model, config=config)
        return super().configure_model(model, device)


#: canonical name in :data:`stepforge.core.precision.PRECISIONS` -> the class that applies it here.
_CLASSES: dict[str, type[MixedPrecision]] = {
    "fp16": FP16TorchMixedPrecision,
    "fp16_apex": FP16ApexMixedPrecision,
    "bf16": BF16MixedPrecision,
    "fp8": FP8MixedPrecision,
}


def _row(name: Any) -> Precision | None:
    """The table row of a precision name, ``None`` for anything else."""
    try:
        return get_precision(name, owner="mixed_precision") if isinstance(name, str) else None
    except HyperParameterError:
        return None


def resolve_mixed_precision(spec: str | Mapping[str, Any] | MixedPrecision | None) -> MixedPrecision | None:
    """A :class:`MixedPrecision` from a name, a ``dict(type=name, **kwargs)`` or an instance; fp32 gives
    ``None``."""
    if spec is None or isinstance(spec, MixedPrecision):
        return spec
    if isinstance(spec, str):
        row = _row(spec)
        if row is None:
            raise ValueError(
                f"mixed_precision must be one of {', '.join(map(repr, MIXED_PRECISIONS))}, a dict with 'type' "
                f"or a MixedPrecision instance; got {spec!r}."
            )
        return None if row.name == "fp32" else _CLASSES[row.name]()
    if isinstance(spec, Mapping):
        kwargs = dict(spec)
        name = kwargs.pop("type", None)
        row = _row(name)
        if row is None or row.name not in _CLASSES:
            raise ValueError(
                f"mixed_precision dict needs 'type' in {', '.join(map(repr, MIXED_PRECISIONS))}; got {name!r}."
            )
        return _CLASSES[row.name](**kwargs)
    raise TypeError(
        f"mixed_precision must be a str, a dict or a MixedPrecision instance, got {type(spec).__name__}."
    )


def precision_name(spec: Any) -> str | None:
    """The plain precision name of a ``mixed_precision`` argument (``'fp16_apex'`` -> ``'fp16'``)."""
    if spec is None:
        return None
    if isinstance(spec, MixedPrecision):
        return spec.name
    row = _row(spec.get("type") if isinstance(spec, Mapping) else spec)
    return None if row is None else row.runs_as
